"""Consumer: receives batches on one ``IngestService.Consume`` stream and acks ranges."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import grpc
import numpy as np

from danube_ingest.client._errors import ConsumeError
from danube_ingest.client._producer import target
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


@dataclass(frozen=True, slots=True)
class Batch:
    """Messages delivered together, in delivery order."""

    topic: str
    entries: list[Entry]
    """The messages; ``entry.offset`` is each one's offset (what acks name)."""

    @property
    def offsets(self) -> list[int]:
        return [entry.offset for entry in self.entries]


class Consumer:
    """One consumer of a subscription, receiving batches.

    ``start`` applies when the subscription is created: ``"latest"``, ``"earliest"``, an
    offset (int), or ``("time", ms)``. Iterate to receive :class:`Batch` values; ``ack(batch)``
    acknowledges them (Exclusive and Failover: cumulatively, everything delivered up to the
    batch's last offset; Shared and KeyShared: exactly the batch's offsets). Unacknowledged
    messages are redelivered as the subscription's dispatch rules say (ack timeout, detach).
    The stream is not reconnected: a lost connection ends the iteration with
    :class:`ConsumeError` (subscribe again; the subscription resumes after its cursor).
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
    ) -> None:
        self.topic = topic
        self.sub_type = sub_type
        self._url = url
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
        self.consumer_id = 0
        """The daemon's id for this consumer (set by ``start``)."""

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
        """Open the stream and subscribe; returns once subscribed (``ConsumeError`` if the
        daemon refuses)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(target(self._url))
        self._requests.put_nowait(pb.ConsumeRequest(subscribe=self._subscribe))
        stub = pb_grpc.IngestServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._call = stub.Consume(self._request_stream())
        subscribed = await self._read(None)
        self.consumer_id = subscribed.consumer_id

    async def _request_stream(self) -> AsyncIterator[Any]:
        while True:
            request = await self._requests.get()
            if request is None:
                return
            yield request

    async def receive(self, timeout: float | None = None) -> Batch:
        """The next batch (waits for one; ``TimeoutError`` after ``timeout`` seconds)."""
        return Batch(self.topic, decode_batch(await self._read(timeout)))

    async def _read(self, timeout: float | None) -> Any:
        try:
            response = await asyncio.wait_for(self._call.read(), timeout)
        except grpc.aio.AioRpcError as exc:
            raise ConsumeError(exc.code(), exc.details() or "", self.topic) from None
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
        if self.sub_type in _CUMULATIVE:
            self._ack(offsets[0], offsets[-1])
            return
        first = last = offsets[0]
        for offset in offsets[1:]:
            if offset != last + 1:
                self._ack(first, last)
                first = offset
            last = offset
        self._ack(first, last)

    def _ack(self, first: int, last: int) -> None:
        self._requests.put_nowait(pb.ConsumeRequest(ack=pb.RangeAck(first=first, last=last)))

    async def close(self) -> None:
        """End the stream (acks queued before are sent first) and close the channel."""
        self._requests.put_nowait(None)
        if self._call is not None:
            with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
                await asyncio.wait_for(self._drained(), 1.0)
            self._call.cancel()
        if self._own_channel and self._channel is not None:
            await self._channel.close()

    async def _drained(self) -> None:
        while not self._requests.empty():
            await asyncio.sleep(0.01)


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
