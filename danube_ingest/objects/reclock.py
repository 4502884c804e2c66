"""ClockKeeper: moves the ingest clock of every topic this broker owns forward.

Every ``interval`` seconds, for each reliable topic the broker serves (the ``topics`` callable):

1. **Mark**: stage a durable TIME marker (``TopicStore.advance_time``), which states
   ``(offset N, time T)``: every entry at N or above has ingest time ≥ T, every entry below N is
   durable. An idle topic gets a later T each time; a busy one a later N as well. The mark is
   remembered with the ownership epoch it was made under.
2. **Cover**: a mark may be written once every entry of the topic below N is in a segment
   marked uploaded (``TopicStore.uploaded_below``: the uploader committed it to the manifest).
   Offsets below this owner's first one were earlier owners': they are in the manifest, or can
   never be added to it (the uploader refuses a range below the stored clock). The newest
   covered mark per topic is written; older ones are dropped.
3. **Write**: ``ClockWriter.advance`` for all covered topics at once (one transaction per 60
   topics), fenced by each topic's owner epoch. So the etcd write rate is at most one clock
   write per topic per interval.

Marks of an earlier epoch are never written: another owner may have stamped entries in
between, with times the mark does not bound. A topic that stops being served here loses its
marks. Failures (etcd unreachable, WAL closed) are logged and the next pass starts over.

Latency: an idle topic's clock passes an instant within about one ``interval`` of it (its
entries were uploaded long before); a busy topic's within about ``interval`` plus the time its
segment takes to seal and upload (``wal.segment_seconds``), plus one more ``interval``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from danube_ingest.aio import BackgroundLoop
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.clock import ClockMark, ClockWriter
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.store.topic_store import TopicStore

log = logging.getLogger(__name__)

#: Uncovered marks kept per topic. Marks are made once per interval and covered within about
#: ``segment_seconds`` plus an upload; should uploads stall, the newest marks are kept (a mark
#: is only useful when newer than the stored clock) and the oldest are dropped.
MAX_MARKS = 64


class ClockKeeper(BackgroundLoop):
    """Advances the clocks of served reliable topics (see the module docstring)."""

    task_name = "clock-keeper"

    def __init__(
        self,
        store: TopicStore,
        ownership: Ownership,
        topics: Callable[[], Iterable[str]],
        *,
        interval: float,
    ) -> None:
        super().__init__()
        self._store = store
        self._ownership = ownership
        self._topics = topics
        self._interval = interval
        self._writer = ClockWriter(ownership)
        #: topic -> (epoch, marks not yet covered, oldest first)
        self._marks: dict[str, tuple[int, list[ClockMark]]] = {}
        self.passes = 0
        """Passes completed (for tests and ``status``)."""
        self.writes = 0
        """Clock keys written since the start."""

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.run_once()
            except (DanubeIngestError, MetadataError, OSError) as exc:
                log.warning("clock pass failed (next in %.1fs) error=%s", self._interval, exc)
            except Exception:
                # A bug, not an outage: say so loudly, but keep the clocks moving next time.
                log.exception("clock pass failed unexpectedly (next in %.1fs)", self._interval)

    async def run_once(self) -> None:
        """One pass: mark every served reliable topic, write the covered marks."""
        names = list(dict.fromkeys(self._topics()))
        made = await asyncio.gather(*(self._mark(t) for t in names))
        current = {t: m.epoch for t, m in zip(names, made, strict=True) if m is not None}
        for topic in list(self._marks):
            if self._marks[topic][0] != current.get(topic):
                del self._marks[topic]
                self._writer.forget(topic)
        for topic, new in zip(names, made, strict=True):
            if new is None:
                continue
            _, marks = self._marks.setdefault(topic, (new.epoch, []))
            if marks and marks[-1].offset == new.offset:
                marks[-1] = new  # same offsets covered, a later time: strictly better
            else:
                marks.append(new)
                del marks[:-MAX_MARKS]
        ready: dict[str, ClockMark] = {}
        for topic, (_, marks) in self._marks.items():
            covered = -1
            for i, mark in enumerate(marks):
                if self._store.uploaded_below(topic, mark.offset):
                    covered = i
            if covered >= 0:
                ready[topic] = marks[covered]
                del marks[: covered + 1]
        if ready:
            result = await self._writer.advance(ready)
            self.writes += result.writes
            for topic in result.fenced:
                self._marks.pop(topic, None)
            for topic, clock in result.stored.items():
                log.debug(
                    "clock advanced topic=%s offset=%d ingest_ms=%d epoch=%d",
                    topic,
                    clock.offset,
                    clock.ingest_ms,
                    clock.epoch,
                )
        self.passes += 1

    async def _mark(self, topic: str) -> ClockMark | None:
        """A durable time marker of ``topic`` with the epoch it was made under (None if the
        topic is not owned here). The epoch is read in the same step as the marker is staged."""
        owner = self._ownership.owned(topic)
        if owner is None:
            return None
        mark = await self._store.advance_time(topic)
        return ClockMark(mark.offset, mark.ingest_ms, owner.epoch)


__all__ = ["MAX_MARKS", "ClockKeeper"]
