"""The batch path, ``danube_ingest.v1.IngestService`` (proto/ingest.proto), on the broker's port.

``Publish``: each request is one batch for one topic, an entry block (``wal/block.py``). The
request is checked whole before anything is stored or an offset used: the CRC32C of the
(decompressed) block, then :func:`~danube_ingest.wal.block.check_block` with the broker's
``limits`` (the danube-client path's limits). Batches of a stream are staged in the order they
arrive; each is answered once durable, or with an error code for that batch alone (the stream
goes on). At most ``PUBLISH_IN_FLIGHT`` batches and ``PUBLISH_IN_FLIGHT_BYTES`` bytes of a
stream wait for durability at once (a larger batch waits until the stream has none in flight,
then goes alone); the stream is not read further meanwhile (gRPC flow control then holds the
client back). That credit is what keeps the broker fair between streams: the WAL writes and
syncs in staging order, so whatever one stream has staged ahead of another stream's append is
written before it, and a batch producer at full speed may hold at most its credit there. At most
``limits.max_publish_streams`` Publish streams are served at once: one more ends at once with
RESOURCE_EXHAUSTED (``LimitExceededError``), before any of its batches is read.

``Consume``: a ``Subscribe`` first, then range acks; the daemon sends batches of deliveries
(the subscription's dispatch: the same semantics as danube-client consumers) as entry blocks
with each entry's offset. The consumer is attached for frames (``frames`` = its ``max_batch``):
Exclusive and Failover dispatch hand it runs of consecutive offsets as read, whole, and a range
ack settles whole runs (see ``dispatch.reliable``); Shared, KeyShared and redeliveries after a
failed delivery come one by one. A batch's entries are sent as the bytes they are stored as
(slices of the WAL frame, cached frame or object frame they were read from,
``wal.block.served_frame`` / ``served_block``), not encoded again message by message, and a
frame's offsets are one ``arange``.

Security: the caller is authenticated once per stream, and the stream ends with
UNAUTHENTICATED when the JWT it was opened with expires (``Caller.deadline``; the client opens
it again with a fresh token); each Publish batch is authorized
(``produce`` on its topic) before it is checked or staged, and a refused batch is answered
with PERMISSION_DENIED alone; ``Consume`` needs ``consume`` on the topic, and its consumer name
is bound to the principal as on the danube-client path. Acks travel on the Consume stream
itself, so they only ever settle that consumer's deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import grpc
import lz4.frame
import numpy as np
import zstandard
from crc32c import crc32c

from danube_ingest.broker.errors import InvalidRequestError, LimitExceededError
from danube_ingest.broker.services import MAX_DETAILS, status_for
from danube_ingest.broker.start import StartPosition
from danube_ingest.broker.topics import TopicManager
from danube_ingest.broker.validation import subscription_type
from danube_ingest.config import LimitsConfig
from danube_ingest.dispatch import Delivery, Frame, SubscriptionType
from danube_ingest.errors import DanubeIngestError
from danube_ingest.proto import ingest_pb2 as pb
from danube_ingest.proto import ingest_pb2_grpc as pb_grpc
from danube_ingest.security import Caller, Guard, UnauthenticatedError
from danube_ingest.wal.block import (
    IDEMPOTENT_BIT,
    BlockLimits,
    EntryBlock,
    check_block,
    served_block,
    served_frame,
)
from danube_ingest.wal.log import StagedBlock

log = logging.getLogger(__name__)

#: Batches of one Publish stream waiting for durability at once.
PUBLISH_IN_FLIGHT = 64
#: Bytes (of blocks) of one Publish stream waiting for durability at once. The WAL writes in
#: staging order, so this is how much of one stream another stream's append may wait behind.
#: A "1 MiB" batch of 1,000 x 1 KiB messages is a 1,079,000-byte block, so such a stream has
#: one batch staged at a time (the writer idles while the next one is read and staged; the
#: broker's loop, not the disk, bounds that throughput, 220-250 MB/s here); batches up to
#: 1 MiB / 2 have two or more. With 64 MiB (64 batches of 1 MiB, the batch count alone) a
#: per-message producer's p99 was 0.5-25 s behind one full-speed batch producer
#: (benchmarks/fairness.py); with this credit its loaded wait is mostly the busy event loop, not
#: the WAL (docs/benchmarks.md, fairness.py, session 13).
PUBLISH_IN_FLIGHT_BYTES = 2 * 1024 * 1024
#: Messages per delivered batch when the Subscribe does not say.
DEFAULT_CONSUME_BATCH = 1000
#: Largest decompressed block (bytes): what the broker accepts uncompressed in one request.
MIN_BLOCK_BYTES = 64 * 1024 * 1024

#: Exclusive and Failover acks are cumulative: every held offset up to ``last``.
_CUMULATIVE = frozenset({SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER})


def max_block_bytes(limits: LimitsConfig) -> int:
    """The largest (decompressed) block the broker accepts: as large as a request may be."""
    return max(4 * limits.max_payload_bytes, MIN_BLOCK_BYTES)


def _decompress(request: Any, limit: int) -> bytearray:
    data = request.entries
    kind = request.compression
    if kind == pb.COMPRESSION_NONE:
        return bytearray(data)
    try:
        if kind == pb.COMPRESSION_ZSTD:
            # (A frame that states its size is decompressed to it whatever max_output_size is.)
            if zstandard.frame_content_size(data) > limit:
                raise InvalidRequestError(
                    f"entries decompress to more than {limit} bytes; send smaller batches"
                )
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=limit + 1)
            complete = True  # (a truncated frame raises)
        elif kind == pb.COMPRESSION_LZ4:
            ld = lz4.frame.LZ4FrameDecompressor()
            out = ld.decompress(data, max_length=limit + 1)
            complete = ld.eof
        else:
            raise InvalidRequestError(
                f"unknown compression {kind}: use 0 (none), 1 (zstd) or 2 (lz4)"
            )
    except (zstandard.ZstdError, RuntimeError) as exc:
        raise InvalidRequestError(f"entries do not decompress: {exc}") from None
    if len(out) > limit:
        raise InvalidRequestError(
            f"entries decompress to more than {limit} bytes; send smaller batches"
        )
    if not complete:
        raise InvalidRequestError("entries end inside their compressed frame (truncated)")
    return bytearray(out)


def block_from_request(
    request: Any, limits: LimitsConfig, block_limits: BlockLimits | None = None
) -> EntryBlock:
    """The checked block of a PublishRequest; raises ``InvalidRequestError`` or
    ``InvalidEntryError`` (both INVALID_ARGUMENT) naming what is wrong. Nothing is stored.
    ``block_limits``: ``limits``' per-entry limits, when the caller has them already."""
    producer_id = request.producer_id
    if producer_id and not producer_id & IDEMPOTENT_BIT:
        raise InvalidRequestError(
            f"producer_id {producer_id:#x} lacks bit 63: use 0 (not idempotent) or an id from "
            f"danube_ingest.client.new_producer_id()"
        )
    data = _decompress(request, max_block_bytes(limits))
    got = crc32c(data)
    if got != request.crc32c:
        raise InvalidRequestError(
            f"entries CRC32C is {got:#010x}, the request says {request.crc32c:#010x}: the "
            f"batch was damaged or built wrong; rebuild and resend it"
        )
    if block_limits is None:
        block_limits = BlockLimits(limits.max_payload_bytes, limits.max_attributes)
    return check_block(data, request.sizes, request.count, block_limits)


