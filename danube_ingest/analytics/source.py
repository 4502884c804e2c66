"""Reading a topic's rows from its objects, without Spark: plan, then read each part.

:func:`plan_reads` turns the topic's manifest ranges into :class:`ReadPart` s (one per range
that may hold wanted rows); :func:`read_part` reads one of them as bounded Arrow record
batches. Parts are small picklable values, so a Spark driver plans and its tasks read.

A part is read with one ranged read of the object's tail (the footer; two for a footer over
about 64 KiB), then ranged reads of only the frames that may hold wanted rows (consecutive
frames together, up to ``READ_BYTES`` per read). Rows are those of the range with offsets in
``[start_offset, end_offset)`` and ingest times in ``[start_ms, end_ms)``, in offset order,
each exactly once; batches have at most ``max_rows`` rows.

Errors: a missing object raises :class:`ObjectNotFoundError` (naming the key and the byte
range asked for); bytes that are not what the manifest and footer say (an object of another
size, a damaged footer or frame, a footer that disagrees with the manifest) raise
:class:`ObjectFormatError` naming the key and the byte position. Rows before the damage may
have been yielded; nothing is skipped silently. Transient store failures are retried by the
``ObjectStore`` and then raised as retriable ``ObjectStoreError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from danube_ingest.analytics.decode import SchemaDecoder, entries_to_batch
from danube_ingest.errors import ObjectFormatError, ObjectNotFoundError, ObjectStoreError
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.binfmt import FrameRef, decode_frame_bytes, read_footer_from
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry

__all__ = ["MAX_ROWS", "READ_BYTES", "ReadPart", "aread_part", "plan_reads", "read_part"]

log = logging.getLogger(__name__)

#: Default rows per batch: Spark's default Arrow batch size (``maxRecordsPerBatch`` is 10,000;
#: 65,536 keeps per-batch overhead low while a batch of 1 KiB rows stays near 64 MiB).
MAX_ROWS = 65_536
#: Bytes of frames fetched per ranged read (as the cloud reader): few requests, bounded memory.
READ_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ReadPart:
    """One manifest range to read, with the bounds of the rows wanted from it."""

    topic: str
    object_key: str
    object_size: int
    """Size of the whole object (the footer is read from its end)."""
    byte_start: int
    """Where the topic's bytes start in the object (the manifest's record)."""
    byte_length: int
    start_offset: int
    """First offset wanted (inclusive): the range's start, or the read's if higher."""
    end_offset: int
    """Offset after the last wanted (exclusive): the range's end, or the read's if lower."""
    start_ms: int | None = None
    """Rows with an ingest time below this are skipped (None: no bound)."""
    end_ms: int | None = None
    """Rows with an ingest time at or above this are skipped (None: no bound)."""

    def wants(self, first_offset: int, last_offset: int, first_ms: int, last_ms: int) -> bool:
        """Whether a frame holding these offsets and ingest times may hold wanted rows."""
        return (
            last_offset >= self.start_offset
            and first_offset < self.end_offset
            and (self.start_ms is None or last_ms >= self.start_ms)
            and (self.end_ms is None or first_ms < self.end_ms)
        )


def plan_reads(
    ranges: Sequence[ObjectRange],
    *,
    start_offset: int = 0,
    end_offset: int | None = None,
    start_ms: int | None = None,
    end_ms: int | None = None,
) -> list[ReadPart]:
    """One part per range that may hold rows with offsets in ``[start_offset, end_offset)``
    and ingest times in ``[start_ms, end_ms)`` (None: unbounded), in offset order.

    ``ranges`` are one topic's manifest entries (``Manifest.ranges``). Raises ``ValueError``
    for a negative offset or bounds of another topic's ranges.
    """
    if start_offset < 0 or (end_offset is not None and end_offset < 0):
        raise ValueError(f"offsets must be >= 0 (got {start_offset}, {end_offset})")
    parts: list[ReadPart] = []
    topics = {r.topic for r in ranges}
    if len(topics) > 1:
        raise ValueError(f"ranges of one topic expected, got {sorted(topics)}")
    for rng in sorted(ranges, key=lambda r: r.start_offset):
        start = max(rng.start_offset, start_offset)
        end = rng.end_offset if end_offset is None else min(rng.end_offset, end_offset)
        part = ReadPart(
            topic=rng.topic,
            object_key=rng.object_key,
            object_size=rng.object_size,
            byte_start=rng.byte_start,
            byte_length=rng.byte_length,
            start_offset=start,
            end_offset=end,
            start_ms=start_ms,
            end_ms=end_ms,
        )
        if start < end and part.wants(
            rng.start_offset, rng.end_offset - 1, rng.first_ingest_ms, rng.last_ingest_ms
        ):
            parts.append(part)
    return parts


async def aread_part(
    store: ObjectStore,
    part: ReadPart,
    *,
    decoder: SchemaDecoder | None = None,
    max_rows: int = MAX_ROWS,
    read_bytes: int = READ_BYTES,
) -> AsyncIterator[pa.RecordBatch]:
    """The wanted rows of ``part`` as record batches of at most ``max_rows`` rows (see the
    module docstring for what is read and what is raised)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 (got {max_rows})")
    frames = await _frames(store, part)
    pending: list[Entry] = []
    rows = 0
    for chunk in _chunks(frames, read_bytes):
        start = chunk[0].position
        size = chunk[-1].position + chunk[-1].length - start
        data = memoryview(await store.get_range(part.object_key, start, size))
        for ref in chunk:
            begin = ref.position - start
            entries = decode_frame_bytes(data[begin : begin + ref.length], ref, part.object_key)
            pending.extend(e for e in entries if _wanted(part, e))
            while len(pending) >= max_rows:
                batch, pending = pending[:max_rows], pending[max_rows:]
                rows += len(batch)
                yield entries_to_batch(batch, decoder)
    if pending:
        rows += len(pending)
        yield entries_to_batch(pending, decoder)
    log.debug(
        "read part topic=%s key=%s offsets=[%s, %s) frames=%s rows=%s",
        part.topic,
        part.object_key,
        part.start_offset,
        part.end_offset,
        len(frames),
        rows,
    )


