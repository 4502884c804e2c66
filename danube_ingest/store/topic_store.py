"""TopicStore: append to topics and read them back from any retained offset.

Guarantees:

* ``append`` returns the entry's offset once it is durable (per ``wal.fsync``). Offsets of a
  topic are consecutive from 0 and continue across restarts.
* A reader from ``from_offset`` yields every entry of the topic from that offset on, in offset
  order, with no gap and no duplicate, whether it comes from segment files, the cache or live
  appends; it only ever sees durable entries.
* Readers pull: a reader holds at most ``max_batch`` entries (plus one segment read buffer),
  so a slow reader costs only its own buffer and never stalls the writer or other readers.
* Below the topic's first retained offset (the WAL floor) a reader continues from the object
  store when a :class:`~danube_ingest.objects.reader.CloudReader` is attached (``attach_cloud``)
  and switches back to segment files, cache and live appends at the floor, with no gap or
  duplicate; without one it raises ``OffsetOutOfRangeError``, as it does below the retained
  floor of the topic's objects (object retention removed those ranges), naming that floor.
* With ``max_wal_bytes`` set, appends fail with ``WalBackpressureError`` (retriable) while the
  regions hold more than that many bytes of segments, until the cleaner frees space. The store
  calls ``on_pressure`` (the broker wakes its cleaner) as soon as they hold more than
  ``prune_wal_bytes`` (:func:`~danube_ingest.wal.space.prune_level`, a few segments less),
  so that the cleaner makes room before appends find the WAL full.
* With ``min_free_bytes`` set, appends fail with ``WalBackpressureError`` (retriable) before
  they could leave less than that many bytes free on the WAL's filesystem, and succeed again,
  without a restart, once space is freed by anyone: as soon as a quarter of the floor is free
  above it (``RESUME_FRACTION``; see :mod:`danube_ingest.wal.space`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from crc32c import crc32c

from danube_ingest.config import BrokerConfig
from danube_ingest.errors import (
    CorruptFrameError,
    OffsetOutOfRangeError,
    TruncatedFrameError,
    WalBackpressureError,
    WalClosedError,
    WalCorruptionError,
)
from danube_ingest.store.cache import WALCache
from danube_ingest.wal.block import EntryBlock
from danube_ingest.wal.framing import Entry, Kind, batch_header, decode_frame, decode_messages
from danube_ingest.wal.kafka import KafkaWal
from danube_ingest.wal.log import (
    DEFAULT_LINGER_US,
    DEFAULT_SEGMENT_BYTES,
    FsyncMode,
    Group,
    RegionLog,
    Sealed,
    StagedBlock,
)
from danube_ingest.wal.meta import (
    PRODUCER_WINDOW,
    ProducerBatch,
    TopicMeta,
    fsync_dir,
    write_atomic,
)
from danube_ingest.wal.segment import segment_path
from danube_ingest.wal.space import DiskFree, disk_free, prune_level
from danube_ingest.wal.stored import StoredEntries, last_offset, offset_at

if TYPE_CHECKING:
    from danube_ingest.objects.reader import CloudReader, ObjectCursor

log = logging.getLogger(__name__)

#: Bytes read from a segment file per call while catching up.
READ_CHUNK_BYTES = 1024 * 1024
#: Seconds between two measurements of the WAL filesystem's free space when nothing else
#: prompts one: bounds how long space freed by an operator goes unnoticed while refusing, and
#: how long another process can eat into the floor unseen.
DISK_CHECK_INTERVAL = 1.0
#: Once refusing for want of disk space, publishes resume only when this fraction of the floor
#: is free above it (and the cleaner prunes until then): otherwise each pruned segment would
#: admit a message or two and the store would flap (and log) at the floor.
RESUME_FRACTION = 0.25
#: Bytes counted per appended entry beyond its payload when estimating the disk it will use
#: (frame and entry headers, producer name, attributes: generous, so the estimate errs low).
ENTRY_OVERHEAD = 128


def region_index(topic: str, regions: int) -> int:
    """The region (``r{index}``) holding ``topic`` in a store of ``regions`` region logs.

    Topics are spread over regions by name; the control plane uses this to find which region's
    prune mark belongs to a topic (brokers publish their region count in their registration).
    """
    return crc32c(topic.encode()) % regions


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    region: str
    first_offset: int
    """Oldest offset still readable."""
    high_watermark: int
    """Every offset below this is durable; the next append gets at least this offset."""
    last_ingest_ms: int
    next_offset: int
    """The offset the next append gets (above the high watermark while appends are in flight)."""


@dataclass(frozen=True, slots=True)
class TimeMark:
    """What a durable time marker states about its topic (``TopicStore.advance_time``)."""

    offset: int
    """The topic's next offset when the marker was staged: every entry below it is durable."""
    ingest_ms: int
    """Every entry at ``offset`` or above has an ingest time of at least this."""


