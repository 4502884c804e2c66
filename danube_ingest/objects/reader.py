"""CloudReader: a topic's history from objects, through the manifest.

A TopicReader positioned below its topic's WAL floor reads through an :class:`ObjectCursor`:

* the manifest is read with one etcd range read (the ranges from the cursor's offset on), and
  again only when those are used up;
* each object's footer is fetched with one ranged read (rarely two) and cached, shared by all
  cursors of the CloudReader (LRU, ``footer_cache`` objects);
* frames are fetched with ranged reads of up to ``read_bytes`` (only the frames from the wanted
  offset on), and ``prefetch`` further reads of the same range are in flight while the caller
  consumes the current one. Decompression and decoding run in worker threads, off the event
  loop; zstd and lz4 release the GIL, so in-flight reads decompress in parallel.

A cursor for a frame consumer (``stored=True``) builds no ``Entry`` per message: each object
frame is decompressed and CRC-checked once, in the worker thread, and its MESSAGES bodies are
kept as :class:`~danube_ingest.wal.stored.StoredEntries` (the decompressed bytes and each
entry's bounds), which the reader hands on in slices over the following reads of the cursor.

Memory per cursor is bounded by ``prefetch + 1`` reads of at most ``read_bytes`` of stored
bytes (the default: 3 x 4 MiB), decoded; a read's entries are let go once the cursor moved past
it. With ``stored``, a read is also held to about ``read_bytes`` *decompressed*
(:attr:`ObjectCursor.held_bytes`): its size in stored bytes follows the compression ratio of
the cursor's last read (its first reads take one frame each), so a well-compressed topic does
not multiply the bound by its ratio. A read takes at least one frame whatever its size.
Offsets missing between two manifest ranges were jumped over (a takeover's reservation gap)
and never existed; the cursor passes over them, as WAL readers do. Offsets below the topic's
retained floor (retention removed their ranges, :mod:`danube_ingest.objects.retention`) are
another matter: a read there raises ``OffsetOutOfRangeError`` naming the floor, so the caller
moves up to it and says so, never passing over expired data silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Sequence

from danube_ingest.errors import ObjectFormatError, ObjectNotFoundError, OffsetOutOfRangeError
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import (
    Footer,
    FrameRef,
    decode_frame_bytes,
    read_footer_from,
    stored_frame_bytes,
)
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.stored import StoredEntries, last_offset, offset_at

log = logging.getLogger(__name__)

#: Bytes fetched per ranged read of frames.
READ_BYTES = 4 * 1024 * 1024
#: Reads a cursor keeps in flight beyond the one being consumed.
PREFETCH = 2
#: Footers kept in memory (shared by every cursor of a CloudReader).
FOOTER_CACHE = 256


class CloudReader:
    """Reads topics from the object store, for readers that fell behind the WAL."""

    def __init__(
        self,
        manifest: Manifest,
        objects: ObjectStore,
        *,
        read_bytes: int = READ_BYTES,
        footer_cache: int = FOOTER_CACHE,
        prefetch: int = PREFETCH,
    ) -> None:
        self.manifest = manifest
        self.objects = objects
        self.read_bytes = read_bytes
        self.prefetch = prefetch
        self._footer_cache = footer_cache
        self._footers: OrderedDict[str, Footer] = OrderedDict()
        self._loading: dict[str, asyncio.Future[Footer]] = {}

    def cursor(self, topic: str, *, stored: bool = False) -> ObjectCursor:
        """A cursor over ``topic``'s objects; ``stored``: it reads :class:`StoredEntries`."""
        return ObjectCursor(self, topic, stored=stored)

    async def footer(self, key: str, size: int) -> Footer:
        """The footer of object ``key`` (``size`` bytes), cached; concurrent calls share a read."""
        footer = self._footers.get(key)
        if footer is not None:
            self._footers.move_to_end(key)
            return footer
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Footer] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            footer = await read_footer_from(self.objects.get_range, size, key)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: only the waiters care
            raise
        finally:
            self._loading.pop(key, None)
        future.set_result(footer)
        self._footers[key] = footer
        if len(self._footers) > self._footer_cache:
            self._footers.popitem(last=False)
        return footer

    def forget(self, key: str) -> None:
        self._footers.pop(key, None)


