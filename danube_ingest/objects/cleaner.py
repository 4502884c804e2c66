"""WalCleaner: the "clean" half of mark + clean (CeresDB's split for its Kafka WAL).

Each pass looks at every region's sealed segments, oldest first, and deletes a segment only
when all of these hold (and stops at the first one that may not go, so a topic's retained
offsets stay one contiguous run):

1. **Uploaded** (mode ``wal_cloud``): the segment's object is stored and every topic range in it
   is committed to the manifest (``RegionLog.uploaded``, set by the uploader after the commit).
   Orphaned ranges (owned elsewhere, see the uploader) keep their segment forever.
2. **Retention minimums**: its newest entry is at least ``retention.min_minutes`` old, and at
   least ``retention.min_bytes`` of WAL remain after deleting it.
3. **Below every topic's floor**: for each topic in the segment, its last offset there is below
   the topic's floor. The floor is the prune mark ``wal/{broker}/{region}/floor/{ns}/{topic}``
   when the control plane (Dagster) has written one; until then the lowest cursor of the
   topic's subscriptions (a subscription without a cursor holds everything), or the high
   watermark for a topic without subscriptions.

Condition 3 is waived (never 1 or 2) for data older than ``retention.max_minutes``, while the
WAL holds more than its prune level (:func:`~danube_ingest.wal.space.prune_level`: four segments
below ``retention.max_bytes``, so that the WAL is pruned before publishes find it full; the
store wakes the cleaner when it grows past that level) and while the WAL's filesystem has less than
``retention.min_free_bytes`` free (measured again before each deletion, see
:mod:`danube_ingest.wal.space`): a subscription that far behind then reads from objects.

In ``local_only`` and ``memory`` modes the WAL is the only copy: condition 1 does not apply,
and consumption alone never prunes (``prune_consumed=False``): segments go only under the
retention maximums, oldest first, as in Kafka; a subscription that far behind then gets
``OffsetOutOfRange``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from danube_ingest.aio import BackgroundLoop, wait_event
from danube_ingest.config.models import RetentionConfig
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.marks import PruneMarks, subscription_cursors
from danube_ingest.store.topic_store import TopicStore
from danube_ingest.wal.log import RegionLog
from danube_ingest.wal.meta import SegSpan, TopicMeta
from danube_ingest.wal.space import prune_level

log = logging.getLogger(__name__)

#: Seconds between two cleaning passes (a pass also runs right after each upload).
CLEAN_INTERVAL = 5.0


@dataclass
class CleanerStats:
    passes: int = 0
    segments: int = 0
    """Segments deleted."""
    bytes: int = 0
    forced: int = 0
    """Segments deleted under the retention maximums, ahead of some subscription."""
    failures: int = 0
    last_error: str | None = None
    blocked_by: str | None = None
    """Why the oldest segment was kept in the last pass (for status)."""


class WalCleaner(BackgroundLoop):
    """Deletes WAL segments that are safe to delete. Use from the store's event loop."""

    task_name = "wal-cleaner"

    def __init__(
        self,
        store: TopicStore,
        *,
        broker_id: str,
        retention: RetentionConfig,
        kv: KV | None,
        keys: Keys | None,
        require_upload: bool,
        prune_consumed: bool = True,
        interval: float = CLEAN_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self._store = store
        self._broker_id = broker_id
        self._retention = retention
        self._kv = kv
        self._keys = keys
        self._marks = PruneMarks(kv, keys) if kv is not None and keys is not None else None
        self._require_upload = require_upload
        self._prune_consumed = prune_consumed
        self._interval = interval
        self._prune_above = prune_level(retention.max_bytes, store.segment_bytes)
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()
        self.stats = CleanerStats()

    def wake(self, *_: object) -> None:
        """Run a pass soon (e.g. after an upload)."""
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            await wait_event(self._wakeup, self._interval)
            self._wakeup.clear()
            try:
                # The files go in the WAL's file thread; _removed() notes a failure. Not
                # waiting for them keeps a slow disk from delaying the next pass.
                await self._prune()
            except (DanubeIngestError, OSError) as exc:
                self.stats.failures += 1
                self.stats.last_error = str(exc)
                log.warning("wal cleaning pass failed: %s", exc)
            except Exception as exc:
                # A bug, not an outage: loudly, and the next pass still runs.
                self.stats.failures += 1
                self.stats.last_error = f"unexpected {exc!r}"
                log.exception("wal cleaning pass failed unexpectedly")

    async def clean_once(self) -> list[tuple[str, int]]:
        """One pass over every region; returns the (region, seq) deleted, once their files are
        removed (raising the ``OSError`` of a removal that failed)."""
        deleted, removals = await self._prune()
        for removal in removals:
            await removal
        return deleted

    async def _prune(self) -> tuple[list[tuple[str, int]], list[asyncio.Future[None]]]:
        """One pass over every region: the segments deleted from the WAL's index, and the
        removals of their files, under way."""
        async with self._lock:
            self.stats.passes += 1
            deleted: list[tuple[str, int]] = []
            removals: list[asyncio.Future[None]] = []
            for region in self._store.regions:
                deleted.extend(await self._clean_region(region, removals))
            self._store.refresh_backpressure()
            return deleted, removals

    def _removed(self, removal: asyncio.Future[None]) -> None:
        exc = None if removal.cancelled() else removal.exception()
        if exc is not None:
            self.stats.failures += 1
            self.stats.last_error = f"removing a segment file: {exc}"
            log.warning("wal segment file not removed: %s", exc)

    async def _clean_region(
        self, region: RegionLog, removals: list[asyncio.Future[None]]
    ) -> list[tuple[str, int]]:
        retention = self._retention
        now_ms = int(self._clock() * 1000)
        floors: dict[str, int] = {}
        marks: dict[str, int] | None = None
        deleted: list[tuple[str, int]] = []
        while region.sealed:
            seq = min(region.sealed)
            if self._require_upload and seq not in region.uploaded:
                self.stats.blocked_by = f"{region.region}/{seq}: not uploaded yet"
                break
            size = region.segment_sizes.get(seq, 0)
            total = self._store.wal_bytes()
            spans = _spans_in(region.topics(), seq)
            newest_ms = max((span.last_ingest_ms for _, span in spans), default=None)
            age_ms = now_ms - newest_ms if newest_ms is not None else None
            if age_ms is not None and age_ms < retention.min_minutes * 60_000:
                self.stats.blocked_by = f"{region.region}/{seq}: retention.min_minutes"
                break
            if total - size < retention.min_bytes:
                self.stats.blocked_by = f"{region.region}/{seq}: retention.min_bytes"
                break
            over = total > self._prune_above or (
                retention.max_minutes is not None
                and age_ms is not None
                and age_ms >= retention.max_minutes * 60_000
            )
            disk_low = not over and self._store.disk_below_floor()
            forced = over or disk_low
            if not forced and not self._prune_consumed:
                self.stats.blocked_by = f"{region.region}/{seq}: within retention.max_*"
                break
            if not forced:
                blocked = None
                for topic, span in spans:
                    if topic.name not in floors:
                        if marks is None:
                            marks = await self._load_marks(region.region)
                        floors[topic.name] = await self._floor(topic, marks)
                    if span.last_offset >= floors[topic.name]:
                        blocked = f"{topic.name} floor {floors[topic.name]}"
                        break
                if blocked is not None:
                    self.stats.blocked_by = f"{region.region}/{seq}: {blocked}"
                    break
            removal = region.delete_segment(seq)
            removal.add_done_callback(self._removed)
            removals.append(removal)
            if disk_low:
                # The next measurement of the disk must see the space this frees.
                await asyncio.wait([removal])
            deleted.append((region.region, seq))
            self.stats.segments += 1
            self.stats.bytes += size
            self.stats.blocked_by = None
            if forced:
                self.stats.forced += 1
            # Deleting a segment without entries (time markers only: an idle broker's) is
            # routine: INFO is for segments that held data.
            log.log(
                logging.INFO if spans else logging.DEBUG,
                "wal segment deleted region=%s seq=%d bytes=%d forced=%s",
                region.region,
                seq,
                size,
                forced,
            )
        return deleted

    async def _load_marks(self, region: str) -> dict[str, int]:
        if self._marks is None:
            return {}
        return await self._marks.marks(self._broker_id, region)

    async def _floor(self, topic: TopicMeta, marks: dict[str, int]) -> int:
        mark = marks.get(topic.name)
        if mark is not None:
            return mark
        if self._kv is None or self._keys is None:
            return topic.hwm
        cursors = await subscription_cursors(self._kv, self._keys, topic.name)
        if not cursors:
            return topic.hwm
        return min(0 if cursor is None else cursor for cursor in cursors.values())


def _spans_in(topics: list[TopicMeta], seq: int) -> list[tuple[TopicMeta, SegSpan]]:
    """The topics holding data in segment ``seq`` (the region's oldest), with their span."""
    found = []
    for topic in topics:
        spans = topic.spans
        if spans and spans[0].seq == seq:
            found.append((topic, spans[0]))
    return found


__all__ = ["CLEAN_INTERVAL", "CleanerStats", "WalCleaner"]
