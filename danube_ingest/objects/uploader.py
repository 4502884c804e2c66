"""SegmentUploader: every sealed WAL segment becomes one object, then manifest entries.

For each sealed segment of each region, in sequence order:

1. **Build** (worker thread): scan the segment, verifying every WAL frame's CRC32C, and regroup
   its MESSAGES frames by topic into a ``.bin`` object: one topic's frames are contiguous, so the
   manifest can name each topic's byte range. TIME markers travel with their topic's frames.
2. **PUT** the object once, with ``if_not_exists``, under the deterministic key
   ``segments/{broker}/{region}/{seq:020}.bin``. If the key exists (a re-run after a crash) the
   object there is used as it is: its footer must describe exactly the offsets this segment
   holds, otherwise the upload stops with an error (nothing is overwritten).
3. **Commit** one manifest entry per topic (``Manifest.commit``: transactions comparing this
   broker's ownership epoch of every topic; ranges already in the manifest are recognised, so a
   re-run adds nothing twice). Topics this broker does not hold are acquired first if nobody
   owns them (after a restart nobody does until clients return).
4. **Mark** the segment uploaded in RegionMeta. Only then may the cleaner delete it.

A segment holding no messages (only its checkpoint, or TIME markers) needs no object: it is
marked uploaded at once, without a PUT.

A crash anywhere repeats the steps for the segments not marked uploaded (the marks are part of
RegionMeta snapshots), and every step is idempotent. Uploads of several segments run
concurrently (``uploader.concurrency``); commits stay in sequence order per region, so a
topic's manifest never has a hole below a committed range of the same broker.

A topic range that cannot be committed because another broker owns the topic now (this broker
was partitioned or paused past its lease) is *orphaned*: it stays in the local WAL (the segment
is never marked uploaded, so never deleted), is logged as an error and listed in
:attr:`UploaderStats.orphans`. It is committed if this broker owns the topic again later and
nobody wrote later offsets of the topic, nor moved its ingest clock past the range, meanwhile;
otherwise committing it would put an older epoch after a newer one (readers past that point
would never see it) or add offsets to hours already declared complete, so it stays orphaned
for an operator. The offsets are never reused either way (the new owner continued from its
reservation). Except: when the new owner waits for exactly this tail (a pending takeover record,
``metadata.handover``), the ranges are given to the orphan committer
(``objects.handover.TailHandover``), which commits them under that record.

Bandwidth (``uploader.max_bytes_per_second``): every byte the uploader writes to the object
store (first PUTs, replacements of damaged objects, refreshes before a delayed commit) is
streamed in chunks paced by one token bucket shared by all of this uploader's uploads
(:mod:`danube_ingest.objects.bandwidth`), so a catch-up over a large backlog never sends
faster than the limit, nor a whole segment in one burst. A paced write goes through
``ObjectStore.put_large`` (staged, then moved into place: never a partial object under the
segment's key); "only if absent" becomes a ``size`` check first, which is enough because only
this broker writes under its segment keys. On s3 and gcs that costs a multipart upload and a
server-side copy per segment instead of one PUT. Without a limit a segment is one
``put_if_absent``.

Failures (object store down, etcd unreachable) are retried forever with exponential backoff
capped at ``retry_max_ms``: a segment that is not uploaded is kept, and once the WAL reaches
``retention.max_bytes`` publishers get backpressure rather than anyone losing data.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from crc32c import crc32c

from danube_ingest.errors import (
    DanubeIngestError,
    FrameError,
    ObjectFormatError,
    ObjectNotFoundError,
)
from danube_ingest.metadata.clock import read_clock
from danube_ingest.metadata.errors import LeaseExpiredError, MetadataError, TopicDeletedError
from danube_ingest.metadata.manifest import (
    CommitResult,
    Manifest,
    ManifestConflictError,
    ObjectRange,
    covered,
)
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.objects.bandwidth import TokenBucket, chunk_bytes, paced_chunks
from danube_ingest.objects.binfmt import BinWriter, Footer, parse_object
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.observability.metrics import UPLOAD_SECONDS
from danube_ingest.store.topic_store import TopicStore
from danube_ingest.wal.framing import (
    Kind,
    batch_header,
    decode_drop,
    decode_frame,
    decode_time,
    decode_topic,
)
from danube_ingest.wal.log import RegionLog, Sealed

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Uncompressed bytes of one topic's WAL frames grouped into one object frame.
OBJECT_FRAME_BYTES = 1024 * 1024


#: Seconds after which a stored segment object whose manifest commit has not landed yet is
#: stored again (the same bytes under the same key) right before the commit, so its age starts
#: over: the orphan collector deletes only unreferenced objects older than its grace period,
#: which must be at least twice this (``objects.orphans.MIN_GRACE_S``), so an object is never
#: collected between being stored and being committed, however long the commit was delayed
#: (etcd away, ranges waiting for their topic).
OBJECT_REFRESH_SECONDS = 600.0


def segment_key(broker_id: str, region: str, seq: int) -> str:
    """The object key of a sealed segment."""
    return f"segments/{broker_id}/{region}/{seq:020}.bin"


@dataclass(frozen=True, slots=True)
class SegmentObject:
    """A segment turned into a ``.bin`` object (built here, or found already stored)."""

    key: str
    size: int
    crc: int
    footer: Footer
    data: bytes | None
    """The bytes to PUT (None once they are known to be stored)."""
    found: bool = False
    """Already stored by an earlier run: its manifest entries may be committed too."""


class _Run:
    """Consecutive WAL frames of one topic that become one object frame."""

    __slots__ = ("entries", "first_ms", "first_offset", "last_ms", "last_offset", "parts", "size")

    def __init__(self) -> None:
        self.parts: list[memoryview] = []
        self.size = 0
        self.entries = 0
        self.first_offset = -1
        self.last_offset = -1
        self.first_ms = 0
        self.last_ms = 0


def build_segment_object(
    data: bytes | memoryview,
    *,
    key: str,
    codec: str,
    frame_bytes: int = OBJECT_FRAME_BYTES,
    dropped: Collection[int] = (),
) -> SegmentObject:
    """Regroup a sealed segment's frames by topic into a ``.bin`` object.

    Frames of a topic id in ``dropped``, or dropped by a DROP frame in the segment, are left
    out: they belong to a deleted topic (``RegionLog.dropped``).

    Raises ``ObjectFormatError`` naming ``key`` if the segment does not decode (a damaged
    sealed segment is never uploaded in part).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    names: dict[int, str] = {}
    runs: dict[int, _Run] = {}
    skip = set(dropped)
    writer = BinWriter(codec)

    def flush(topic_id: int, run: _Run) -> None:
        writer.add_wal_frames(
            names[topic_id],
            b"".join(run.parts),
            first_offset=run.first_offset,
            last_offset=run.last_offset,
            entries=run.entries,
            first_ingest_ms=run.first_ms,
            last_ingest_ms=run.last_ms,
        )

    position = 0
    end = len(view)
    try:
        while position < end:
            frame = decode_frame(view, position)
            kind = frame.kind
            if kind == Kind.MESSAGES:
                header = batch_header(frame.body)
                topic_id = header.topic_id
                if topic_id in skip:
                    position = frame.end
                    continue
                if topic_id not in names:
                    raise ObjectFormatError(
                        key, position, f"MESSAGES frame of unregistered topic id {topic_id}"
                    )
                run = runs.get(topic_id)
                if run is None:
                    run = runs[topic_id] = _Run()
                if run.entries == 0:
                    run.first_offset = header.base_offset
                    run.first_ms = header.first_ingest_ms
                run.parts.append(view[position : frame.end])
                run.size += frame.end - position
                run.entries += header.num_entries
                run.last_offset = header.base_offset + header.num_entries - 1
                run.last_ms = header.last_ingest_ms
                if run.size >= frame_bytes:
                    flush(topic_id, run)
                    runs[topic_id] = _Run()
            elif kind == Kind.TIME:
                topic_id = decode_time(frame.body)[0]
                run = runs.get(topic_id)
                if run is not None and run.entries:
                    # Travels with the topic's data (the hour-completeness signal downstream).
                    run.parts.append(view[position : frame.end])
                    run.size += frame.end - position
            elif kind == Kind.TOPIC:
                topic_id, name = decode_topic(frame.body)
                names[topic_id] = name
            elif kind == Kind.DROP:
                topic_id = decode_drop(frame.body)[0]
                skip.add(topic_id)
                runs.pop(topic_id, None)
            position = frame.end
    except FrameError as exc:
        raise ObjectFormatError(key, position, f"segment does not decode: {exc}") from exc
    for topic_id, run in runs.items():
        if run.entries:
            flush(topic_id, run)
    body = writer.finish()
    return SegmentObject(key, len(body), crc32c(body), writer.footer, body)


