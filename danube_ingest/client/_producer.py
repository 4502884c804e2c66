"""Producer: batches messages and publishes them on one ``IngestService.Publish`` stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import grpc
import lz4.frame
import zstandard
from crc32c import crc32c

from danube_ingest.client._auth import Credentials, TokenProvider
from danube_ingest.client._errors import ClientError, DeliveryTimeoutError, PublishError
from danube_ingest.client._tls import TlsOptions, open_channel
from danube_ingest.errors import InvalidEntryError
from danube_ingest.proto import ingest_pb2 as pb
from danube_ingest.proto import ingest_pb2_grpc as pb_grpc
from danube_ingest.wal.block import IDEMPOTENT_BIT, encode_block, encode_payloads
from danube_ingest.wal.framing import Entry, entry_size

log = logging.getLogger(__name__)

Compression = Literal["none", "zstd", "lz4"]
_COMPRESSION = {"none": pb.COMPRESSION_NONE, "zstd": pb.COMPRESSION_ZSTD, "lz4": pb.COMPRESSION_LZ4}
#: Answers after which the producer resends a batch unchanged (same sequence): the daemon could
#: not take it now, or the connection went away. RESOURCE_EXHAUSTED backs off (flow control).
_RETRIABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
    }
)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: A stream refused as a whole for its credentials (``token``).
_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def new_producer_id() -> int:
    """A random idempotent producer id (bit 63 set, 62 random bits)."""
    return IDEMPOTENT_BIT | int.from_bytes(os.urandom(8), "little") >> 2


def target(url: str) -> str:
    """``host:port`` of a broker URL such as ``http://127.0.0.1:6650``."""
    return url.split("://", 1)[-1].rstrip("/")