class ObjectCursor:
    """One reader's position in one topic's objects."""

    def __init__(self, cloud: CloudReader, topic: str, *, stored: bool = False) -> None:
        self._cloud = cloud
        self.topic = topic
        self._stored = stored
        # Decompressed / stored bytes of the last read (``stored``; None before the first).
        self._ratio: float | None = None
        self._ranges: deque[ObjectRange] = deque()
        self._range: ObjectRange | None = None
        self._frames: deque[FrameRef] = deque()
        self._entries: Sequence[Entry] = []
        self._pos = 0
        #: Reads in flight, in order: (their frames, the task reading and decoding them).
        self._inflight: deque[tuple[list[FrameRef], asyncio.Task[Sequence[Entry]]]] = deque()

    @property
    def held_bytes(self) -> int:
        """With ``stored``: bytes of decompressed frame data the cursor holds for its current
        read (finished reads in flight come on top, at most ``prefetch`` of them)."""
        entries = self._entries
        return entries.nbytes if isinstance(entries, StoredEntries) else 0

    def close(self) -> None:
        self._cancel_inflight()
        self._entries = []
        self._frames.clear()

    def _cancel_inflight(self) -> None:
        for _, task in self._inflight:
            task.cancel()
        self._inflight.clear()

    async def read(self, nxt: int, max_batch: int) -> tuple[Sequence[Entry], int]:
        """Entries from offset ``nxt`` on (at most ``max_batch``), and the offset reached.

        Returns ``([], n)`` with ``n > nxt`` when offsets ``[nxt, n)`` never existed, and
        ``([], nxt)`` when the objects hold nothing at or after ``nxt``. Raises
        ``OffsetOutOfRangeError`` (its ``first_offset`` the floor) when the objects hold
        nothing at ``nxt`` and ``nxt`` is below the topic's retained floor.
        """
        refreshed = False
        while True:
            entries = self._entries
            pos = self._pos
            while pos < len(entries) and offset_at(entries, pos) < nxt:
                pos += 1
            if pos < len(entries):
                batch = entries[pos : pos + max_batch]
                self._pos = pos + len(batch)
                return batch, last_offset(batch) + 1
            self._entries = []
            self._pos = 0
            if self._frames or self._inflight:
                try:
                    await self._load_frames(nxt)
                except ObjectNotFoundError:
                    if refreshed:
                        raise
                    # Replaced by a rotation after we read the manifest: read it again.
                    refreshed = True
                    self._reset()
                continue
            rng = self._next_range(nxt)
            if rng is None:
                if refreshed:
                    await self._check_floor(nxt)
                    return [], nxt
                refreshed = True
                self._reset()
                self._ranges.extend(await self._cloud.manifest.ranges(self.topic, nxt))
                continue
            if rng.start_offset > nxt:
                await self._check_floor(nxt)
                return [], rng.start_offset
            try:
                footer = await self._cloud.footer(rng.object_key, rng.object_size)
            except ObjectNotFoundError:
                if refreshed:
                    raise
                refreshed = True
                self._reset()
                continue
            span = footer.topics.get(self.topic)
            if span is None:
                raise ObjectFormatError(
                    rng.object_key, None, f"the manifest lists it for {self.topic}, its footer not"
                )
            self._ranges.popleft()
            self._range = rng
            self._frames.extend(span.frames_from(nxt))
            if not self._frames:
                # The manifest says the range reaches nxt, the object says otherwise.
                raise ObjectFormatError(
                    rng.object_key,
                    None,
                    f"no frame of {self.topic} at or after offset {nxt} "
                    f"(manifest range {rng.start_offset}..{rng.end_offset})",
                )

    async def _check_floor(self, nxt: int) -> None:
        """Raise ``OffsetOutOfRangeError`` if ``nxt`` is below the retained floor (read only
        here, where the manifest holds nothing at ``nxt``: a rare, cold case)."""
        floor = await self._cloud.manifest.floor(self.topic)
        if floor is not None and nxt < floor.offset:
            raise OffsetOutOfRangeError(self.topic, nxt, floor.offset)

    def _next_range(self, nxt: int) -> ObjectRange | None:
        ranges = self._ranges
        while ranges and ranges[0].end_offset <= nxt:
            ranges.popleft()
        return ranges[0] if ranges else None

    def _reset(self) -> None:
        self._cancel_inflight()
        self._ranges.clear()
        self._frames.clear()
        self._range = None

    async def _load_frames(self, nxt: int) -> None:
        """Decode the next read of frames into the entry buffer; keep ``prefetch`` more reads
        in flight behind it (their decoding overlaps: zstd and lz4 release the GIL)."""
        inflight = self._inflight
        while inflight and inflight[0][0][-1].last_offset < nxt:
            inflight.popleft()[1].cancel()  # the reader moved past them
        frames = self._frames
        if not inflight:
            while frames and frames[0].last_offset < nxt:
                frames.popleft()
        self._schedule()
        if not inflight:
            return
        refs, task = inflight.popleft()
        try:
            entries = await task
        except BaseException:
            self._cancel_inflight()
            raise
        if isinstance(entries, StoredEntries) and entries:
            stored_size = refs[-1].position + refs[-1].length - refs[0].position
            self._ratio = entries.nbytes / stored_size
        self._schedule()
        self._entries = entries
        self._pos = 0

    def _schedule(self) -> None:
        """Start reads until ``prefetch + 1`` are in flight or no frame is left."""
        while self._frames and len(self._inflight) <= self._cloud.prefetch:
            refs = self._take()
            for _ in refs:
                self._frames.popleft()
            rng = self._range
            assert rng is not None
            task = asyncio.ensure_future(self._fetch(rng.object_key, refs))
            self._inflight.append((refs, task))

    def _take(self) -> list[FrameRef]:
        """The frames of the next read: consecutive, at least one, at most ``read_bytes`` (with
        ``stored``: stored bytes that decompress to about ``read_bytes``, by the last ratio)."""
        frames = self._frames
        refs = [frames[0]]
        total = frames[0].length
        budget = self._cloud.read_bytes
        if self._stored:
            if self._ratio is None:
                return refs  # the ratio is not known yet: one frame
            budget = min(budget, int(budget / max(self._ratio, 1.0)))
        for i in range(1, len(frames)):
            ref = frames[i]
            if total + ref.length > budget or ref.position != (refs[-1].position + refs[-1].length):
                break
            refs.append(ref)
            total += ref.length
        return refs

    async def _fetch(self, key: str, refs: list[FrameRef]) -> Sequence[Entry]:
        """Read and decode ``refs``. Decompression and decoding run in a worker thread: zstd
        and lz4 release the GIL (so they overlap with the event loop's work), and the loop is
        never blocked for the tens of milliseconds a 4 MiB read takes to decode. With
        ``stored``, no ``Entry`` is built: the thread decompresses, checks the CRCs and finds
        the entries' bounds."""
        start = refs[0].position
        size = refs[-1].position + refs[-1].length - start
        data = await self._cloud.objects.get_range(key, start, size)
        if len(data) != size:
            raise ObjectFormatError(key, start, f"ranged read returned {len(data)} of {size} bytes")
        if self._stored:
            return await asyncio.to_thread(_stored_frames, data, refs, key)
        return await asyncio.to_thread(_decode_frames, data, refs, key)


def _decode_frames(data: bytes, refs: list[FrameRef], key: str) -> list[Entry]:
    out: list[Entry] = []
    view = memoryview(data)
    base = refs[0].position
    for ref in refs:
        start = ref.position - base
        out.extend(decode_frame_bytes(view[start : start + ref.length], ref, key))
    return out


def _stored_frames(data: bytes, refs: list[FrameRef], key: str) -> StoredEntries:
    view = memoryview(data)
    base = refs[0].position
    return StoredEntries.join(
        [
            stored_frame_bytes(
                view[ref.position - base : ref.position - base + ref.length], ref, key
            )
            for ref in refs
        ]
    )


__all__ = ["CloudReader", "ObjectCursor"]