#: File in the WAL directory mapping topic names to the incarnation their WAL data belongs to.
INCARNATIONS_NAME = "incarnations.json"


def _read_incarnations(wal_dir: Path | None) -> dict[str, int]:
    if wal_dir is None:
        return {}
    try:
        raw = json.loads((wal_dir / INCARNATIONS_NAME).read_bytes())
        return {str(k): int(v) for k, v in raw.items()}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, AttributeError) as exc:
        # Written atomically, so damage means tampering: forget it (data then counts as of the
        # current incarnation, as before incarnations were recorded).
        log.warning("wal incarnations ignored path=%s error=%r", wal_dir / INCARNATIONS_NAME, exc)
        return {}


def _write_incarnations(wal_dir: Path, data: bytes) -> None:
    write_atomic(wal_dir / INCARNATIONS_NAME, data)
    fsync_dir(wal_dir)


class TopicStore:
    """Topics over one or more region logs, with a WALCache in front of them."""

    def __init__(
        self,
        regions: list[RegionLog],
        cache: WALCache,
        *,
        max_wal_bytes: int | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        wal_dir: Path | None = None,
        min_free_bytes: int = 0,
        free_space: DiskFree = disk_free,
    ) -> None:
        self._regions = regions
        self._cache = cache
        self._cloud: CloudReader | None = None
        self._max_wal_bytes = max_wal_bytes
        self.segment_bytes = segment_bytes
        #: Above this many bytes of WAL the cleaner prunes as over ``max_wal_bytes``.
        self.prune_wal_bytes = (
            None if max_wal_bytes is None else prune_level(max_wal_bytes, segment_bytes)
        )
        self._full = False
        self._over_max = False
        self._over_prune = False
        #: The free-space floor, on ``wal_dir``'s filesystem (0 or no dir: not watched).
        self._wal_dir = wal_dir
        self._min_free = min_free_bytes if wal_dir is not None else 0
        self._free_space = free_space
        #: Bytes appends may still add before the floor: measured free space minus the floor
        #: and what was unwritten then, minus every append's estimate since.
        self._room = float("inf")
        self._disk_low = False
        self._free_measured = -1
        self._disk_timer: asyncio.TimerHandle | None = None
        #: Called when the WAL grows past ``prune_wal_bytes`` and when appends begin to be
        #: refused (the broker wakes its cleaner with it).
        self.on_pressure: Callable[[], None] | None = None
        self._topic_region: dict[str, RegionLog] = {}
        for region in regions:
            for topic in region.topics():
                self._topic_region[topic.name] = region
            region.on_durable = self._on_durable
        self._closed = False
        #: topic -> the incarnation (its record's etcd create revision) the WAL's data of the
        #: topic belongs to; persisted in ``wal_dir/incarnations.json``.
        self._incarnations: dict[str, int] = _read_incarnations(wal_dir)
        self._incarnations_lock = asyncio.Lock()

    @classmethod
    async def open(
        cls,
        wal_dir: Path | str | None,
        *,
        regions: int = 1,
        fsync: FsyncMode = "always",
        fsync_interval_ms: int = 0,
        linger_us: int = DEFAULT_LINGER_US,
        max_batch_bytes: int = 4 * 1024 * 1024,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        segment_seconds: float = 10.0,
        index_interval: int = 64 * 1024,
        max_entry_bytes: int = 64 * 1024 * 1024,
        cache_max_bytes: int = 256 * 1024 * 1024,
        cache_topic_max_bytes: int = 8 * 1024 * 1024,
        max_wal_bytes: int | None = None,
        min_free_bytes: int = 0,
        free_space: DiskFree = disk_free,
        kafka: KafkaWal | None = None,
    ) -> TopicStore:
        """Open (recovering) a store under ``wal_dir``; ``None`` keeps everything in memory.
        With ``kafka`` the regions' logs are in Kafka and ``wal_dir`` caches them.

        ``min_free_bytes`` is the free-space floor of the WAL's filesystem (0: none), measured
        with ``free_space`` (``os.statvfs``; tests may hand in another source).
        """
        logs = []
        for i in range(regions):
            region_dir = None if wal_dir is None else Path(wal_dir) / f"r{i}"
            logs.append(
                await RegionLog.open(
                    region_dir,
                    region=f"r{i}",
                    fsync=fsync,
                    fsync_interval_ms=fsync_interval_ms,
                    linger_us=linger_us,
                    max_batch_bytes=max_batch_bytes,
                    segment_bytes=segment_bytes,
                    segment_seconds=segment_seconds,
                    index_interval=index_interval,
                    max_entry_bytes=max_entry_bytes,
                    min_free_bytes=min_free_bytes,
                    free_space=free_space,
                    kafka=kafka,
                )
            )
        store = cls(
            logs,
            WALCache(cache_max_bytes, cache_topic_max_bytes),
            max_wal_bytes=max_wal_bytes,
            segment_bytes=segment_bytes,
            wal_dir=None if wal_dir is None else Path(wal_dir),
            min_free_bytes=min_free_bytes,
            free_space=free_space,
        )
        if store._min_free > 0:
            store._measure_disk()
            store._check_disk_later()
        store.refresh_backpressure()
        return store

    @classmethod
    async def from_config(cls, config: BrokerConfig) -> TopicStore:
        """Open the store described by ``config.storage`` (``mode: memory`` keeps no files)."""
        wal = config.storage.wal
        cache = config.storage.cache
        return await cls.open(
            None if config.storage.mode == "memory" else config.wal_dir(),
            regions=wal.regions,
            fsync=wal.fsync,
            fsync_interval_ms=int(wal.fsync_interval_ms),
            linger_us=wal.linger_us,
            max_batch_bytes=wal.max_batch_bytes,
            segment_bytes=wal.segment_bytes,
            segment_seconds=float(wal.segment_seconds),
            index_interval=wal.index_interval_bytes,
            max_entry_bytes=config.limits.max_payload_bytes,
            cache_max_bytes=cache.max_bytes,
            cache_topic_max_bytes=cache.topic_max_bytes,
            max_wal_bytes=None if config.storage.mode == "memory" else wal.retention.max_bytes,
            min_free_bytes=wal.retention.min_free_bytes,
            kafka=kafka_wal(config),
        )

    # -- topics ----------------------------------------------------------------------------

    def _region(self, topic: str) -> RegionLog:
        region = self._topic_region.get(topic)
        if region is None:
            if self._closed:
                raise WalClosedError("topic store is closed")
            region = self._regions[region_index(topic, len(self._regions))]
            self._topic_region[topic] = region
        return region

    def info(self, topic: str) -> TopicInfo | None:
        region = self._topic_region.get(topic)
        meta = region.topic(topic) if region is not None else None
        if region is None or meta is None:
            return None
        return TopicInfo(
            topic,
            region.region,
            meta.first_offset,
            meta.hwm,
            meta.last_ingest_ms,
            meta.next_offset,
        )

    def next_offset(self, topic: str) -> int:
        """The offset the topic's next append gets (0 for an unknown topic); no allocation."""
        region = self._topic_region.get(topic)
        meta = region.topic(topic) if region is not None else None
        return 0 if meta is None else meta.next_offset

    def topics(self) -> list[str]:
        return sorted(self._topic_region)

    @property
    def regions(self) -> list[RegionLog]:
        return list(self._regions)

    @property
    def cache(self) -> WALCache:
        return self._cache

    def attach_cloud(self, cloud: CloudReader | None) -> None:
        """Serve readers below the WAL floor from objects (None: raise OffsetOutOfRange)."""
        self._cloud = cloud

    @property
    def cloud(self) -> CloudReader | None:
        return self._cloud

    def wal_bytes(self) -> int:
        """Bytes of segments on disk (or in memory), all regions together."""
        return sum(region.disk_bytes for region in self._regions)

    @property
    def full(self) -> bool:
        """Whether appends are refused with ``WalBackpressureError`` right now."""
        return self._full

    @property
    def disk_low(self) -> bool:
        """Whether the WAL's filesystem had less than ``min_free_bytes`` free (counting what
        is staged) at the last measurement."""
        return self._disk_low

    def refresh_backpressure(self) -> bool:
        """Re-evaluate the WAL size limit (after every group commit, and by the cleaner) and,
        while appends are refused for want of disk space or when called by the cleaner, the
        free space; call ``on_pressure`` when the WAL has just grown past its prune level or
        become full."""
        limit, level = self._max_wal_bytes, self.prune_wal_bytes
        if limit is not None and level is not None:
            total = self.wal_bytes()
            self._over_max = total > limit
            over_prune = total > level
            if over_prune and not self._over_prune and self.on_pressure is not None:
                self.on_pressure()
            self._over_prune = over_prune
        if self._min_free > 0 and self._disk_low:
            self._measure_disk()
        return self._update_full()

    def disk_below_floor(self) -> bool:
        """Measure the WAL filesystem now: whether it has less than ``min_free_bytes`` free
        (counting staged appends). For the cleaner, which prunes as over ``max_bytes`` then."""
        if self._min_free <= 0:
            return False
        self._measure_disk()
        self._update_full()
        return self._disk_low

    def _update_full(self) -> bool:
        full = self._over_max or self._disk_low
        if full and not self._full and self.on_pressure is not None:
            self.on_pressure()
        self._full = full
        return full

    def _measure_disk(self) -> None:
        """Measure the free space of the WAL's filesystem and reset the running estimate."""
        assert self._wal_dir is not None
        try:
            free = self._free_space(self._wal_dir)
        except OSError as exc:
            # Cannot tell: assume the worst rather than write blind (retriable for clients).
            log.warning("wal free space unknown dir=%s error=%s", self._wal_dir, exc)
            free = 0
        unwritten = 0
        for region in self._regions:
            unwritten += region.unwritten_bytes
        self._free_measured = free
        self._room = free - self._min_free - unwritten
        low = self._room < self._min_free * RESUME_FRACTION if self._disk_low else self._room <= 0
        if low != self._disk_low:
            log.warning(
                "wal disk %s dir=%s free=%d unwritten=%d min_free_bytes=%d",
                "below its free-space floor: refusing publishes" if low else "has room again",
                self._wal_dir,
                free,
                unwritten,
                self._min_free,
            )
        self._disk_low = low

    def _check_disk_later(self) -> None:
        self._disk_timer = asyncio.get_running_loop().call_later(
            DISK_CHECK_INTERVAL, self._check_disk
        )

    def _check_disk(self) -> None:
        if self._closed:
            return
        self._measure_disk()
        self._update_full()
        self._check_disk_later()

    def _admit(self, size: int) -> None:
        """Count ``size`` bytes about to be staged against the free-space floor; measure the
        disk when the estimate says they would cross it, and refuse them if they would."""
        room = self._room - size - ENTRY_OVERHEAD
        if room < 0:
            self._measure_disk()
            room = self._room - size - ENTRY_OVERHEAD
            if room < 0:
                self._disk_low = True
                self._update_full()
                self._refuse()
        self._room = room

    def _refuse(self) -> None:
        if self._disk_low:
            raise WalBackpressureError(
                f"the WAL's disk ({self._wal_dir}) has {max(self._free_measured, 0)} bytes free "
                f"counting staged appends, below its floor of {self._min_free} "
                "(storage.wal.retention.min_free_bytes): waiting for uploads and pruning, or "
                "for space freed on that filesystem"
            )
        raise WalBackpressureError(
            f"the WAL holds {self.wal_bytes()} bytes, more than its limit of "
            f"{self._max_wal_bytes} (storage.wal.retention.max_bytes): waiting for uploads "
            "and pruning to free space"
        )

    def set_sealed_callback(self, callback: Callable[[Sealed], None]) -> None:
        """Have every region announce each segment it seals (for the uploader)."""
        for region in self._regions:
            region.on_sealed = callback

    # -- writing ---------------------------------------------------------------------------

    def append(self, topic: str, entry: Entry) -> Awaitable[int]:
        """Append one entry: ``offset = await store.append(topic, entry)``.

        The entry is staged before this returns (its offset is assigned, so appends are ordered
        by call, and an un-awaited append is still written); awaiting returns the offset once
        the entry is durable, or raises the write's error. Cancelling the await does not
        withdraw the entry.
        """
        if self._full:
            self._refuse()
        if self._min_free:
            self._admit(len(entry.payload))
        region = self._topic_region.get(topic)
        if region is None:
            region = self._region(topic)
        region.stage(topic, entry)
        return entry

    async def append_batch(self, topic: str, entries: Sequence[Entry]) -> range:
        """Append entries of one topic in one call; return their offsets once all are durable."""
        if not entries:
            return range(0)
        if self._full:
            self._refuse()
        if self._min_free:
            size = 0
            for entry in entries:
                size += len(entry.payload) + ENTRY_OVERHEAD
            self._admit(size)
        await self._region(topic).stage_batch(topic, entries)
        return range(entries[0].offset, entries[-1].offset + 1)

    def append_block(
        self, topic: str, block: EntryBlock, producer_id: int = 0, sequence: int = 0
    ) -> StagedBlock:
        """Append a checked entry block as one frame (see ``RegionLog.stage_block``).

        The block is staged before this returns (ordered by call, like ``append``); awaiting
        ``.future`` waits until it is durable. ``.offsets`` are its offsets, those of its first
        storage when ``.duplicate`` (an idempotent producer's retry: nothing stored again).
        """
        if self._full:
            self._refuse()
        if self._min_free:
            self._admit(len(block.data) + ENTRY_OVERHEAD)
        return self._region(topic).stage_block(topic, block, producer_id, sequence)

    async def advance_time(self, topic: str) -> TimeMark:
        """Durably mark that ``topic`` will get no entry with an ingest time before now.

        Returns what the marker states, true once this returns: every entry of the topic at
        ``offset`` or above has an ingest time of at least ``ingest_ms``, and every entry below
        ``offset`` is durable.
        """
        region = self._region(topic)
        batch = region.stage_time_marker(topic)
        meta = region.topic(topic)
        assert meta is not None
        # Entries staged after the marker get offsets from here on and times from here on.
        mark = TimeMark(meta.next_offset, meta.last_ingest_ms)
        await batch
        return mark

    def uploaded_below(self, topic: str, offset: int) -> bool:
        """Whether every entry of ``topic`` below ``offset`` this WAL holds or held is in a
        segment marked uploaded (committed to the manifest; pruned segments were uploaded
        first where an uploader runs). True for a topic this store never had."""
        region = self._topic_region.get(topic)
        meta = region.topic(topic) if region is not None else None
        if region is None or meta is None:
            return True
        uploaded = region.uploaded
        for span in meta.spans:
            if span.first_offset >= offset:
                break
            if span.seq not in uploaded:
                return False
        return True

    async def ensure_topic(
        self, topic: str, *, min_next_offset: int = 0, min_ingest_ms: int = 0
    ) -> TopicInfo:
        """Create ``topic`` if needed; make its next offset at least ``min_next_offset`` and
        every later entry's ingest time at least ``min_ingest_ms``.

        A jump (of offsets or of the time floor) is durable before this returns; the offsets
        jumped over never exist and readers pass over them.
        """
        region = self._region(topic)
        meta = region.topic(topic)
        if (
            meta is None
            or meta.next_offset < min_next_offset
            or meta.last_ingest_ms < min_ingest_ms
        ):
            await region.stage_time_marker(
                topic, min_next_offset=min_next_offset, min_ingest_ms=min_ingest_ms
            )
        info = self.info(topic)
        assert info is not None
        return info

    async def drop_topic(self, topic: str) -> bool:
        """Forget ``topic`` (it was deleted): see ``RegionLog.drop_topic``. Returns whether this
        store knew it; once this returns the drop is durable, and the name is a new, empty
        topic starting at offset 0. Readers of the dropped incarnation see no more entries."""
        region = self._topic_region.get(topic)
        meta = region.topic(topic) if region is not None else None
        if region is None or meta is None:
            return False
        batch = region.drop_topic(topic)
        self._cache.drop(meta)
        # Wake readers waiting for the dropped incarnation's next entry: there is none.
        waiters, meta.waiters = meta.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        if batch is not None:
            await batch
        return True

    def producer_table(self, topic: str, below: int) -> dict[int, list[tuple[int, int, int]]]:
        """The topic's idempotent producer table as ``{producer id: [(sequence, base offset,
        count), ...]}`` (oldest batch first, least recently used producer first), limited to
        batches wholly below offset ``below``; empty for a topic this store does not know."""
        region = self._topic_region.get(topic)
        meta = region.topic(topic) if region is not None else None
        if meta is None:
            return {}
        table: dict[int, list[tuple[int, int, int]]] = {}
        for producer_id, batches in meta.producers.items():
            kept = [
                (b.sequence, b.base_offset, b.count)
                for b in batches
                if b.base_offset + b.count <= below
            ]
            if kept:
                table[producer_id] = kept
        return table

    async def adopt_producers(
        self, topic: str, table: dict[int, list[tuple[int, int, int]]]
    ) -> None:
        """Replace the topic's idempotent producer table with ``table`` (as ``producer_table``
        returns it, from the topic's previous owner), durably before returning (see
        ``RegionLog.adopt_producers``). Call before the topic is served here."""
        producers = {
            pid: [ProducerBatch(q, b, c) for q, b, c in batches][-PRODUCER_WINDOW:]
            for pid, batches in table.items()
        }
        await self._region(topic).adopt_producers(topic, producers)

    def seal(self, topic: str) -> int:
        """Seal the active segment of ``topic``'s region (so the uploader takes everything
        staged so far); returns the topic's next offset. ``uploaded_below(topic, that)`` then
        says when all of it is committed to the manifest."""
        region = self._region(topic)
        meta = region.topic(topic)
        region.rotate()
        return 0 if meta is None else meta.next_offset

    def incarnation(self, topic: str) -> int | None:
        """The incarnation the WAL's data of ``topic`` belongs to (``set_incarnation``), None
        if none was recorded (the topic is new here, or its data predates the record)."""
        return self._incarnations.get(topic)

    async def set_incarnation(self, topic: str, incarnation: int) -> None:
        """Record, durably before returning, that the topic's data from now on belongs to
        ``incarnation``. Call before serving the topic; ``drop_topic`` first if the recorded
        incarnation is another one."""
        if self._incarnations.get(topic) == incarnation:
            return
        self._incarnations[topic] = incarnation
        if self._wal_dir is not None:
            # One writer at a time (they share the temporary file); each writes the map as it
            # is then, so the last one to finish holds every change.
            async with self._incarnations_lock:
                data = json.dumps(self._incarnations, sort_keys=True).encode()
                await asyncio.to_thread(_write_incarnations, self._wal_dir, data)

    def _on_durable(self, groups: list[Group]) -> None:
        if self._max_wal_bytes is not None or self._disk_low:
            self.refresh_backpressure()
        cache = self._cache
        for topic, entries, nbytes, body in groups:
            if entries:
                cache.extend(topic, entries, nbytes, body)
            waiters = topic.waiters
            if waiters:
                topic.waiters = []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)

    # -- reading ---------------------------------------------------------------------------

    def create_reader(
        self, topic: str, from_offset: int, *, max_batch: int = 1024, stored: bool = False
    ) -> TopicReader:
        """A reader yielding ``topic``'s entries from ``from_offset`` on (see module docs).

        ``stored``: batches read from stored bytes (segments, cold cache blocks, objects) come
        as :class:`~danube_ingest.wal.stored.StoredEntries`, which build no ``Entry`` until
        one is asked for (the reader of a frame consumer)."""
        region = self._region(topic)
        return TopicReader(
            self, region, region.ensure_topic(topic), from_offset, max_batch, stored=stored
        )

    async def earliest_offset(self, topic: str) -> int:
        """The oldest offset of ``topic`` a reader can still get: the first one in objects
        when a cloud reader is attached and the manifest holds older ranges than the WAL,
        else the WAL's first retained offset (0 for an unknown topic)."""
        info = self.info(topic)
        first = 0 if info is None else info.first_offset
        if self._cloud is not None and first > 0:
            ranges = await self._cloud.manifest.ranges(topic)
            if ranges:
                first = min(first, ranges[0].start_offset)
        return first

    async def offset_at_time(self, topic: str, ms: int) -> int:
        """The first offset of ``topic`` whose ingest time is >= ``ms`` (ms since the epoch),
        looking in objects (when attached) and the WAL; the high watermark when no durable
        entry is that recent. Relies on ingest times never decreasing within a topic."""
        info = self.info(topic)
        if info is None:
            return 0
        floor = info.first_offset
        # (first offset, first ingest ms, last ingest ms) of every stretch still readable, in
        # offset order: object ranges below the WAL floor, then the WAL's segment spans.
        stretches: list[tuple[int, int, int]] = []
        if self._cloud is not None and floor > 0:
            for rng in await self._cloud.manifest.ranges(topic):
                if rng.start_offset < floor:
                    stretches.append((rng.start_offset, rng.first_ingest_ms, rng.last_ingest_ms))
        meta = self._region(topic).topic(topic)
        if meta is not None:
            stretches.extend(
                (max(span.first_offset, floor), span.first_ingest_ms, span.last_ingest_ms)
                for span in meta.spans
                if span.last_offset >= floor
            )
        for first, first_ms, last_ms in stretches:
            if last_ms < ms:
                continue
            if first_ms >= ms:
                return first
            return await self._scan_for_time(topic, first, ms, info.high_watermark)
        return info.high_watermark

    async def _scan_for_time(self, topic: str, start: int, ms: int, end: int) -> int:
        """The first offset in [start, end) with ingest time >= ``ms``, else ``end``."""
        reader = self.create_reader(topic, start)
        try:
            while reader.position < end:
                batch = await reader.next_batch()
                if not batch:
                    break
                for entry in batch:
                    if entry.offset >= end:
                        return end
                    if entry.ingest_ms >= ms:
                        return entry.offset
        finally:
            reader.close()
        return end

    async def close(self) -> None:
        """Flush and close every region; readers end. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._disk_timer is not None:
            self._disk_timer.cancel()
        for region in self._regions:
            await region.close()
            for topic in region.topics():
                waiters, topic.waiters = topic.waiters, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)


class _Gap(Exception):
    """The WAL holds no entry of the topic in ``[start, end)`` (raised only with a cloud
    attached: another broker may have owned the topic then, and objects may hold them)."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start = start
        self.end = end