class _Group:
    """The batches one ``send_many`` call was cut into: its future gives their offset ranges."""

    __slots__ = ("future", "left", "ranges")

    def __init__(self, batches: int) -> None:
        self.future: asyncio.Future[list[range]] = asyncio.get_running_loop().create_future()
        self.ranges: list[range] = [range(0)] * batches
        self.left = batches

    def done(self, slot: int, offsets: range) -> None:
        self.ranges[slot] = offsets
        self.left -= 1
        if not self.left and not self.future.done():
            self.future.set_result(self.ranges)

    def fail(self, error: ClientError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(eq=False)
class _Batch:
    index: int
    count: int
    futures: list[asyncio.Future[int]]
    group: _Group | None = None
    slot: int = 0
    request: Any = None
    sequence: int | None = None
    attempts: int = 0
    gaps: int = 0  # answers FAILED_PRECONDITION (a sequence gap) so far
    deadline: float = float("inf")  # (event loop time) failed with DeliveryTimeoutError after
    answered: asyncio.Event = field(default_factory=asyncio.Event)


class Producer:
    """Publishes to one topic in batches; each message's offset once it is durable.

    ``send`` queues a message and returns a future of its offset. Messages are cut into batches
    of at most ``max_batch_messages`` / ``max_batch_bytes`` (payload bytes), or after
    ``linger_ms`` since a batch's first message; at most ``max_in_flight`` batches wait for the
    daemon's answer (``send`` and ``send_many`` wait while ``max_buffered`` messages are
    unanswered). ``send_many`` hands over many plain messages at once (one future for all of
    them; encoded without a Python object per message: the fast path for bulk publishing).

    Guarantees: a batch the daemon could not take (RESOURCE_EXHAUSTED, with exponential
    backoff; UNAVAILABLE, a lost connection) is resent with the same sequence number, so with
    ``idempotent=True`` (the default) it is stored exactly once even if the first attempt was
    stored and only the answer was lost, also across a daemon restart. **Order**: with
    ``idempotent=True`` messages of one producer are stored in ``send`` order, also across
    resends (the daemon refuses a batch sent behind a resent one as a sequence gap,
    FAILED_PRECONDITION, and it is resent after it; a gap answered again to the same batch is
    resent with exponential backoff too). With ``idempotent=False`` that holds only with
    ``max_in_flight=1``: otherwise a resent batch may be stored after batches sent behind it
    (Kafka's rule without idempotence), and a resend after a lost answer may store a batch
    twice. A batch refused for good (bad input) fails
    its messages' futures with :class:`PublishError`; later batches go on. A message no WAL
    frame can hold (a routing key or attribute key over 65,535 UTF-8 bytes, a lone surrogate)
    is refused the same way (INVALID_ARGUMENT) without being sent; the rest of its batch goes
    on. ``flush`` waits for
    everything sent so far; ``close`` flushes, then closes the channel.

    ``tls`` (:class:`TlsOptions`) connects with TLS (a private CA, a client certificate for
    mutual TLS); an ``https://`` URL alone does too, with the system's trusted roots.
    ``token``: a JWT or API key sent as ``authorization: Bearer`` (daemons with
    ``auth.enabled``), or a token provider (a function returning one, called each time the
    stream is opened); a stream refused for it (UNAUTHENTICATED, PERMISSION_DENIED) fails the
    futures of every batch sent with :class:`PublishError` instead of resending them, except
    when the daemon ended the stream because the JWT expired and the provider has a new token:
    then the stream is opened again with it and unanswered batches are resent (same sequence:
    stored once).
    Deadline: a batch not answered within ``delivery_timeout`` seconds of being sealed (the
    daemon down for good, unreachable, or refusing with RESOURCE_EXHAUSTED all that time) fails
    its futures with :class:`DeliveryTimeoutError` (retriable); until then it is resent with the
    same sequence. Such a batch may or may not be stored, never twice. Later batches go on under
    a fresh producer id (sequences restart at 0), since the daemon would otherwise wait for the
    expired sequence for ever. ``None`` waits for ever.
    """

    def __init__(
        self,
        url: str,
        topic: str,
        *,
        producer_name: str = "",
        idempotent: bool = True,
        max_batch_messages: int = 1000,
        max_batch_bytes: int = 1024 * 1024,
        linger_ms: float = 5.0,
        max_in_flight: int = 8,
        max_buffered: int = 100_000,
        compression: Compression = "none",
        retry_backoff_ms: float = 50.0,
        max_backoff_ms: float = 2000.0,
        delivery_timeout: float | None = 120.0,
        channel: grpc.aio.Channel | None = None,
        tls: TlsOptions | None = None,
        token: str | TokenProvider | None = None,
    ) -> None:
        self.topic = topic
        self.producer_name = producer_name
        self._credentials = Credentials(token)
        self.producer_id = new_producer_id() if idempotent else 0
        self._url = url
        self._tls = tls
        self._max_messages = max_batch_messages
        self._max_bytes = max_batch_bytes
        self._linger = linger_ms / 1000.0
        self._max_in_flight = max_in_flight
        self._compression = _COMPRESSION[compression]
        self._backoff = retry_backoff_ms / 1000.0
        self._max_backoff = max_backoff_ms / 1000.0
        if delivery_timeout is not None and delivery_timeout <= 0:
            raise ValueError(
                f"delivery_timeout must be > 0 seconds or None (wait for ever), not "
                f"{delivery_timeout}"
            )
        # (Kafka's delivery.timeout.ms is 120 s too: long enough for a broker restart.)
        self._delivery_timeout = delivery_timeout
        self._expiry: asyncio.TimerHandle | None = None
        # A sent batch expired: its sequence may never be stored, so the producer id changes
        # (sequences restart) once no batch with an old sequence is outstanding.
        self._rotate = False
        self._channel = channel
        self._own_channel = channel is None
        self._open: list[Entry] = []
        self._open_futures: list[asyncio.Future[int]] = []
        self._open_bytes = 0
        self._linger_handle: asyncio.TimerHandle | None = None
        self._ready: list[_Batch] = []  # sealed or to resend, lowest index first
        self._in_flight: dict[int, _Batch] = {}
        self._next_index = 0
        self._next_sequence = 0
        self._max_buffered = max_buffered
        self._buffered = 0  # messages sent and not answered yet
        self._room = asyncio.Event()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._pause_until = 0.0
        self._runner: asyncio.Task[None] | None = None

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
        """Open the channel and the publish stream (reconnected as needed)."""
        if self._channel is None:
            self._channel = open_channel(self._url, self._tls)
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def send(
        self,
        payload: bytes,
        *,
        routing_key: str | None = None,
        attributes: dict[str, str] | None = None,
        publish_ms: int | None = None,
    ) -> asyncio.Future[int]:
        """Queue one message; the future gives its offset once it is durable.

        Waits only while ``max_buffered`` messages are queued and unanswered.
        """
        if self._closing:
            raise RuntimeError(f"producer for {self.topic} is closed")
        await self._reserve(1)
        entry = Entry(
            payload,
            publish_ms=int(time.time() * 1000) if publish_ms is None else publish_ms,
            producer_name=self.producer_name,
            routing_key=routing_key,
            attributes=attributes,
        )
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._open.append(entry)
        self._open_futures.append(future)
        self._open_bytes += len(payload)
        self._idle.clear()
        if len(self._open) >= self._max_messages or self._open_bytes >= self._max_bytes:
            self._seal()
        elif self._linger_handle is None:
            self._linger_handle = asyncio.get_running_loop().call_later(self._linger, self._seal)
        return future

    async def send_many(
        self,
        payloads: Sequence[bytes],
        *,
        routing_key: str | None = None,
        publish_ms: int | None = None,
    ) -> asyncio.Future[list[range]]:
        """Queue plain messages (same routing key and publish time; no attributes) in order,
        after everything sent before; the future gives their offsets once all are durable.

        The messages are cut into batches right away (``max_batch_messages`` /
        ``max_batch_bytes``, without lingering; messages queued by ``send`` go out first as a
        batch of their own), so the result is one offset range per batch, in order: message
        ``i`` is the ``i``-th offset of the ranges taken together. The guarantees are those of
        ``send``: order, durability, idempotent retries. If the daemon refuses one of the
        batches for good, the future fails with :class:`PublishError` (the other batches are
        stored). Waits while ``max_buffered`` messages are unanswered (a call larger than
        that waits until nothing is).
        """
        if self._closing:
            raise RuntimeError(f"producer for {self.topic} is closed")
        if not payloads:
            done: asyncio.Future[list[range]] = asyncio.get_running_loop().create_future()
            done.set_result([])
            return done
        await self._reserve(len(payloads))
        self._seal()
        when = int(time.time() * 1000) if publish_ms is None else publish_ms
        lengths = set(map(len, payloads))
        same = next(iter(lengths)) if len(lengths) == 1 else None
        cuts = self._cut(payloads, same)
        group = _Group(len(cuts) - 1)
        for slot in range(len(cuts) - 1):
            chunk = payloads[cuts[slot] : cuts[slot + 1]]
            block, sizes = encode_payloads(
                chunk,
                publish_ms=when,
                producer_name=self.producer_name,
                routing_key=routing_key,
                payload_len=same,
            )
            batch = _Batch(self._next_index, len(chunk), [], group, slot)
            self._next_index += 1
            self._enqueue(batch, block, sizes)
        self._idle.clear()
        return group.future

    def _cut(self, payloads: Sequence[bytes], size: int | None) -> list[int]:
        """Where ``payloads`` is cut into batches: [0, ..., len(payloads)]. ``size``: the
        length of every payload, if they all have one."""
        total = len(payloads)
        if size is not None:
            step = max(1, min(self._max_messages, self._max_bytes // max(size, 1)))
            return [*range(0, total, step), total]
        cuts = [0]
        count = nbytes = 0
        for i, payload in enumerate(payloads):
            if count and (count >= self._max_messages or nbytes + len(payload) > self._max_bytes):
                cuts.append(i)
                count = nbytes = 0
            count += 1
            nbytes += len(payload)
        cuts.append(total)
        return cuts

    async def _reserve(self, count: int) -> None:
        """Wait until ``count`` more messages fit in ``max_buffered`` (or nothing is buffered)."""
        while self._buffered and self._buffered + count > self._max_buffered:
            self._room.clear()
            await self._room.wait()
        self._buffered += count

    async def flush(self) -> None:
        """Send what is queued now and wait until every message sent so far is answered."""
        self._seal()
        await self._idle.wait()

    async def close(self) -> None:
        """Flush, then stop the stream and close the channel."""
        if self._runner is None:
            return
        await self.flush()
        self._closing = True
        self._wake.set()
        runner, self._runner = self._runner, None
        runner.cancel()
        with _suppress_cancel():
            await runner
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._own_channel and self._channel is not None:
            await self._channel.close()

    # -- batching ----------------------------------------------------------------------------

    def _seal(self) -> None:
        if self._linger_handle is not None:
            self._linger_handle.cancel()
            self._linger_handle = None
        if not self._open:
            return
        entries = self._open
        batch = _Batch(self._next_index, len(entries), self._open_futures)
        self._next_index += 1
        self._open, self._open_futures, self._open_bytes = [], [], 0
        try:
            block, sizes = encode_block(entries)
        except InvalidEntryError:
            entries = self._refuse_unframable(batch, entries)
            if not entries:
                return
            block, sizes = encode_block(entries)
        self._enqueue(batch, block, sizes)

    def _enqueue(self, batch: _Batch, block: bytes, sizes: bytes) -> None:
        """Build the batch's request (compressed as configured) and queue it for the stream."""
        data = block
        if self._compression == pb.COMPRESSION_ZSTD:
            data = zstandard.ZstdCompressor().compress(block)
        elif self._compression == pb.COMPRESSION_LZ4:
            data = lz4.frame.compress(block)
        batch.request = pb.PublishRequest(
            topic=self.topic,
            producer_id=self.producer_id,
            count=batch.count,
            entries=data,
            sizes=sizes,
            crc32c=crc32c(block),
            compression=self._compression,
            request_id=batch.index,
        )
        if self._delivery_timeout is not None:
            loop = asyncio.get_running_loop()
            batch.deadline = loop.time() + self._delivery_timeout
            if self._expiry is None:
                self._expiry = loop.call_at(batch.deadline, self._expire)
        self._ready.append(batch)
        self._wake.set()

    def _refuse_unframable(self, batch: _Batch, entries: list[Entry]) -> list[Entry]:
        """Fail the futures of ``batch``'s messages that no WAL frame can hold (a routing or
        attribute key over 65,535 bytes...) with INVALID_ARGUMENT, as the daemon refuses what
        breaks its limits; ``batch`` keeps the others, which are returned (none: the batch is
        released)."""
        kept: list[Entry] = []
        kept_futures: list[asyncio.Future[int]] = []
        for entry, future in zip(entries, batch.futures, strict=True):
            try:
                entry_size(entry)
            except InvalidEntryError as exc:
                log.info("message refused before sending topic=%s error=%s", self.topic, exc)
                future.set_exception(
                    PublishError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{exc}: no WAL frame can hold this message; nothing of it was sent",
                        self.topic,
                    )
                )
                continue
            kept.append(entry)
            kept_futures.append(future)
        refused = _Batch(batch.index, batch.count - len(kept), [])
        batch.count, batch.futures = len(kept), kept_futures
        if not kept:
            batch.count = refused.count
            self._release(batch)
            return []
        self._buffered -= refused.count
        self._room.set()
        return kept

    def _requeue(self, batch: _Batch) -> None:
        self._ready.append(batch)
        self._ready.sort(key=lambda b: b.index)
        self._wake.set()

    # -- the stream ----------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = self._backoff
        while not self._closing:
            assert self._channel is not None
            stub = pb_grpc.IngestServiceStub(self._channel)  # type: ignore[no-untyped-call]
            call = stub.Publish(metadata=self._credentials.metadata())
            reader = asyncio.get_running_loop().create_task(self._read(call))
            try:
                await self._write(call, reader)
                delay = self._backoff
            except (grpc.aio.AioRpcError, ConnectionError, asyncio.InvalidStateError) as exc:
                # (InvalidStateError: a write to a call that already failed, e.g. the daemon
                # died between two writes; the reader has or will have its error.)
                log.info("publish stream lost topic=%s error=%r", self.topic, exc)
                if (
                    isinstance(exc, grpc.aio.AioRpcError)
                    and exc.code() in _REFUSED
                    and self._credentials.renewable(exc.code(), exc.details() or "")
                ):
                    log.info("token expired, publishing with a new one topic=%s", self.topic)
                    delay = self._backoff
                elif isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _REFUSED:
                    # Credentials refused: resending cannot help; fail what was sent.
                    error = PublishError(exc.code(), exc.details() or "", self.topic)
                    refused = [*self._in_flight.values(), *self._ready]
                    self._in_flight.clear()
                    self._ready.clear()
                    for batch in refused:
                        self._fail(batch, error, False)
            finally:
                reader.cancel()
                with _suppress_cancel():
                    await reader
                call.cancel()
            # Every unanswered batch is resent, in order, with its sequence number.
            for batch in list(self._in_flight.values()):
                self._requeue(batch)
            self._in_flight.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_backoff)

    async def _write(self, call: Any, reader: asyncio.Task[None]) -> None:
        while True:
            if reader.done():
                reader.result()  # the stream ended: raises its error
                raise ConnectionError("publish stream ended")
            pause = self._pause_until - time.monotonic()
            ready = self._ready
            # After a refusal, earlier batches are resent first: wait until all sent ones are
            # answered, so that nothing overtakes them.
            blocked = ready and ready[0].attempts > 0 and self._in_flight
            # After an expiry, new sequences start under a fresh producer id: wait until no
            # batch with an old sequence is in flight (the ready ones with one come first).
            blocked = blocked or (ready and self._rotate and self._in_flight)
            if pause > 0 or not ready or blocked or len(self._in_flight) >= self._max_in_flight:
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait(
                    {waiter, reader},
                    timeout=pause if pause > 0 else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                waiter.cancel()
                continue
            batch = ready.pop(0)
            if self.producer_id:
                if batch.sequence is None:
                    if self._rotate:
                        self._rotate = False
                        self.producer_id = new_producer_id()
                        self._next_sequence = 0
                        log.info(
                            "new producer id after a delivery timeout topic=%s producer_id=%#x",
                            self.topic,
                            self.producer_id,
                        )
                    batch.sequence = self._next_sequence
                    self._next_sequence += 1
                    batch.request.producer_id = self.producer_id
                batch.request.sequence = batch.sequence
            batch.attempts += 1
            self._in_flight[batch.index] = batch
            await call.write(batch.request)

    async def _read(self, call: Any) -> None:
        while True:
            answer = await call.read()
            if answer is grpc.aio.EOF:
                return
            batch = self._in_flight.pop(answer.request_id, None)
            if batch is None:
                continue
            self._wake.set()
            code = _CODES.get(answer.code, grpc.StatusCode.UNKNOWN)
            if code == grpc.StatusCode.OK:
                self._complete(batch, answer.base_offset)
            elif code in _RETRIABLE or code == grpc.StatusCode.FAILED_PRECONDITION:
                # (FAILED_PRECONDITION: a sequence gap behind a batch that is being resent.)
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    batch.gaps += 1
                    if self._rotate:
                        # Behind an expired sequence the daemon does not have: that gap never
                        # fills, and this batch is not stored; it goes under the new producer
                        # id.
                        batch.sequence = None
                    elif batch.gaps > 1:
                        # The first gap is expected (an earlier batch is resent first, in
                        # order); one that persists is not, and must not be resent in a loop.
                        self._pause(batch.gaps - 2)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._pause(batch.attempts)
                self._requeue(batch)
            else:
                # (ALREADY_EXISTS: stored before, beyond the daemon's memory of this producer;
                # its sequence is used, the offsets are unknown.)
                stored = code == grpc.StatusCode.ALREADY_EXISTS
                self._fail(batch, PublishError(code, answer.error, self.topic), stored)

    def _pause(self, doublings: int) -> None:
        """Send nothing for ``retry_backoff_ms`` doubled ``doublings`` times (at most
        ``max_backoff_ms``), or longer if a pause is under way already."""
        backoff = min(self._backoff * 2 ** min(doublings, 10), self._max_backoff)
        self._pause_until = max(self._pause_until, time.monotonic() + backoff)

    def _complete(self, batch: _Batch, base: int) -> None:
        for i, future in enumerate(batch.futures):
            if not future.done():
                future.set_result(base + i)
        if batch.group is not None:
            batch.group.done(batch.slot, range(base, base + batch.count))
        self._release(batch)

    def _expire(self) -> None:
        """Fail the batches past their deadline (see ``DeliveryTimeoutError``); re-arm the
        timer for the next deadline."""
        self._expiry = None
        assert self._delivery_timeout is not None
        loop = asyncio.get_running_loop()
        now = loop.time()
        overdue = [b for b in (*self._ready, *self._in_flight.values()) if b.deadline <= now]
        if overdue:
            self._ready[:] = [b for b in self._ready if b.deadline > now]
            for batch in sorted(overdue, key=lambda b: b.index):
                self._in_flight.pop(batch.index, None)
                log.warning(
                    "batch expired topic=%s messages=%d attempts=%d delivery_timeout=%g",
                    self.topic,
                    batch.count,
                    batch.attempts,
                    self._delivery_timeout,
                )
                error = DeliveryTimeoutError(
                    self.topic, batch.count, self._delivery_timeout, batch.attempts
                )
                for future in batch.futures:
                    if not future.done():
                        future.set_exception(error)
                if batch.group is not None:
                    batch.group.fail(error)
                if batch.sequence is not None:
                    self._rotate = True
                self._release(batch)
            self._wake.set()
        outstanding = [b.deadline for b in (*self._ready, *self._in_flight.values())]
        if outstanding:
            self._expiry = loop.call_at(min(outstanding), self._expire)

    def _fail(self, batch: _Batch, error: PublishError, stored: bool) -> None:
        for future in batch.futures:
            if not future.done():
                future.set_exception(error)
        if batch.group is not None:
            batch.group.fail(error)
        if batch.sequence is not None and not stored:
            # The sequence was never stored: later batches move down one, so the daemon sees
            # no gap (those already sent come back as gaps and are resent renumbered).
            for other in (*self._ready, *self._in_flight.values()):
                if other.sequence is not None and other.sequence > batch.sequence:
                    other.sequence -= 1
            self._next_sequence -= 1
        self._release(batch)

    def _release(self, batch: _Batch) -> None:
        self._buffered -= batch.count
        self._room.set()
        if not self._ready and not self._in_flight and not self._open:
            self._idle.set()


def _suppress_cancel() -> contextlib.suppress:
    """For awaiting a task just cancelled (its end, whatever it is, is not this caller's)."""
    return contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, ConnectionError)