def read_part(
    store: ObjectStore,
    part: ReadPart,
    *,
    decoder: SchemaDecoder | None = None,
    max_rows: int = MAX_ROWS,
    read_bytes: int = READ_BYTES,
) -> Iterator[pa.RecordBatch]:
    """:func:`aread_part` for synchronous callers (Spark tasks), on a private event loop.

    Must not be called from a running event loop's thread (use :func:`aread_part` there).
    Batches are produced one at a time as the caller consumes them.
    """
    loop = asyncio.new_event_loop()
    batches = aread_part(
        store, part, decoder=decoder, max_rows=max_rows, read_bytes=read_bytes
    ).__aiter__()
    try:
        while True:
            try:
                batch = loop.run_until_complete(batches.__anext__())
            except StopAsyncIteration:
                return
            yield batch
    finally:
        loop.run_until_complete(batches.aclose())  # type: ignore[attr-defined]
        loop.close()


async def _frames(store: ObjectStore, part: ReadPart) -> list[FrameRef]:
    """The frames of ``part``'s topic in its object that may hold wanted rows, after checking
    the footer agrees with the manifest."""
    key = part.object_key
    try:
        footer = await read_footer_from(store.get_range, part.object_size, key)
    except ObjectNotFoundError:
        raise
    except ObjectStoreError as exc:
        if exc.retriable:
            raise
        # A ranged read past the end: the object is not the one the manifest describes.
        size = await store.size(key)
        if size is None or size == part.object_size:
            raise
        raise ObjectFormatError(
            key, size, f"the object is {size} bytes, the manifest says {part.object_size}"
        ) from exc
    span = footer.topics.get(part.topic)
    if span is None:
        raise ObjectFormatError(
            key, footer.footer_position, f"the manifest lists it for {part.topic}, its footer not"
        )
    if (span.position, span.length) != (part.byte_start, part.byte_length):
        raise ObjectFormatError(
            key,
            span.position,
            f"{part.topic}'s frames span bytes [{span.position}, {span.position + span.length}), "
            f"the manifest says [{part.byte_start}, {part.byte_start + part.byte_length})",
        )
    return [
        ref
        for ref in span.frames
        if part.wants(ref.first_offset, ref.last_offset, ref.first_ingest_ms, ref.last_ingest_ms)
    ]


def _chunks(frames: list[FrameRef], read_bytes: int) -> Iterator[list[FrameRef]]:
    """Runs of adjacent frames of at most ``read_bytes`` (at least one frame each)."""
    chunk: list[FrameRef] = []
    size = 0
    for ref in frames:
        if chunk and (
            size + ref.length > read_bytes or ref.position != chunk[-1].position + chunk[-1].length
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(ref)
        size += ref.length
    if chunk:
        yield chunk


def _wanted(part: ReadPart, entry: Entry) -> bool:
    return (
        part.start_offset <= entry.offset < part.end_offset
        and (part.start_ms is None or entry.ingest_ms >= part.start_ms)
        and (part.end_ms is None or entry.ingest_ms < part.end_ms)
    )