class TopicReader:
    """Async iterator over one topic's entries from a starting offset. See :class:`TopicStore`."""

    def __init__(
        self,
        store: TopicStore,
        region: RegionLog,
        topic: TopicMeta,
        from_offset: int,
        max_batch: int,
        *,
        stored: bool = False,
    ) -> None:
        if from_offset < 0:
            raise ValueError(f"from_offset must be >= 0, got {from_offset}")
        self._store = store
        self._region = region
        self._topic = topic
        self._next = from_offset
        self._max_batch = max_batch
        self._stored = stored
        self._buffer: Sequence[Entry] = []
        self._buffer_pos = 0
        self._closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._cold: ObjectCursor | None = None
        # ``stored``: the segment frame last read, (segment, position), its body and entry
        # bounds: a frame is usually taken over several read batches (256 of 1,000 entries).
        self._last_frame: tuple[tuple[int, int], StoredEntries] | None = None

    @property
    def position(self) -> int:
        """The offset of the next entry this reader yields."""
        if self._buffer_pos < len(self._buffer):
            return offset_at(self._buffer, self._buffer_pos)
        return self._next

    def close(self) -> None:
        """End the reader: a pending ``next_batch`` returns an empty batch."""
        self._closed = True
        self._close_cold()
        self._last_frame = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close_cold(self) -> None:
        if self._cold is not None:
            self._cold.close()
            self._cold = None

    def __aiter__(self) -> TopicReader:
        return self

    async def __anext__(self) -> Entry:
        if self._buffer_pos >= len(self._buffer):
            batch = await self.next_batch()
            if not batch:
                raise StopAsyncIteration
            self._buffer = batch
            self._buffer_pos = 0
        entry = self._buffer[self._buffer_pos]
        self._buffer_pos += 1
        return entry

    async def next_batch(self) -> Sequence[Entry]:
        """The next entries (at least one, at most ``max_batch``); empty once the store closed.

        Waits for new appends when the reader has caught up. A list, or with ``stored``
        :class:`StoredEntries` where the entries were read from stored bytes.
        """
        if self._buffer_pos < len(self._buffer):
            rest = self._buffer[self._buffer_pos :]
            self._buffer = []
            self._buffer_pos = 0
            return rest
        topic = self._topic
        store = self._store
        while True:
            if self._closed or store._closed:
                return []
            nxt = self._next
            if nxt < topic.first_offset:
                if store._cloud is None:
                    raise OffsetOutOfRangeError(topic.name, nxt, topic.first_offset)
                # Still cached (the cache outlives pruned segments) or else in objects.
                batch = store._cache.read(topic, nxt, self._max_batch, self._stored)
                if not batch:
                    batch = await self._read_objects(nxt, topic.first_offset)
                if batch:
                    self._next = last_offset(batch) + 1
                    return batch
                continue
            hwm = topic.hwm
            if nxt < hwm:
                batch = store._cache.read(topic, nxt, self._max_batch, self._stored)
                if not batch:
                    cached_from = store._cache.first_offset(topic)
                    limit = hwm if cached_from is None or cached_from < nxt else cached_from
                    try:
                        batch = await self._read_segments(nxt, limit)
                    except OffsetOutOfRangeError:
                        if store._cloud is None:
                            raise
                        continue  # segments were pruned under the read: go on from objects
                    except _Gap as gap:
                        batch = await self._read_objects(gap.start, gap.end)
                        if not batch:
                            continue
                        self._next = last_offset(batch) + 1
                        return batch
                if batch:
                    if self._cold is not None:
                        self._close_cold()
                    self._next = last_offset(batch) + 1
                    return batch
                continue
            # Caught up: what an object cursor holds (decoded reads and prefetches, up to
            # ``prefetch + 1`` reads) is not needed while waiting, possibly for a long time.
            self._close_cold()
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            topic.waiters.append(waiter)
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None

    async def _read_objects(self, start: int, end: int) -> Sequence[Entry]:
        """Entries from ``start`` out of the object store, for offsets ``[start, end)`` the WAL
        does not hold: below its floor, or a gap in it. Empty when the reader only moved past
        offsets that do not exist (``self._next`` is then advanced, at most to ``end``).

        A gap is usually offsets nobody ever assigned (a takeover skips ahead to its
        reservation), but if the topic was owned by another broker in between (it moved away
        and back, e.g. in a rolling restart) that broker's entries are there, in objects.
        """
        topic = self._topic
        cloud = self._store._cloud
        assert cloud is not None
        cursor = self._cold
        if cursor is None:
            cursor = self._cold = cloud.cursor(topic.name, stored=self._stored)
        entries, reached = await cursor.read(start, self._max_batch)
        if entries:
            # Entries at or past ``end`` are the WAL's own too (uploaded): the same ones.
            return entries
        if reached == start:
            # Neither the objects nor the WAL hold [start, end): offsets jumped over when the
            # topic moved to this broker (its reservation gap, the usual case), or ranges a
            # previous owner acknowledged but never committed (see the uploader's orphans).
            log.info(
                "offsets missing from WAL and objects topic=%s from=%d to=%d",
                topic.name,
                start,
                end,
            )
        self._next = min(reached, end) if reached > start else end
        return []

    async def _read_segments(self, nxt: int, limit: int) -> Sequence[Entry]:
        """Entries [nxt, limit) from segment files, at most ``max_batch`` of them."""
        topic = self._topic
        out = _Collected(self._stored)
        while len(out) < self._max_batch and nxt < limit:
            if nxt < topic.first_offset:  # also: segments deleted while a read was waiting
                raise OffsetOutOfRangeError(topic.name, nxt, topic.first_offset)
            located = topic.locate(nxt)
            if located is None:
                # No entry at or after nxt below the high watermark: a jump at the end.
                if not out and self._store._cloud is not None:
                    raise _Gap(nxt, limit)
                nxt = limit
                break
            span, position = located
            if span.first_offset > nxt:
                # Offsets [nxt, span.first_offset) were jumped over: not in this WAL.
                if out:
                    break
                if self._store._cloud is not None:
                    raise _Gap(nxt, min(span.first_offset, limit))
                nxt = span.first_offset
                if nxt >= limit:
                    break
            stop = min(limit, span.last_offset + 1)
            try:
                reached = await self._scan_segment(span.seq, position, nxt, stop, out)
            except _Gap:
                if out:
                    break  # return what precedes the gap; the next call meets it first
                raise
            if reached == nxt:
                if nxt < topic.first_offset:  # the segment was deleted under the read
                    raise OffsetOutOfRangeError(topic.name, nxt, topic.first_offset)
                raise WalCorruptionError(
                    self._segment_file(span.seq),
                    position,
                    f"offset {nxt} of topic {topic.name} not found where the index points",
                )
            nxt = reached
        if not out:
            self._next = max(self._next, nxt)  # passed over jumped offsets only
        return out.result()

    def _segment_file(self, seq: int) -> str:
        """Segment ``seq``'s file, for errors (memory mode has none: region and number)."""
        region_dir = self._region.region_dir
        if region_dir is None:
            return f"in-memory segment {seq} of region {self._region.region}"
        return str(segment_path(region_dir, seq))

    async def _scan_segment(
        self, seq: int, position: int, nxt: int, stop: int, out: _Collected
    ) -> int:
        """Append entries [nxt, stop) of segment ``seq`` to ``out`` (up to ``max_batch``);
        return the offset reached (past jumped-over offsets too)."""
        topic_id = self._topic.topic_id
        region = self._region
        read_size = READ_CHUNK_BYTES
        while nxt < stop and len(out) < self._max_batch:
            data = await region.read(seq, position, read_size)
            if not data:
                break
            view = memoryview(data)
            p = 0
            while p < len(data) and nxt < stop and len(out) < self._max_batch:
                at = position + p
                try:
                    frame = decode_frame(view, p)
                except TruncatedFrameError:
                    break
                except CorruptFrameError as exc:
                    raise WalCorruptionError(
                        self._segment_file(seq), position + p, str(exc)
                    ) from exc
                p = frame.end
                if frame.kind != Kind.MESSAGES:
                    continue
                header = batch_header(frame.body)
                if header.topic_id != topic_id:
                    continue
                if header.base_offset + header.num_entries <= nxt:
                    continue
                if header.base_offset > nxt:
                    if self._store._cloud is not None:
                        raise _Gap(nxt, min(header.base_offset, stop))
                    nxt = min(header.base_offset, stop)  # offsets jumped over
                    if nxt >= stop:
                        break
                # Only the entries taken are built (a frame is often read in several
                # batches: decoding it whole each time cost ~4x for 1,000-entry frames).
                first = nxt - header.base_offset
                limit = min(self._max_batch - len(out), stop - nxt)
                take: Sequence[Entry]
                if self._stored:
                    last = self._last_frame
                    if last is None or last[0] != (seq, at):
                        last = self._last_frame = ((seq, at), StoredEntries.of_body(frame.body))
                    take = last[1][first : first + limit]
                else:
                    _, take = decode_messages(frame.body, first, limit)
                out.add(take)
                nxt += len(take)
            if p == 0:
                if len(data) < read_size:
                    raise WalCorruptionError(self._segment_file(seq), position, "truncated frame")
                read_size *= 2  # a frame larger than the read buffer: read it whole
                continue
            position += p
        return nxt