def _error(request_id: int, exc: BaseException) -> Any:
    if not isinstance(exc, DanubeIngestError):
        log.exception("internal error serving a batch", exc_info=exc)
    details = str(exc)
    if len(details) > MAX_DETAILS:
        details = f"{details[: MAX_DETAILS - 20]}... ({len(details)} characters)"
    return pb.PublishResponse(request_id=request_id, code=status_for(exc).value[0], error=details)


class IngestService(pb_grpc.IngestServiceServicer):
    def __init__(self, manager: TopicManager, guard: Guard) -> None:
        self._manager = manager
        self._guard = guard
        self._publish_streams = 0

    async def Publish(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            caller = self._guard.caller(context)
        except Exception as exc:
            await _abort(context, exc)
            raise
        limit = self._manager.limits.max_publish_streams
        if self._publish_streams >= limit:
            await _abort(
                context,
                LimitExceededError(
                    f"{self._publish_streams} Publish streams are open, the most this broker "
                    f"serves (limits.max_publish_streams={limit}); retry later with backoff "
                    "(danube_ingest.client.Producer does), or raise the limit"
                ),
            )
        self._publish_streams += 1
        try:
            async for answer in self._publish(request_iterator, caller):
                yield answer
        except UnauthenticatedError as exc:  # (the token expired)
            await _abort(context, exc)
            raise
        finally:
            self._publish_streams -= 1

    async def _publish(
        self, request_iterator: AsyncIterator[Any], caller: Caller
    ) -> AsyncIterator[Any]:
        answers: asyncio.Queue[Any] = asyncio.Queue()
        reader = asyncio.get_running_loop().create_task(
            self._read_batches(request_iterator, answers, caller)
        )
        loop = asyncio.get_running_loop()
        deadline = caller.deadline(loop)
        try:
            while True:
                if deadline is None:
                    answer = await answers.get()
                else:
                    # The token's expiry ends the stream; batches staged but not answered are
                    # resent by the client (same sequence: stored once).
                    if loop.time() >= deadline:
                        raise caller.expired()
                    try:
                        async with asyncio.timeout_at(deadline):
                            answer = await answers.get()
                    except TimeoutError:
                        raise caller.expired() from None
                if answer is None:
                    break
                yield answer
            await reader  # (raises what ended the request stream, if anything)
        finally:
            reader.cancel()

    async def _read_batches(
        self,
        requests: AsyncIterator[Any],
        answers: asyncio.Queue[Any],
        caller: Caller,
    ) -> None:
        """Stage each batch in arrival order, within the stream's credit (see the module
        docs); answer each once it is durable or refused.

        A staged batch is answered by a done callback on its durability future (no task per
        batch): the answer is queued as the WAL completes the future.
        """
        limits = self._manager.limits
        block_limits = BlockLimits(limits.max_payload_bytes, limits.max_attributes)
        waiting = _Waiting(answers, PUBLISH_IN_FLIGHT, PUBLISH_IN_FLIGHT_BYTES)
        try:
            async for request in requests:
                try:
                    self._guard.authorize(caller, "produce", request.topic)
                    block = block_from_request(request, limits, block_limits)
                except Exception as exc:
                    answers.put_nowait(_error(request.request_id, exc))
                    continue
                size = len(block.data)
                await waiting.room(size)
                try:
                    staged = await self._manager.publish_block(
                        request.topic, block, request.producer_id, request.sequence, caller.owner
                    )
                except Exception as exc:
                    answers.put_nowait(_error(request.request_id, exc))
                    continue
                waiting.add(request.request_id, staged, size)
            await waiting.drained()
        finally:
            answers.put_nowait(None)

    async def Consume(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            caller = self._guard.caller(context)
            first = await anext(aiter(request_iterator))
            if first.WhichOneof("request") != "subscribe":
                raise InvalidRequestError("a Consume stream must start with a Subscribe")
            sub = first.subscribe
            self._guard.authorize(caller, "consume", sub.topic)
            sub_type = subscription_type(sub.type)
            start = _start(sub.start, sub.start_value)
            max_batch = sub.max_batch or DEFAULT_CONSUME_BATCH
            consumer_id = await self._manager.subscribe(
                sub.topic,
                sub.subscription,
                sub.consumer_name,
                sub_type,
                list(sub.key_filters),
                start,
                owner=caller.owner,
                frames=max_batch,
            )
        except StopAsyncIteration:
            return
        except Exception as exc:
            await _abort(context, exc)
            raise
        acks = asyncio.get_running_loop().create_task(
            self._read_acks(request_iterator, consumer_id, sub_type in _CUMULATIVE)
        )
        deliveries = self._manager.deliveries(
            consumer_id, max_batch, caller.peer, caller.owner, frames=True
        )
        following: asyncio.Future[Any] | None = None
        loop = asyncio.get_running_loop()
        deadline = caller.deadline(loop)
        try:
            yield pb.ConsumeResponse(topic=sub.topic, count=0, consumer_id=consumer_id)
            while True:
                # The client half-closing its requests (``Consumer.close``) ends the stream
                # once every ack it sent is applied: they are read in order before the end.
                following = asyncio.ensure_future(anext(deliveries))
                await asyncio.wait(
                    (following, acks),
                    timeout=None if deadline is None else max(deadline - loop.time(), 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not following.done() and not acks.done():
                    raise caller.expired()  # (the token expired: the stream ends)
                if not following.done():
                    acks.result()  # an error reading the requests ends the stream with it
                    return
                try:
                    batch = following.result()
                except StopAsyncIteration:
                    return
                block, sizes, offsets, count = served_batch(batch)
                yield pb.ConsumeResponse(
                    topic=sub.topic,
                    entries=block,
                    sizes=sizes,
                    offsets=offsets,
                    count=count,
                    consumer_id=consumer_id,
                )
        except Exception as exc:
            await _abort(context, exc)
            raise
        finally:
            # However the stream ends (the client gone: gRPC cancels this handler, mid-wait or
            # mid-send), the consumer is detached now, so what it held goes back to the
            # subscription at once rather than when the stall sweep notices.
            acks.cancel()
            await _detach(following, deliveries)

    async def _read_acks(
        self, requests: AsyncIterator[Any], consumer_id: int, cumulative: bool
    ) -> None:
        async for request in requests:
            if request.WhichOneof("request") != "ack":
                continue
            ack = request.ack
            self._manager.ack_range(consumer_id, 0 if cumulative else ack.first, ack.last)


def served_batch(batch: list[Delivery | Frame]) -> tuple[bytes, bytes, bytes, int]:
    """The ``(entries, sizes, offsets, count)`` of a ConsumeResponse for ``batch``, in its
    order: stored bytes (``served_block``), offsets as little-endian u64."""
    if len(batch) == 1 and isinstance(batch[0], Frame):
        base, entries = batch[0]
        block, sizes = served_frame(entries)
        offsets = np.arange(base, base + len(entries), dtype="<u8")
        return block, sizes, offsets.tobytes(), len(entries)
    blocks: list[bytes] = []
    size_tables: list[bytes] = []
    offset_arrays: list[Any] = []
    singles: list[Any] = []

    def flush() -> None:
        if singles:
            block, sizes = served_block(singles)
            blocks.append(block)
            size_tables.append(sizes)
            offset_arrays.append(np.fromiter((e.offset for e in singles), "<u8", len(singles)))
            singles.clear()

    for item in batch:
        if isinstance(item, Delivery):
            singles.append(item.entry)
            continue
        flush()
        base, entries = item
        block, sizes = served_frame(entries)
        blocks.append(block)
        size_tables.append(sizes)
        offset_arrays.append(np.arange(base, base + len(entries), dtype="<u8"))
    flush()
    offsets = np.concatenate(offset_arrays)
    return b"".join(blocks), b"".join(size_tables), offsets.tobytes(), len(offsets)


def _start(kind: int, value: int) -> StartPosition:
    if kind == pb.START_EARLIEST:
        return StartPosition("earliest")
    if kind == pb.START_OFFSET:
        return StartPosition("offset", value)
    if kind == pb.START_TIME:
        return StartPosition("time", value)
    if kind == pb.START_LATEST:
        return StartPosition("latest")
    raise InvalidRequestError(f"unknown start {kind}: expected 0 (latest) to 3 (time)")


class _Waiting:
    """The staged batches of one Publish stream not answered yet, and the stream's credit: each
    is answered (queued on ``answers``) as its durability future completes, which gives its
    room back."""

    __slots__ = ("_answers", "_bytes", "_count", "_drained", "_max_batches", "_max_bytes", "_room")

    def __init__(self, answers: asyncio.Queue[Any], max_batches: int, max_bytes: int) -> None:
        self._answers = answers
        self._max_batches = max_batches
        self._max_bytes = max_bytes
        self._count = 0
        self._bytes = 0
        self._room: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None

    async def room(self, size: int) -> None:
        """Return once a batch of ``size`` bytes may be staged: fewer than ``max_batches``
        batches wait, and ``size`` fits in ``max_bytes`` beside them (a batch larger than the
        credit once none waits)."""
        while self._count and (
            self._count >= self._max_batches or self._bytes + size > self._max_bytes
        ):
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def add(self, request_id: int, staged: StagedBlock, size: int) -> None:
        """Answer ``request_id`` once ``staged.future`` completes: its offsets, or the error;
        its ``size`` bytes count against the credit until then."""
        self._count += 1
        self._bytes += size
        offsets = staged.offsets
        duplicate = staged.duplicate

        def done(future: Any) -> None:
            self._count -= 1
            self._bytes -= size
            room = self._room
            if room is not None and not room.done():
                room.set_result(None)
            if not future.cancelled():
                error = future.exception()
                self._answers.put_nowait(
                    _error(request_id, error)
                    if error is not None
                    else pb.PublishResponse(
                        request_id=request_id,
                        base_offset=max(offsets.start, 0),
                        count=len(offsets),
                        duplicate=duplicate,
                    )
                )
            drained = self._drained
            if self._count == 0 and drained is not None and not drained.done():
                drained.set_result(None)

        cast(asyncio.Future[None], staged.future).add_done_callback(done)

    async def drained(self) -> None:
        """Return once every added batch is answered."""
        if self._count:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained


async def _detach(
    following: asyncio.Future[Any] | None, deliveries: AsyncGenerator[Any, None]
) -> None:
    """End a Consume stream's deliveries: cancel the pending read of the next batch, then close
    the generator (its ``finally`` detaches the consumer). Never raises."""
    if following is not None and not following.done():
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
            await following
    with contextlib.suppress(Exception):
        await deliveries.aclose()


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, DanubeIngestError):
        log.exception("internal error serving a consumer", exc_info=exc)
    details = str(exc)
    if len(details) > MAX_DETAILS:
        details = f"{details[: MAX_DETAILS - 20]}... ({len(details)} characters)"
    await context.abort(code, details)


def add_ingest_service(server: Any, manager: TopicManager, guard: Guard) -> None:
    """Register ``danube_ingest.v1.IngestService`` on ``server`` (see services.add_services)."""
    pb_grpc.add_IngestServiceServicer_to_server(IngestService(manager, guard), server)  # type: ignore[no-untyped-call]
