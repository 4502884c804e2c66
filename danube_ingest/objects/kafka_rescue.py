"""A takeover that needs neither the previous owner nor an operator: its tail is read from Kafka.

With the local WAL, a new owner waiting for a dead broker's unuploaded tail
(``metadata.handover``) waits until that broker is back (``objects.handover.TailHandover``) or
an operator runs ``brokers forget``. With the WAL in Kafka (``storage.wal.backend: kafka``) the
tail is in the dead broker's region topics, so the waiting owner hands it over itself.
``KafkaTailRescue`` runs in every broker on the Kafka WAL. For each pending takeover record
this broker waits on whose previous broker is not registered (dead, or paused past its lease)
and whose WAL is in Kafka (``previous_wal_id`` = ``kafka:{prefix}{broker}``), it

1. opens each of the previous broker's regions from Kafka (``KafkaBackend.recover`` into a
   scratch cache under this broker's WAL directory). That initialises the region's
   transactional producer, which **fences the previous broker**: a paused one that wakes up
   can commit nothing more, so it acknowledges nothing this read does not see;
2. builds the ``.bin`` object of every segment holding entries of the topic at or past the
   record's ``committed`` offset, exactly as the previous broker's uploader would have (same
   key ``segments/{previous}/{region}/{seq}.bin``, stored only if absent; an object already
   there must describe the same offsets);
3. commits those ranges under the record (``commit_tail``, comparing its exact value, in the
   previous broker's name and the record's epoch), then resolves it recovered at the manifest's
   end (``resolve_recovered``) with the previous broker's idempotent producer table of the
   topic in the same transaction. The waiting owner then continues there: no gap, nothing
   acknowledged lost.

A previous broker that is registered is left to hand its tails over itself. Every step is
idempotent: a crash anywhere is repaired by the next look (the record stays pending).

What a rescue reads is what the previous broker's regions still hold in Kafka (everything not
yet uploaded and committed, plus retention), not a shared log from its start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient
from crc32c import crc32c

from danube_ingest.aio import BackgroundLoop, wait_event
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.handover import (
    PENDING,
    Handover,
    commit_tail,
    list_handovers,
    resolve_recovered,
)
from danube_ingest.metadata.kv import KeyValue, TxnOp
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.producers import HandedProducers, handover_ops
from danube_ingest.objects.binfmt import parse_object
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import (
    SegmentObject,
    build_segment_object,
    object_offsets,
    segment_key,
    segment_range,
)
from danube_ingest.wal.kafka import KafkaBackend, KafkaWal
from danube_ingest.wal.kafka.topics import ADMIN_TIMEOUT, KafkaWalError
from danube_ingest.wal.meta import TopicMeta
from danube_ingest.wal.recovery import RegionState
from danube_ingest.wal.segment import segment_path

log = logging.getLogger(__name__)

#: Seconds between looks for takeover records this broker waits on.
RESCUE_CHECK_SECONDS = 0.5


class KafkaTailRescue(BackgroundLoop):
    """Hands a dead broker's tail over from Kafka (see the module docstring). Use from the
    broker's event loop."""

    task_name = "kafka-tail-rescue"

    def __init__(
        self,
        kafka: KafkaWal,
        objects: ObjectStore,
        manifest: Manifest,
        broker_id: str,
        scratch: Path,
        *,
        codec: str,
        index_interval: int = 64 * 1024,
        interval: float = RESCUE_CHECK_SECONDS,
    ) -> None:
        super().__init__()
        self._kafka = kafka
        self._objects = objects
        self._manifest = manifest
        self._broker_id = broker_id
        self._scratch = scratch
        self._codec = codec
        self._index_interval = index_interval
        self._interval = interval
        self._wakeup = asyncio.Event()
        #: Rescues done, per topic (for tests and logs).
        self.rescued: list[Handover] = []

    def wake(self) -> None:
        """Look now (a takeover record was just written)."""
        self._wakeup.set()

    def wal_id(self, broker: str) -> str:
        """The WAL id a broker of this cluster records when its WAL is in Kafka."""
        return "kafka:" + self._base(broker)

    def _base(self, broker: str) -> str:
        return dataclasses.replace(self._kafka, wal=broker).region("r0").data.rsplit(".", 1)[0]

    async def run_once(self) -> list[str]:
        """One look at the takeover records; returns the topics resolved now."""
        kv, keys = self._manifest.kv, self._manifest.keys
        resolved = []
        for record, stored in await list_handovers(kv, keys):
            if record.state != PENDING or record.owner != self._broker_id:
                continue
            if record.previous_wal_id != self.wal_id(record.previous):
                continue  # not a WAL in this Kafka: only its broker can hand it over
            if await kv.get(keys.broker(record.previous)) is not None:
                continue  # alive: it hands its tail over itself (TailHandover)
            done = await self.rescue(record, stored)
            if done is not None:
                resolved.append(record.topic)
        return resolved

    async def rescue(self, record: Handover, stored: KeyValue) -> Handover | None:
        """Read ``record``'s tail from the previous broker's regions in Kafka, commit it, and
        resolve the record; None if the record changed meanwhile."""
        started = time.monotonic()
        previous = record.previous
        settings = dataclasses.replace(self._kafka, wal=previous)
        regions = await asyncio.to_thread(self._regions, previous)
        if not regions:
            # Its WAL id names this Kafka, yet no region of it is there (deleted by hand?):
            # resolving would skip whatever it acknowledged. Left pending for an operator.
            log.error(
                "kafka tail not found: no WAL topics of %s in Kafka (prefix %s) topic=%s",
                previous,
                self._kafka.topic_prefix,
                record.topic,
            )
            return None
        ranges: list[ObjectRange] = []
        producers: dict[int, list[tuple[int, int, int]]] = {}
        scanned = 0
        for region in regions:
            scratch = self._scratch / f"{previous}-{region}"
            backend = KafkaBackend(scratch, settings, region)
            try:
                state = await backend.recover(self._index_interval)  # fences `previous`
                scanned += sum(state.segments.values())
                built = await asyncio.to_thread(self._build, state, scratch, record, region)
                for obj in built:
                    put = await self._store(obj)
                    ranges.append(segment_range(put, record.topic, record.previous, record.epoch))
                meta = state.topics.get(record.topic)
                if meta is not None:
                    producers.update(_table(meta))
            finally:
                await backend.close()
                await asyncio.to_thread(shutil.rmtree, scratch, True)
        if ranges and not await commit_tail(self._manifest, stored, ranges, previous):
            log.warning(
                "kafka tail not committed (the record changed, or the ranges do not continue "
                "the manifest) topic=%s previous=%s",
                record.topic,
                previous,
            )
            return None
        fresh = await self._manifest.kv.get(stored.key)
        if fresh is None:
            return None
        done = await resolve_recovered(self._manifest, fresh, self._table_ops(record, producers))
        if done is None:
            return None
        self.rescued.append(done)
        log.info(
            "takeover tail read from kafka topic=%s previous=%s regions=%d scanned_bytes=%d "
            "ranges=%d end=%s seconds=%.2f",
            record.topic,
            previous,
            len(regions),
            scanned,
            len(ranges),
            done.end,
            time.monotonic() - started,
        )
        return done

    def _regions(self, broker: str) -> list[str]:
        """The previous broker's regions: its data topics in Kafka."""
        base = self._base(broker)
        admin = AdminClient(self._kafka.common())
        try:
            topics = admin.list_topics(timeout=ADMIN_TIMEOUT).topics
        except Exception as exc:
            raise KafkaWalError(f"Kafka did not list its topics: {exc}") from exc
        pattern = re.compile(re.escape(base) + r"\.(r\d+)$")
        found = sorted(m.group(1) for m in map(pattern.match, topics) if m is not None)
        return found

    def _build(
        self, state: RegionState, scratch: Path, record: Handover, region: str
    ) -> list[SegmentObject]:
        """The objects of the segments holding ``record.topic`` at or past its ``committed``
        offset, built as the previous broker's uploader builds them (blocking: run in a
        thread)."""
        meta = state.topics.get(record.topic)
        if meta is None:
            return []
        seqs = sorted({span.seq for span in meta.spans if span.last_offset >= record.committed})
        built = []
        for seq in seqs:
            data = segment_path(scratch, seq).read_bytes()
            key = segment_key(record.previous, region, seq)
            obj = build_segment_object(
                data, key=key, codec=self._codec, dropped=frozenset(state.dropped)
            )
            span = obj.footer.topics.get(record.topic)
            if span is not None and span.last_offset >= record.committed:
                built.append(obj)
        return built

    async def _store(self, obj: SegmentObject) -> SegmentObject:
        """PUT the object if absent; an object already there must hold the same offsets."""
        assert obj.data is not None
        if await self._objects.put_if_absent(obj.key, obj.data):
            return obj
        stored = await self._objects.get(obj.key)
        footer = parse_object(stored, obj.key)
        if object_offsets(footer) != object_offsets(obj.footer):
            raise KafkaWalError(
                f"object {obj.key} already holds other offsets than the Kafka WAL's segment "
                f"(stored: {object_offsets(footer)}, from kafka: {object_offsets(obj.footer)})"
            )
        return SegmentObject(obj.key, len(stored), crc32c(stored), footer, None, found=True)

    def _table_ops(
        self, record: Handover, producers: dict[int, list[tuple[int, int, int]]]
    ) -> Callable[[Handover], list[TxnOp]]:
        def ops(done: Handover) -> list[TxnOp]:
            end = done.end if done.end is not None else done.committed
            table = {
                pid: kept
                for pid, batches in producers.items()
                if (kept := [b for b in batches if b[1] + b[2] <= end])
            }
            handed = HandedProducers(end, done.epoch, record.previous, table)
            return handover_ops(self._manifest.keys, record.topic, handed)

        return ops

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except (DanubeIngestError, OSError) as exc:
                log.warning("kafka tails not rescued (will retry) error=%s", exc)
            self._wakeup.clear()
            await wait_event(self._wakeup, self._interval)


def _table(meta: TopicMeta) -> dict[int, list[tuple[int, int, int]]]:
    return {
        pid: [(b.sequence, b.base_offset, b.count) for b in batches]
        for pid, batches in meta.producers.items()
    }


__all__ = ["RESCUE_CHECK_SECONDS", "KafkaTailRescue"]
