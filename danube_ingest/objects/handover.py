"""The previous owner's side of a takeover: hand the new owner its unuploaded tail.

A broker that lost a topic (it crashed and restarted, or was paused past its lease) may hold
acknowledged entries of it in its local WAL that it never uploaded; the topic's new owner waits
for them (``metadata.handover``, ``broker.takeover``). ``TailHandover`` runs in every broker
with an uploader. For each pending takeover record that names this broker as the previous
owner, it

1. seals the topic's active WAL segment (once per tail) and queues the segments whose ranges
   of the topic were orphaned, so the uploader stores them again;
2. commits those ranges into the manifest under the record (``commit_tail``: the uploader
   calls ``commit_orphans`` for every range it could not commit because the topic is owned
   elsewhere), comparing the record's exact value;
3. once every entry of the topic in the WAL is committed, resolves the record as recovered
   at the manifest's end (``resolve_recovered``), where the new owner continues, writing in
   the same transaction this broker's idempotent producer table of the topic for the new
   owner (``metadata.producers``).

A record naming another WAL than this broker's (``wal_id``: its data directory was wiped or
replaced since it wrote the tail) is resolved as **lost** instead (``declare_lost``: a recorded
jump over ``[committed, reserved)``): the acknowledged tail is gone with the old WAL, and
resolving it as recovered at the manifest's end would let the new owner reuse offsets that were
acknowledged. On the WAL the record names, a WAL with no entry of the topic (its tail was
uploaded and the segments retired) proves the manifest holds every acknowledged entry: that
is recovered at the manifest's end. A record without a WAL identity (written before it was
recorded) is treated as this WAL's.

It looks at start (a restart), when this broker loses a topic, and every ``interval`` seconds
(a record written while this broker was away or paused). A record declared lost
(``brokers forget``) is left alone: the ranges stay in the local WAL, never committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from danube_ingest.aio import BackgroundLoop, wait_event
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.handover import (
    PENDING,
    Handover,
    clear_forgotten,
    commit_tail,
    declare_lost,
    list_handovers,
    read_handover,
    resolve_recovered,
)
from danube_ingest.metadata.kv import TxnOp
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.metadata.producers import HandedProducers, handover_ops
from danube_ingest.objects.uploader import SegmentUploader
from danube_ingest.store.topic_store import TopicStore

log = logging.getLogger(__name__)

#: Seconds between looks for takeover records naming this broker: a new owner waits (its
#: clients get UNAVAILABLE) for up to this long after this broker is back before it is noticed.
HANDOVER_CHECK_SECONDS = 1.0


class TailHandover(BackgroundLoop):
    """Recovers this broker's orphaned tails for their topics' new owners (see the module
    docstring). Use from the store's event loop."""

    task_name = "tail-handover"

    def __init__(
        self,
        store: TopicStore,
        uploader: SegmentUploader,
        manifest: Manifest,
        ownership: Ownership,
        *,
        interval: float = HANDOVER_CHECK_SECONDS,
        wal_id: str | None = None,
    ) -> None:
        """``wal_id``: the identity of this broker's WAL directory (``datadir.data_dir_id``);
        None: unknown, every record is treated as this WAL's."""
        super().__init__()
        self._store = store
        self._uploader = uploader
        self._manifest = manifest
        self._ownership = ownership
        self._broker_id = ownership.session.broker_id
        self._interval = interval
        self._wal_id = wal_id
        self._wakeup = asyncio.Event()
        #: topic -> the next offset its WAL tail was sealed at (sealed once per tail)
        self._sealed: dict[str, int] = {}
        uploader.set_orphan_committer(self.commit_orphans)
        ownership.on_lost(lambda _topic: self._wakeup.set())

    async def commit_orphans(self, ranges: Sequence[ObjectRange]) -> set[str]:
        """Commit ranges of topics owned elsewhere under their pending takeover records;
        returns the topics whose ranges are now all in the manifest."""
        by_topic: dict[str, list[ObjectRange]] = {}
        for rng in ranges:
            by_topic.setdefault(rng.topic, []).append(rng)
        done: set[str] = set()
        for topic, entries in by_topic.items():
            found = await read_handover(self._manifest.kv, self._manifest.keys, topic)
            if found is None:
                continue
            if await commit_tail(self._manifest, found[1], entries, self._broker_id):
                done.add(topic)
        return done

    async def run_once(self) -> list[str]:
        """One look at the takeover records; returns the topics resolved now."""
        resolved: list[str] = []
        kv, keys = self._manifest.kv, self._manifest.keys
        for record, stored in await list_handovers(kv, keys):
            topic = record.topic
            if record.state != PENDING or record.previous != self._broker_id:
                continue
            if self._ownership.is_owner(topic):
                continue  # this broker holds it again: its own reservation, nothing to hand
            if self._wal_id is not None and record.previous_wal_id not in (None, self._wal_id):
                if await declare_lost(kv, keys, stored, self._broker_id) is not None:
                    log.warning(
                        "takeover resolved: tail lost with the previous WAL topic=%s from=%d "
                        "to=%d wal_id=%s previous_wal_id=%s (this broker started on another "
                        "data directory)",
                        topic,
                        record.committed,
                        record.reserved,
                        self._wal_id,
                        record.previous_wal_id,
                    )
                    resolved.append(topic)
                continue
            info = self._store.info(topic)
            local_end = 0 if info is None else info.next_offset
            if local_end > record.committed and not self._store.uploaded_below(topic, local_end):
                # Older segments first: the uploader commits in queue order, and a range that
                # does not continue the manifest waits for the next round.
                self._uploader.retry_orphans(topic)
                if self._sealed.get(topic) != local_end:
                    self._sealed[topic] = self._store.seal(topic)
                    log.info(
                        "handing the unuploaded tail to the new owner topic=%s from=%d to=%d "
                        "owner=%s",
                        topic,
                        record.committed,
                        local_end,
                        record.owner,
                    )
                continue
            end = await self._manifest.end_offset(topic)
            if end < local_end:
                log.error(
                    "tail not handed over: the manifest ends at %d below this WAL's %d "
                    "topic=%s (left in the local WAL)",
                    end,
                    local_end,
                    topic,
                )
                continue
            if await resolve_recovered(self._manifest, stored, self._table_for(topic)) is not None:
                self._sealed.pop(topic, None)
                resolved.append(topic)
        return resolved

    def _table_for(self, topic: str) -> Callable[[Handover], list[TxnOp]]:
        """The ops handing this broker's producer table of ``topic`` over with its recovered
        tail (in the transaction resolving the record; ``metadata.producers``)."""

        def ops(done: Handover) -> list[TxnOp]:
            end = done.end if done.end is not None else done.committed
            table = self._store.producer_table(topic, end)
            handed = HandedProducers(end, done.epoch, self._broker_id, table)
            return handover_ops(self._manifest.keys, topic, handed)

        return ops

    async def _run(self) -> None:
        started = False
        while True:
            if not started:
                try:
                    # Back: takeovers from this broker wait for its tails again.
                    await clear_forgotten(self._manifest.kv, self._manifest.keys, self._broker_id)
                    started = True
                except DanubeIngestError as exc:
                    log.warning("forgotten mark not cleared (will retry) error=%s", exc)
            try:
                await self.run_once()
            except DanubeIngestError as exc:
                log.warning("takeover records not checked (will retry) error=%s", exc)
            self._wakeup.clear()
            await wait_event(self._wakeup, self._interval)


__all__ = ["HANDOVER_CHECK_SECONDS", "TailHandover"]
