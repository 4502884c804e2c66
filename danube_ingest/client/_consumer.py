"""Consumer: receives batches on one ``IngestService.Consume`` stream and acks ranges."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from bisect import bisect_right
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import grpc
import numpy as np
import numpy.typing as npt

from danube_ingest.client._auth import Credentials, TokenProvider
from danube_ingest.client._errors import ConsumeError, stream_lost
from danube_ingest.client._tls import TlsOptions, open_channel
from danube_ingest.proto import ingest_pb2 as pb
from danube_ingest.proto import ingest_pb2_grpc as pb_grpc
from danube_ingest.wal.framing import BATCH_HEADER_SIZE, Entry, decode_messages

SubType = Literal["exclusive", "shared", "failover", "key_shared"]
_TYPES = {
    "exclusive": pb.EXCLUSIVE,
    "shared": pb.SHARED,
    "failover": pb.FAILOVER,
    "key_shared": pb.KEY_SHARED,
}
_CUMULATIVE = frozenset({"exclusive", "failover"})

log = logging.getLogger(__name__)


#: How long ``Consumer.close`` waits for the daemon to apply its last acks and end the stream.
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Batch:
    """Messages delivered together, in delivery order."""

    topic: str
    entries: list[Entry]
    """The messages; ``entry.offset`` is each one's offset (what acks name)."""

    @property
    def offsets(self) -> list[int]:
        return [entry.offset for entry in self.entries]


#: Shared / KeyShared: how many acked ranges are remembered to recognise redeliveries of
#: acknowledged messages after a reconnect (an ack lost with the old stream).
ACKED_RANGES_KEPT = 4096