class _Collected:
    """The entries of one segment read, in order: a list, or with ``stored`` the
    :class:`StoredEntries` parts joined."""

    __slots__ = ("_count", "_parts", "_stored")

    def __init__(self, stored: bool) -> None:
        self._stored = stored
        self._parts: list[Sequence[Entry]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, part: Sequence[Entry]) -> None:
        if part:
            self._parts.append(part)
            self._count += len(part)

    def result(self) -> Sequence[Entry]:
        parts = self._parts
        if self._stored and all(isinstance(part, StoredEntries) for part in parts):
            return StoredEntries.join(parts)  # type: ignore[arg-type]
        return [entry for part in parts for entry in part]


__all__ = ["Sealed", "TimeMark", "TopicInfo", "TopicReader", "TopicStore", "region_index"]


def kafka_wal(config: BrokerConfig) -> KafkaWal | None:
    """The Kafka backend's settings, or None when the WAL is local (or in memory)."""
    wal = config.storage.wal
    if wal.backend != "kafka" or config.storage.mode == "memory":
        return None
    kafka = wal.kafka
    return KafkaWal(
        kafka.bootstrap_servers,
        wal=config.broker.broker_id,
        topic_prefix=kafka.topic_prefix,
        replication_factor=kafka.replication_factor,
        min_insync_replicas=kafka.min_insync_replicas,
        delivery_timeout_ms=int(kafka.delivery_timeout_ms),
        client=dict(kafka.client),
    )