@dataclass
class UploaderStats:
    """What the uploader did since it started (for ``status`` and tests)."""

    segments: int = 0
    """Segments uploaded and committed."""
    puts: int = 0
    """Objects written (a re-run that found its object already stored writes none)."""
    bytes: int = 0
    ranges: int = 0
    """Manifest entries written."""
    already: int = 0
    """Manifest entries found already committed (re-runs)."""
    failures: int = 0
    last_error: str | None = None
    orphans: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    """(region, seq) -> topics whose range could not be committed (owned elsewhere)."""
    last_lag_ms: float = 0.0
    """Seal (or start, for segments left from before it) to commit of the last segment."""
    max_lag_ms: float = 0.0


class SegmentUploader:
    """Uploads a TopicStore's sealed segments. Use from the store's event loop."""

    def __init__(
        self,
        store: TopicStore,
        objects: ObjectStore,
        manifest: Manifest,
        ownership: Ownership,
        *,
        codec: str = "zstd",
        concurrency: int = 4,
        retry: RetryPolicy | None = None,
        refresh_after_s: float = OBJECT_REFRESH_SECONDS,
        max_bytes_per_second: int | None = None,
    ) -> None:
        """``max_bytes_per_second``: the bandwidth shared by all uploads (None: no limit)."""
        self._store = store
        self._objects = objects
        self._manifest = manifest
        self._ownership = ownership
        self._broker_id = ownership.session.broker_id
        self._codec = codec
        self._concurrency = max(1, concurrency)
        self._retry = retry or RetryPolicy()
        self._queues: dict[str, deque[int]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._idle: dict[str, asyncio.Event] = {}
        self._listeners: list[Callable[[str, int], None]] = []
        self.stats = UploaderStats()
        self._orphan_committer: Callable[[Sequence[ObjectRange]], Awaitable[set[str]]] | None = None
        self._started = False
        #: Segments left from before this start: their topics may have changed hands since.
        self._recovered: set[tuple[str, int]] = set()
        #: (region, seq) of every queued segment -> when it was queued (for the lag).
        self._queued_at: dict[tuple[str, int], float] = {}
        self._refresh_after = refresh_after_s
        #: segment object key -> when the stored object was last written (Unix seconds); an
        #: object found stored by an earlier run counts from its own modification time.
        self._stored_at: dict[str, float] = {}
        #: Paces every object write when a bandwidth limit is set (shared by all uploads).
        self.bandwidth: TokenBucket | None = None
        self._chunk = 0
        if max_bytes_per_second is not None:
            self._chunk = chunk_bytes(max_bytes_per_second)
            self.bandwidth = TokenBucket(max_bytes_per_second, burst=self._chunk)

    # -- lifecycle -------------------------------------------------------------------------

    def on_uploaded(self, callback: Callable[[str, int], None]) -> None:
        """Call ``callback(region, seq)`` after a segment is committed and marked uploaded."""
        self._listeners.append(callback)

    def start(self) -> None:
        """Queue every sealed segment not yet uploaded, then follow new seals."""
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        for region in self._store.regions:
            name = region.region
            self._queues[name] = deque()
            self._wakeups[name] = asyncio.Event()
            self._idle[name] = asyncio.Event()
            for seq in sorted(region.sealed - region.uploaded):
                self._recovered.add((name, seq))
                self._enqueue(name, seq)
            self._tasks.append(loop.create_task(self._worker(region), name=f"uploader-{name}"))
        self._store.set_sealed_callback(self._on_sealed)

    async def stop(self) -> None:
        """Stop uploading. A segment caught mid-upload is repeated at the next start."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def set_orphan_committer(
        self, committer: Callable[[Sequence[ObjectRange]], Awaitable[set[str]]]
    ) -> None:
        """Give ranges of topics owned elsewhere to ``committer`` (which returns the topics it
        committed) before they are reported orphaned."""
        self._orphan_committer = committer

    def retry_orphans(self, topic: str) -> None:
        """Queue again every segment with an orphaned range of ``topic``."""
        for (region, seq), topics in sorted(self.stats.orphans.items()):
            if topic in topics and region in self._queues:
                self._enqueue(region, seq)

    def pending(self) -> int:
        """Segments sealed but not uploaded yet (all regions)."""
        return sum(len(q) for q in self._queues.values())

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every segment sealed so far is uploaded (tests, shutdown)."""

        async def wait() -> None:
            for name, queue in self._queues.items():
                while queue:
                    self._idle[name].clear()
                    await self._idle[name].wait()

        async with asyncio.timeout(timeout):
            await wait()

    # -- queueing --------------------------------------------------------------------------

    def _on_sealed(self, sealed: Sealed) -> None:
        self._enqueue(sealed.region, sealed.seq)

    def _enqueue(self, region: str, seq: int) -> None:
        if (region, seq) in self._queued_at:
            return
        self._queues[region].append(seq)
        self._queued_at[(region, seq)] = time.monotonic()
        self._wakeups[region].set()

    async def _worker(self, region: RegionLog) -> None:
        name = region.region
        queue = self._queues[name]
        wakeup = self._wakeups[name]
        while True:
            if not queue:
                self._idle[name].set()
                wakeup.clear()
                await wakeup.wait()
                continue
            seqs = [queue[i] for i in range(min(self._concurrency, len(queue)))]
            prepared = [asyncio.ensure_future(self._prepare(region, seq)) for seq in seqs]
            try:
                for seq, task in zip(seqs, prepared, strict=True):
                    obj = await task
                    if obj is not None:
                        await self._with_retries(
                            f"commit {obj.key}", functools.partial(self._commit, region, obj)
                        )
                    queue.popleft()
                    del self._queued_at[(name, seq)]
            finally:
                for task in prepared:
                    task.cancel()

    # -- one segment ---------------------------------------------------------------------

    async def _prepare(self, region: RegionLog, seq: int) -> SegmentObject | None:
        """Build and store the object of segment ``seq``; None if it vanished meanwhile."""
        if seq not in region.sealed:
            return None
        key = segment_key(self._broker_id, region.region, seq)
        size = region.segment_sizes[seq]
        data = await region.read(seq, 0, size)
        obj = await self._with_retries(
            f"build {key}",
            lambda: asyncio.to_thread(
                build_segment_object,
                data,
                key=key,
                codec=self._codec,
                dropped=frozenset(region.dropped),
            ),
        )
        if not obj.footer.topics:
            # Only a checkpoint (and maybe TIME markers): nothing to store, nothing to PUT.
            return SegmentObject(key, 0, 0, obj.footer, None)
        return await self._with_retries(f"put {key}", lambda: self._put(obj))

    async def _put(self, obj: SegmentObject) -> SegmentObject:
        assert obj.data is not None
        if await self._write(obj.key, obj.data, if_absent=True):
            self.stats.puts += 1
            self.stats.bytes += obj.size
            self._stored_at[obj.key] = time.time()
            return SegmentObject(obj.key, obj.size, obj.crc, obj.footer, None)
        # Stored by an earlier run (or a retried PUT that had succeeded): use what is there.
        stored = await self._objects.get(obj.key)
        try:
            footer = parse_object(stored, obj.key)
        except ObjectFormatError as exc:
            # Only this broker writes under its segment keys, and it commits an object only
            # after a complete PUT: a damaged object here is a write torn by a crash (an fs
            # store writes in place). Replace it with the segment's object.
            log.warning("replacing a damaged segment object key=%s error=%s", obj.key, exc)
            await self._write(obj.key, obj.data, if_absent=False)
            self.stats.puts += 1
            self.stats.bytes += obj.size
            self._stored_at[obj.key] = time.time()
            return SegmentObject(obj.key, obj.size, obj.crc, obj.footer, None, found=True)
        if object_offsets(footer) != object_offsets(obj.footer):
            raise ObjectFormatError(
                obj.key,
                None,
                "an object with other contents already exists under this segment's key "
                f"(stored: {object_offsets(footer)}, segment: {object_offsets(obj.footer)})",
            )
        log.info("segment object already stored key=%s", obj.key)
        info = await self._objects.stat(obj.key)
        modified_ms = None if info is None else info.modified_ms
        # No modification time (memory store): count it as stored long ago.
        self._stored_at[obj.key] = 0.0 if modified_ms is None else modified_ms / 1000
        return SegmentObject(obj.key, len(stored), crc32c(stored), footer, None, found=True)

    async def _write(self, key: str, data: bytes, *, if_absent: bool) -> bool:
        """Store ``data`` under ``key`` (replacing any object, unless ``if_absent``), paced by
        the bandwidth limit. False: ``if_absent`` and an object is there already."""
        bucket = self.bandwidth
        if bucket is None:
            if if_absent:
                return await self._objects.put_if_absent(key, data)
            await self._objects.put(key, data)
            return True
        if if_absent and await self._objects.size(key) is not None:
            return False
        # s3 and gcs take multipart parts of at least 5 MiB; elsewhere a part is one chunk.
        part = max(self._chunk, 5 << 20) if self._objects.scheme in ("s3", "gcs") else self._chunk
        await self._objects.put_large(
            key, paced_chunks(data, bucket, self._chunk), part_bytes=part, size=len(data)
        )
        return True

    async def _refresh(self, region: RegionLog, obj: SegmentObject) -> None:
        """Store ``obj`` again (its own bytes, or the segment's object if it is gone), so that
        its age starts over before its manifest commit (see ``OBJECT_REFRESH_SECONDS``)."""
        try:
            stored: bytes | None = await self._objects.get(obj.key)
        except ObjectNotFoundError:
            stored = None
        if stored is not None and len(stored) == obj.size and crc32c(stored) == obj.crc:
            await self._write(obj.key, stored, if_absent=False)
            self.stats.puts += 1
            self.stats.bytes += obj.size
            self._stored_at[obj.key] = time.time()
            log.info("segment object stored again before a delayed commit key=%s", obj.key)
            return
        seq = _seq_of(obj.key)
        data = await region.read(seq, 0, region.segment_sizes[seq])
        built = await asyncio.to_thread(
            build_segment_object,
            data,
            key=obj.key,
            codec=self._codec,
            dropped=frozenset(region.dropped),
        )
        if built.size != obj.size or built.crc != obj.crc:
            raise ObjectFormatError(
                obj.key,
                None,
                "the stored segment object changed or vanished before its commit and the "
                "segment no longer builds the same bytes; not committing it",
            )
        await self._put(built)
        log.warning("segment object was gone before its commit; stored again key=%s", obj.key)

    async def _commit(self, region: RegionLog, obj: SegmentObject) -> None:
        ownership = self._ownership
        seq = _seq_of(obj.key)
        stored_at = self._stored_at.get(obj.key)
        if stored_at is not None and time.time() - stored_at > self._refresh_after:
            await self._refresh(region, obj)
        ranges: list[ObjectRange] = []
        # Topics whose ranges may be committed already, or may have been written before
        # another broker owned the topic: checked against the manifest before committing.
        careful_all = obj.found or (region.region, seq) in self._recovered
        careful: set[str] = set()
        for topic in obj.footer.topics:
            owner = ownership.owned(topic)
            if owner is None:
                try:
                    acquired = await ownership.acquire(topic, require_record=True)
                except TopicDeletedError:
                    # Written before the topic was deleted: nothing may commit it any more.
                    log.info(
                        "segment range of a deleted topic skipped key=%s topic=%s", obj.key, topic
                    )
                    continue
                owner = acquired if acquired.broker_id == self._broker_id else None
                if owner is not None and await self._stale_incarnation(topic):
                    continue
                careful.add(topic)
            ranges.append(
                segment_range(obj, topic, self._broker_id, owner.epoch if owner is not None else 0)
            )
        already: list[ObjectRange] = []
        stale: list[str] = []
        checked = [r for r in ranges if careful_all or r.topic in careful]
        if checked:
            ranges = [r for r in ranges if not (careful_all or r.topic in careful)]
            todo, already, behind = await self._classify(checked)
            ranges += todo
            stale = [r.topic for r in behind]
        result = CommitResult([], already, stale)
        if ranges:
            done = await self._manifest.commit(ownership, ranges)
            result = CommitResult(done.committed, done.already + already, done.fenced + stale)
        self.stats.ranges += len(result.committed)
        self.stats.already += len(result.already)
        self._stored_at.pop(obj.key, None)  # stored again (and stat'ed) if it comes back
        if result.fenced and self._orphan_committer is not None:
            # A new owner may be waiting for exactly these ranges (``objects.handover``).
            handed = await self._orphan_committer([r for r in ranges if r.topic in result.fenced])
            result = CommitResult(
                result.committed,
                result.already,
                [t for t in result.fenced if t not in handed],
            )
        if result.fenced:
            self.stats.orphans[(region.region, seq)] = sorted(result.fenced)
            log.error(
                "segment ranges orphaned: owned by another broker key=%s topics=%s "
                "(kept in the local WAL; committed only if this broker owns them again before "
                "anyone else wrote later offsets)",
                obj.key,
                ",".join(sorted(result.fenced)),
            )
            return
        self.stats.orphans.pop((region.region, seq), None)
        if seq in region.sealed:
            region.mark_uploaded(seq)
        self.stats.segments += 1
        queued_at = self._queued_at.get((region.region, seq))
        lag_ms = 0.0 if queued_at is None else (time.monotonic() - queued_at) * 1000
        self.stats.last_lag_ms = lag_ms
        self.stats.max_lag_ms = max(self.stats.max_lag_ms, lag_ms)
        UPLOAD_SECONDS.observe(lag_ms / 1000)
        # A segment of nothing but time markers (an idle broker's, every segment_seconds) is
        # routine: INFO is for segments that carried entries.
        log.log(
            logging.INFO if ranges else logging.DEBUG,
            "segment uploaded key=%s bytes=%d topics=%d committed=%d already=%d lag_ms=%.0f",
            obj.key,
            obj.size,
            len(ranges),
            len(result.committed),
            len(result.already),
            lag_ms,
        )
        for listener in self._listeners:
            listener(region.region, seq)

    async def _stale_incarnation(self, topic: str) -> bool:
        """Whether this WAL's data of ``topic`` belongs to a deleted incarnation (the topic
        was deleted while this broker was away and created again since): then it is dropped
        from the WAL (``TopicStore.drop_topic``) and never committed."""
        known = self._store.incarnation(topic)
        stored = await self._manifest.kv.get(self._manifest.keys.topic(topic))
        if known is None or stored is None or stored.create_revision == known:
            return False
        await self._store.drop_topic(topic)
        log.warning(
            "stale wal data of a deleted topic dropped by the uploader topic=%s incarnation=%d "
            "was=%d",
            topic,
            stored.create_revision,
            known,
        )
        return True

    async def _classify(
        self, ranges: list[ObjectRange]
    ) -> tuple[list[ObjectRange], list[ObjectRange], list[ObjectRange]]:
        """Split ranges into (to commit, wholly covered by the manifest already, behind).

        Covered: a re-run (the entries may even have been merged by a rotation into a range
        starting elsewhere, which the commit's per-key check cannot see). Behind: the manifest
        already holds later offsets of the topic (another owner went on meanwhile); committing
        would put older epochs after newer ones and readers past that point would never see
        the range, so it stays orphaned in the local WAL instead. Also behind: a range starting
        below the topic's clock offset, which promises readers that nothing more is ever added
        below it (another owner declared those offsets complete meanwhile), or below its
        retained floor (retention removed the range after an earlier commit of it: a re-run
        must not bring it back, naming an object the orphan collector may have deleted).
        """
        todo: list[ObjectRange] = []
        done: list[ObjectRange] = []
        behind: list[ObjectRange] = []
        clocks: dict[str, int] = {}
        for rng in ranges:
            existing = await self._manifest.ranges(rng.topic, rng.start_offset)
            if not existing:
                if rng.topic not in clocks:
                    clock = await read_clock(self._manifest.kv, self._manifest.keys, rng.topic)
                    floor = await self._manifest.floor(rng.topic)
                    clocks[rng.topic] = max(
                        0 if clock is None else clock.offset, 0 if floor is None else floor.offset
                    )
                (behind if rng.start_offset < clocks[rng.topic] else todo).append(rng)
                continue
            try:
                whole = covered(rng, existing)
            except ManifestConflictError:
                whole = False  # partly there: as much out of line as later offsets
            (done if whole else behind).append(rng)
        return todo, done, behind

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``attempt`` until it succeeds, backing off between failures (forever: what is
        not uploaded is kept, never dropped), with the object store's own backoff."""
        retry = 0
        while True:
            delay = self._retry.delay(retry)
            try:
                return await attempt()
            except (DanubeIngestError, OSError, LeaseExpiredError, MetadataError) as exc:
                self.stats.failures += 1
                self.stats.last_error = f"{what}: {exc}"
                log.error("upload step failed (will retry in %.1fs) %s: %s", delay, what, exc)
            except Exception as exc:
                # A bug, not an outage: say so loudly (with the traceback), but keep the
                # region's uploads alive rather than let this task die in silence.
                self.stats.failures += 1
                self.stats.last_error = f"{what}: unexpected {exc!r}"
                log.exception(
                    "upload step failed unexpectedly (will retry in %.1fs) %s", delay, what
                )
            await asyncio.sleep(delay)
            retry += 1


def segment_range(obj: SegmentObject, topic: str, broker: str, epoch: int) -> ObjectRange:
    """The manifest entry of ``topic``'s range in segment object ``obj``, written by
    ``broker`` under ownership ``epoch``."""
    span = obj.footer.topics[topic]
    return ObjectRange(
        topic=topic,
        object_key=obj.key,
        start_offset=span.first_offset,
        end_offset=span.last_offset + 1,
        entries=span.entries,
        byte_start=span.position,
        byte_length=span.length,
        object_size=obj.size,
        object_crc=obj.crc,
        first_ingest_ms=span.first_ingest_ms,
        last_ingest_ms=span.last_ingest_ms,
        kind="segment",
        broker=broker,
        epoch=epoch,
    )


def object_offsets(footer: Footer) -> list[tuple[str, int, int, int]]:
    return [(t, s.first_offset, s.last_offset, s.entries) for t, s in footer.topics.items()]


def _seq_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1].split(".", 1)[0])


__all__ = [
    "OBJECT_FRAME_BYTES",
    "SegmentObject",
    "SegmentUploader",
    "UploaderStats",
    "build_segment_object",
    "segment_key",
]