class Consumer:
    """One consumer of a subscription, receiving batches.

    ``start`` applies when the subscription is created: ``"latest"``, ``"earliest"``, an
    offset (int), or ``("time", ms)``. Iterate to receive :class:`Batch` values; ``ack(batch)``
    acknowledges them (Exclusive and Failover: cumulatively, everything delivered up to the
    batch's last offset; Shared and KeyShared: exactly the batch's offsets). Unacknowledged
    messages are redelivered as the subscription's dispatch rules say (ack timeout, detach).
    ``token``: a JWT or API key sent as ``authorization: Bearer`` (daemons with
    ``auth.enabled``), or a token provider (a function returning one, called each time the
    stream is opened). When the daemon ends the stream because the JWT expired, a provider
    that has a new token makes it a reconnect (below) with that token; otherwise the expiry is
    a refusal.

    **Reconnect** (``reconnect=True``, the default): when the stream is lost (the daemon died
    or restarted, the connection broke: UNAVAILABLE, CANCELLED, RESOURCE_EXHAUSTED,
    DEADLINE_EXCEEDED, ABORTED, and an INTERNAL that gRPC made rather than the daemon sent, see
    :func:`~danube_ingest.client.stream_lost`) or ends, the consumer subscribes again
    under the same name,
    with exponential backoff (``retry_backoff_ms`` doubling up to ``max_backoff_ms``), for at
    most ``reconnect_timeout_s`` without success (then ``ConsumeError``). The subscription
    resumes after its acknowledged messages: what this consumer held unacknowledged is
    redelivered, and messages it acknowledged whose ack was lost with the old stream (the
    daemon redelivers them) are acknowledged again and not returned a second time (Exclusive /
    Failover: every offset up to the highest acked; Shared / KeyShared: the last
    ``ACKED_RANGES_KEPT`` acked ranges). Two consumers of the same name take the stream from
    each other; give each its own name. Refusals, which a retry cannot mend (INVALID_ARGUMENT,
    NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED, FAILED_PRECONDITION, an INTERNAL error the
    daemon reported), end the iteration with :class:`ConsumeError` (``retriable`` false).

    ``tls``: as for :class:`Producer`.
    """

    def __init__(
        self,
        url: str,
        topic: str,
        subscription: str,
        *,
        consumer_name: str = "consumer",
        sub_type: SubType = "exclusive",
        start: Literal["latest", "earliest"] | int | tuple[Literal["time"], int] = "latest",
        key_filters: Iterable[str] = (),
        max_batch: int = 1000,
        channel: grpc.aio.Channel | None = None,
        tls: TlsOptions | None = None,
        reconnect: bool = True,
        retry_backoff_ms: float = 50.0,
        max_backoff_ms: float = 2000.0,
        reconnect_timeout_s: float = 60.0,
        token: str | TokenProvider | None = None,
    ) -> None:
        self.topic = topic
        self._credentials = Credentials(token)
        self.sub_type = sub_type
        self._url = url
        self._tls = tls
        self._own_channel = channel is None
        self._channel = channel
        self._subscribe = pb.Subscribe(
            topic=topic,
            subscription=subscription,
            consumer_name=consumer_name,
            type=_TYPES[sub_type],
            key_filters=list(key_filters),
            max_batch=max_batch,
        )
        kind, value = _start(start)
        self._subscribe.start = kind  # type: ignore[assignment]
        self._subscribe.start_value = value
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self._call: Any = None
        self._reconnect = reconnect
        self._backoff = retry_backoff_ms / 1000.0
        self._max_backoff = max_backoff_ms / 1000.0
        self._reconnect_timeout = reconnect_timeout_s
        self._closed = False
        self._cumulative = sub_type in _CUMULATIVE
        # Exclusive / Failover: the highest offset acked (every offset up to it is acked).
        self._acked_upto = -1
        # Shared / KeyShared: recently acked ranges; after a reconnect, those not yet seen again.
        self._acked_ranges: deque[tuple[int, int]] = deque(maxlen=ACKED_RANGES_KEPT)
        self._replay: list[tuple[int, int]] = []
        self._reading: tuple[Any, asyncio.Future[Any]] | None = None
        self.reconnects = 0
        """How many times the stream was opened again."""
        self.consumer_id = 0
        """The daemon's id for this consumer (set by ``start``, again on each reconnect)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the stream and subscribe; returns once subscribed. ``ConsumeError`` if the
        daemon refuses (a bad topic, credentials); a first subscribe that fails as a lost stream
        would (the topic not served yet while its new owner takes it over, the daemon
        restarting) is tried again as a reconnect is, within ``reconnect_timeout_s``."""
        if self._channel is None:
            self._channel = open_channel(self._url, self._tls)
        try:
            await self._open()
        except ConsumeError as exc:
            await self._reopen(exc)

    async def _open(self) -> None:
        assert self._channel is not None
        # Acks still queued for the old stream go out on the new one, after the Subscribe.
        pending = []
        while not self._requests.empty():
            request = self._requests.get_nowait()
            if request is not None and request.WhichOneof("request") == "ack":
                pending.append(request)
        self._requests.put_nowait(pb.ConsumeRequest(subscribe=self._subscribe))
        for request in pending:
            self._requests.put_nowait(request)
        stub = pb_grpc.IngestServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.Consume(
            self._request_stream(self._requests), metadata=self._credentials.metadata()
        )
        subscribed = await self._read(None)
        self.consumer_id = subscribed.consumer_id

    async def _reopen(self, cause: ConsumeError) -> None:
        """Subscribe again after ``cause`` broke the stream (backoff; ``cause`` if it cannot be
        mended or no attempt succeeds within ``reconnect_timeout_s``)."""
        deadline = time.monotonic() + self._reconnect_timeout
        delay = self._backoff
        while True:
            if self._closed or not self._reconnect or not cause.retriable:
                raise cause
            log.info(
                "consume stream lost, subscribing again topic=%s consumer=%s delay=%.3f error=%s",
                self.topic,
                self._subscribe.consumer_name,
                delay,
                cause,
            )
            if self._call is not None:
                self._call.cancel()
            # The old stream's request iterator ends; the new one gets its own queue.
            old, self._requests = self._requests, asyncio.Queue()
            while not old.empty():
                self._requests.put_nowait(old.get_nowait())
            old.put_nowait(None)
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, self._max_backoff)
            try:
                await self._open()
            except ConsumeError as exc:
                if time.monotonic() >= deadline:
                    raise exc from None
                cause = exc
                continue
            self.reconnects += 1
            self._replay = sorted(self._acked_ranges)
            return

    @staticmethod
    async def _request_stream(requests: asyncio.Queue[Any]) -> AsyncIterator[Any]:
        while True:
            request = await requests.get()
            if request is None:
                return
            yield request

    async def receive(self, timeout: float | None = None) -> Batch:
        """The next batch (waits for one; ``TimeoutError`` after ``timeout`` seconds; a
        reconnect happens within that time)."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    response = await self._read(None)
                except ConsumeError as exc:
                    await self._reopen(exc)
                    continue
                offsets = np.frombuffer(response.offsets, dtype="<u8")
                if response.count and self._seen_before(offsets):
                    entries = self._unseen(decode_batch(response))
                    if not entries:
                        continue
                    return Batch(self.topic, entries)
                return Batch(self.topic, decode_batch(response))

    def _seen_before(self, offsets: npt.NDArray[np.uint64]) -> bool:
        if self._cumulative:
            return self._acked_upto >= 0 and int(offsets.min()) <= self._acked_upto
        return bool(self._replay)

    def _unseen(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` without those acked before (acked again now: a redelivery after a
        reconnect of a message whose ack was lost)."""
        if self._cumulative:
            upto = self._acked_upto
            if any(entry.offset <= upto for entry in entries):
                self._ack(0, upto)
            return [entry for entry in entries if entry.offset > upto]
        replay = self._replay
        firsts = [first for first, _ in replay]
        fresh: list[Entry] = []
        seen = False
        for entry in entries:
            i = bisect_right(firsts, entry.offset) - 1
            if i >= 0 and entry.offset <= replay[i][1]:
                self._ack(entry.offset, entry.offset)
                seen = True
            else:
                fresh.append(entry)
        if not seen:
            # Redeliveries come before new messages: a batch without any ends the replay.
            self._replay = []
        return fresh

    async def _read(self, timeout: float | None) -> Any:
        # A read that is cancelled (a ``receive`` timing out, the task awaiting it cancelled)
        # would cancel the whole call, and with it the acks still queued for the stream: the
        # read is shielded and taken up by the next ``_read`` instead.
        call = self._call
        if self._reading is None or self._reading[0] is not call:
            pending = asyncio.ensure_future(call.read())
            # (Its error is the call's, seen by whoever reads next, or by nobody after close.)
            pending.add_done_callback(_seen)
            self._reading = (call, pending)
        reading = self._reading[1]
        try:
            async with asyncio.timeout(timeout):
                response = await asyncio.shield(reading)
        except grpc.aio.AioRpcError as exc:
            self._reading = None
            code, details = exc.code(), exc.details() or ""
            lost = stream_lost(
                code, details, exc.debug_error_string() or ""
            ) or self._credentials.renewable(code, details)
            raise ConsumeError(code, details, self.topic, lost=lost) from None
        self._reading = None
        if response is grpc.aio.EOF:
            raise ConsumeError(grpc.StatusCode.UNAVAILABLE, "the stream ended", self.topic)
        return response

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Batch:
        return await self.receive()

    def ack(self, batch: Batch) -> None:
        """Acknowledge ``batch`` (queued on the stream; never waits)."""
        offsets = sorted(batch.offsets)
        if not offsets:
            return
        if self._cumulative:
            self._acked_upto = max(self._acked_upto, offsets[-1])
            self._ack(offsets[0], offsets[-1])
            return
        first = last = offsets[0]
        for offset in offsets[1:]:
            if offset != last + 1:
                self._acked(first, last)
                first = offset
            last = offset
        self._acked(first, last)

    def _acked(self, first: int, last: int) -> None:
        self._acked_ranges.append((first, last))
        self._ack(first, last)

    def _ack(self, first: int, last: int) -> None:
        self._requests.put_nowait(pb.ConsumeRequest(ack=pb.RangeAck(first=first, last=last)))

    async def close(self) -> None:
        """End the stream and close the channel. Acks queued before are applied: the request
        stream is half-closed after them, and the daemon ends the stream once it has applied
        every ack it read (batches it sends meanwhile are dropped here and redelivered to the
        subscription). Waits at most ``CLOSE_TIMEOUT_S`` for that, then cancels the call."""
        self._closed = True
        self._requests.put_nowait(None)
        if self._call is not None:
            with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._ended()
            self._call.cancel()
        if self._own_channel and self._channel is not None:
            await self._channel.close()

    async def _ended(self) -> None:
        """Read (and drop) what the daemon still sends until it ends the stream."""
        call = self._call
        if self._reading is not None and self._reading[0] is call:
            response = await self._reading[1]
            self._reading = None
            if response is grpc.aio.EOF:
                return
        while await call.read() is not grpc.aio.EOF:
            pass


def _seen(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s outcome as retrieved (asyncio warns about an unread error)."""
    if not future.cancelled():
        future.exception()


def decode_batch(response: Any) -> list[Entry]:
    """The entries of a ConsumeResponse, with their offsets."""
    header = bytes(BATCH_HEADER_SIZE)
    count = response.count
    # (decode_messages reads the count from the header; the rest of it is not used here.)
    body = header[:12] + count.to_bytes(4, "little") + header[16:] + response.entries
    entries = decode_messages(body)[1]
    offsets = np.frombuffer(response.offsets, dtype="<u8")
    for entry, offset in zip(entries, offsets.tolist(), strict=True):
        entry.offset = offset
    return entries


def _start(start: object) -> tuple[int, int]:
    if start == "latest":
        return pb.START_LATEST, 0
    if start == "earliest":
        return pb.START_EARLIEST, 0
    if isinstance(start, int):
        return pb.START_OFFSET, start
    if isinstance(start, tuple) and len(start) == 2 and start[0] == "time":
        return pb.START_TIME, int(start[1])
    raise ValueError(f"start {start!r}: use 'latest', 'earliest', an offset or ('time', ms)")
