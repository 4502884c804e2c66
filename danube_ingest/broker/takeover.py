"""The new owner's side of a takeover: serve a topic only from a known durable end.

``TakeoverGate.check`` runs when a reliable topic is loaded (``TopicManager``), after the offset
reservation was read and before any offset is assigned. When the last reservation was another
broker's and the manifest ends below it, that broker may hold acknowledged entries it never
uploaded; the gate records a pending takeover (``metadata.handover``) and raises
``TakeoverPendingError`` (gRPC ``UNAVAILABLE``, retriable) until the record is resolved:

* recovered: the previous broker, restarted on the WAL it wrote the tail to, committed its tail;
  the owner continues at the manifest's end (no gap, no recorded jump);
* lost (``danube-ingest brokers forget``, before or during the wait, or the previous broker
  restarted on another WAL, its data directory wiped): the owner continues at the reservation;
  the jump over the lost range was recorded with the resolution, and it is counted in
  ``danube_ingest_takeover_lost_offsets``.

Without an object store (``local_only``) a new owner reads nothing the old one stored anyway,
and the gate is not used.
"""

from __future__ import annotations

import logging
import time

from danube_ingest.broker.errors import TakeoverPendingError
from danube_ingest.metadata.handover import (
    LOST,
    PENDING,
    Handover,
    begin_handover,
    declare_lost,
    is_forgotten,
    read_handover,
)
from danube_ingest.metadata.offsets import OffsetReservation
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.observability.metrics import TAKEOVER_LOST_OFFSETS, TAKEOVER_WAIT_SECONDS

log = logging.getLogger(__name__)


class TakeoverGate:
    """Decides where a new owner may continue a topic. Use from one event loop."""

    def __init__(self, ownership: Ownership, reservations: OffsetReservation) -> None:
        self._ownership = ownership
        self._reservations = reservations
        #: topic -> when this broker began waiting (monotonic), for the wait histogram
        self._waiting: dict[str, float] = {}

    async def check(self, topic: str, manifest_end: int) -> Handover | None:
        """None when nothing is awaited (the reservation is this broker's, or the manifest
        reaches it); a resolved ``Handover`` whose ``end`` is where to continue. Raises
        ``TakeoverPendingError`` while the previous owner's tail is awaited (after recording
        the wait, fenced by this owner's epoch), ``FencedError`` if the topic is not owned here.
        Call after ``OffsetReservation.start_offset``; after continuing at a resolved record's
        end, call ``OffsetReservation.adopt``.
        """
        reserved, previous = self._reservations.previous(topic)
        if previous is None or previous == self._ownership.session.broker_id:
            return None
        if manifest_end >= reserved:
            return None
        kv, keys = self._ownership.kv, self._ownership.keys
        found = await read_handover(kv, keys, topic)
        if found is None or not found[0].concerns(previous, reserved):
            found = await begin_handover(
                self._ownership,
                topic,
                previous=previous,
                committed=manifest_end,
                reserved=reserved,
                previous_wal_id=self._reservations.previous_wal_id(topic),
            )
        record = found[0]
        # Declared lost before this takeover began (and not back): skip its tail as
        # ``brokers forget`` would have.
        if (
            record.state == PENDING
            and await is_forgotten(kv, keys, previous)
            and await kv.get(keys.broker(previous)) is None
        ):
            record = await declare_lost(kv, keys, found[1], previous) or record
        if record.state == PENDING:
            self._waiting.setdefault(topic, time.monotonic())
            raise TakeoverPendingError(topic, previous, record.committed, record.reserved)
        began = self._waiting.pop(topic, None)
        waited = 0.0 if began is None else time.monotonic() - began
        if began is not None:
            TAKEOVER_WAIT_SECONDS.observe(waited)
        if record.state == LOST:
            TAKEOVER_LOST_OFFSETS.inc(record.lost_offsets)
        log.info(
            "takeover resolved topic=%s previous=%s state=%s end=%s committed=%d reserved=%d "
            "waited_s=%.2f",
            topic,
            previous,
            record.state,
            record.end,
            record.committed,
            record.reserved,
            waited,
        )
        return record
