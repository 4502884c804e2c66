"""Takeover records: a new owner serves a topic only from a known durable end.

When a broker acquires a topic whose last offset reservation was another broker's and the
manifest ends below that reservation, the previous owner may hold acknowledged entries that
it never uploaded (they are in its local WAL). The new owner then writes a takeover record and
serves nothing of the topic until the record is resolved:

``handovers/{ns}/{topic}`` = JSON ``Handover``::

    {"previous": broker id whose tail is awaited, "reserved": its reservation's end,
     "previous_wal_id": the identity of the WAL it wrote that tail to (null: not recorded),
     "committed": the manifest's end when the wait began, "owner": the waiting broker,
     "epoch": its ownership epoch, "state": "pending" | "recovered" | "lost",
     "end": where the new owner continues (resolved records), "at_ms": last change}

A record is resolved exactly once, by one of:

* **recovered** (``commit_tail`` then ``resolve_recovered``): the previous broker, restarted or
  woken, commits its orphaned ranges into the manifest in transactions that compare the
  pending record's exact value, then sets ``end`` to the manifest's end. The new owner continues
  there: no gap, every acknowledged entry readable. Only a broker on the WAL the record names
  may do this: a WAL that holds no entry of the topic then proves every acknowledged one was
  committed (its segments are deleted only after their ranges are).
* **lost** (``forget_broker``, the operator's ``danube-ingest brokers forget ID``, or
  ``declare_lost`` by a new owner for a takeover that begins after it): one transaction per
  record, comparing its value, marks it lost with ``end = reserved`` and writes a recorded jump
  ``[committed, reserved)`` with reason ``"lost"`` (``metadata.jumps``). After that the
  previous broker's ``commit_tail`` compares a changed record and commits nothing. The
  previous broker itself declares its tail lost (``declare_lost``) when it starts on another
  WAL than the record names (its data directory was wiped or replaced): the acknowledged tail
  is gone, and resolving at the manifest's end would let the new owner reuse its offsets.

A record concerns one takeover: ``(previous, reserved)``. A later takeover (another
previous broker or reservation) replaces it. Records are tiny and kept after resolution (a lost
one is what ``status`` and ``brokers list`` show); deleting a topic removes its record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.jumps import OffsetJump
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Delete, Get, KeyValue, Put, TxnOp
from danube_ingest.metadata.manifest import Manifest, ObjectRange, covered
from danube_ingest.metadata.ownership import Ownership

log = logging.getLogger(__name__)


class BrokerAliveError(MetadataError):
    """``forget_broker`` was asked to declare a live broker's tails lost: stop it first (or let
    it hand its tails over, which it does by itself while alive)."""


State = Literal["pending", "recovered", "lost"]
PENDING: State = "pending"
RECOVERED: State = "recovered"
LOST: State = "lost"


@dataclass(frozen=True, slots=True)
class Handover:
    """One topic's takeover: what its new owner waits for, or how the wait ended."""

    topic: str
    previous: str
    """The broker whose unuploaded tail is awaited."""
    reserved: int
    """The end of the previous broker's offset reservation: it assigned nothing at or past it."""
    committed: int
    """The manifest's end when the wait began: everything below it is readable."""
    owner: str
    """The broker that began the wait."""
    epoch: int
    """Its ownership epoch (the previous broker's ranges are committed under it)."""
    state: State = PENDING
    end: int | None = None
    """Resolved: where the new owner continues (recovered: the manifest's exact end)."""
    at_ms: int = 0
    previous_wal_id: str | None = None
    """The identity of the WAL the previous broker wrote its tail to (from its reservation;
    None: not recorded). Only a broker on that WAL can recover the tail."""

    def concerns(self, previous: str, reserved: int) -> bool:
        """Whether this record is the takeover from ``previous``'s reservation ``reserved``."""
        return self.previous == previous and self.reserved == reserved

    @property
    def lost_offsets(self) -> int:
        """How many offsets a lost record skips (an upper bound of the lost entries)."""
        return self.reserved - self.committed if self.state == LOST else 0

    def encode(self) -> bytes:
        doc = dataclasses.asdict(self)
        del doc["topic"]
        if self.previous_wal_id is None:
            del doc["previous_wal_id"]  # as records were before it was recorded
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, topic: str, data: bytes, key: str) -> Handover:
        """Parse a record stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            record = cls(topic=topic, **raw)
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"malformed takeover record at {key}: {exc}") from exc
        texts = (record.previous, record.owner)
        numbers = (record.reserved, record.committed, record.epoch, record.at_ms)
        if (
            not all(isinstance(t, str) for t in texts)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
            or not (record.end is None or (isinstance(record.end, int) and record.end >= 0))
            or not (record.previous_wal_id is None or isinstance(record.previous_wal_id, str))
            or record.state not in (PENDING, RECOVERED, LOST)
            or not (0 <= record.committed < record.reserved)
        ):
            raise MetadataError(f"malformed takeover record at {key}: {data!r}")
        return record


def _topic_of(keys: Keys, key: str) -> str:
    return "/" + key.removeprefix(keys.handovers_prefix())


async def read_handover(kv: KV, keys: Keys, topic: str) -> tuple[Handover, KeyValue] | None:
    """The topic's takeover record and its stored key-value (None: there is none)."""
    stored = await kv.get(keys.handover(topic))
    if stored is None:
        return None
    return Handover.decode(topic, stored.value, stored.key), stored


async def list_handovers(kv: KV, keys: Keys) -> list[tuple[Handover, KeyValue]]:
    """Every topic's takeover record, in topic order (one prefix read)."""
    stored = await kv.get_prefix(keys.handovers_prefix())
    return [(Handover.decode(_topic_of(keys, s.key), s.value, s.key), s) for s in stored]


async def begin_handover(
    ownership: Ownership,
    topic: str,
    *,
    previous: str,
    committed: int,
    reserved: int,
    previous_wal_id: str | None = None,
) -> tuple[Handover, KeyValue]:
    """Record that this owner waits for ``previous``'s tail ``[committed, reserved)``, written
    to the WAL ``previous_wal_id`` (None: not known).

    Fenced by the owner's epoch (``FencedError``: nothing written). Replaces a record of an
    earlier takeover.
    """
    owner = ownership.owned(topic)
    record = Handover(
        topic=topic,
        previous=previous,
        reserved=reserved,
        committed=committed,
        owner=ownership.session.broker_id,
        epoch=0 if owner is None else owner.epoch,  # not owned: fenced() raises below
        at_ms=_now_ms(),
        previous_wal_id=previous_wal_id,
    )
    key = ownership.keys.handover(topic)
    result = await ownership.fenced(topic, [Put(key, record.encode()), Get(key)])
    stored = result.kv(1)
    assert stored is not None  # read in the transaction that wrote it
    log.warning(
        "takeover waits for the previous owner's tail topic=%s previous=%s committed=%d "
        "reserved=%d epoch=%d (serving resumes once it restarts and uploads it, or after "
        "'danube-ingest brokers forget %s')",
        topic,
        previous,
        committed,
        reserved,
        record.epoch,
        previous,
    )
    return record, stored


async def commit_tail(
    manifest: Manifest, stored: KeyValue, ranges: Sequence[ObjectRange], broker_id: str
) -> bool:
    """Commit ``broker_id``'s orphaned ranges under the pending takeover record ``stored``
    (as read from etcd).

    Returns True once every range is in the manifest (now or before); False if the record is
    not this broker's pending takeover any more (changed, resolved, or declared lost), or the
    ranges do not continue the manifest without a gap: nothing is written then. The
    transaction compares the record's exact value, so it cannot race ``forget_broker`` or a
    later takeover.
    """
    record = Handover.decode(_topic_of(manifest.keys, stored.key), stored.value, stored.key)
    if record.state != PENDING or record.previous != broker_id:
        return False
    todo = []
    for rng in sorted(ranges, key=lambda r: r.start_offset):
        existing = await manifest.ranges(rng.topic, rng.start_offset)
        if existing and covered(rng, existing):
            continue
        todo.append(dataclasses.replace(rng, broker=broker_id, epoch=record.epoch))
    if not todo:
        return True
    end = await manifest.end_offset(record.topic)
    position = end
    for rng in todo:
        if rng.start_offset != position or rng.start_offset < record.committed:
            # Usually an earlier orphaned range is queued behind this one: tried again next round.
            log.warning(
                "orphaned tail does not continue the manifest topic=%s range=%s manifest_end=%d "
                "(kept in the local WAL for now)",
                record.topic,
                rng.span(),
                end,
            )
            return False
        position = rng.end_offset
    if position > record.reserved:
        return False
    keys = [manifest.key(r) for r in todo]
    result = await manifest.kv.txn(
        [Compare.value_is(stored.key, stored.value), *(Compare.absent(k) for k in keys)],
        [Put(k, r.encode()) for k, r in zip(keys, todo, strict=True)],
    )
    if result.succeeded:
        log.info(
            "orphaned tail committed for the new owner topic=%s from=%d to=%d ranges=%d",
            record.topic,
            todo[0].start_offset,
            position,
            len(todo),
        )
    return result.succeeded


async def resolve_recovered(
    manifest: Manifest, stored: KeyValue, also: Callable[[Handover], Sequence[TxnOp]] | None = None
) -> Handover | None:
    """Mark the pending takeover record ``stored`` (as read from etcd) recovered at the
    manifest's end (what the previous broker committed of its tail); the new owner continues
    there. None if the record changed since it was read, or is not pending.

    ``also`` gives, for the resolved record, more ops written in the same transaction (the
    previous broker's producer table for the new owner, ``metadata.producers``)."""
    record = Handover.decode(_topic_of(manifest.keys, stored.key), stored.value, stored.key)
    if record.state != PENDING:
        return None
    end = await manifest.end_offset(record.topic)
    if not record.committed <= end <= record.reserved:
        raise MetadataError(
            f"cannot resolve the takeover of {record.topic}: the manifest ends at {end}, "
            f"outside the awaited range [{record.committed}, {record.reserved}]"
        )
    done = dataclasses.replace(record, state=RECOVERED, end=end, at_ms=_now_ms())
    extra = [] if also is None else list(also(done))
    result = await manifest.kv.txn(
        [Compare.value_is(stored.key, stored.value)], [Put(stored.key, done.encode()), *extra]
    )
    if not result.succeeded:
        return None
    log.info(
        "takeover resolved: tail recovered topic=%s previous=%s end=%d recovered=%d",
        record.topic,
        record.previous,
        end,
        end - record.committed,
    )
    return done


async def forget_broker(kv: KV, keys: Keys, broker_id: str) -> list[Handover]:
    """Declare ``broker_id``'s unuploaded tails lost: resolve every pending takeover waiting on
    it as lost and record a jump over ``[committed, reserved)`` in the same transaction.

    Returns the records resolved now. A record that changed meanwhile (its tail was just
    recovered) is read again and left if no longer pending. Also marks the broker forgotten
    (``forgotten/{id}``): a takeover from it that begins later (a topic nobody had taken over
    yet) resolves as lost at once, until the broker starts again. Idempotent. Raises
    ``BrokerAliveError`` (nothing changed) while ``broker_id`` is registered.
    """
    if await kv.get(keys.broker(broker_id)) is not None:
        raise BrokerAliveError(
            f"broker {broker_id} is alive (registered at {keys.broker(broker_id)}): it hands "
            "its unuploaded tails over by itself; forget only a broker that is gone for good"
        )
    lost: list[Handover] = []
    for _, stored in await list_handovers(kv, keys):
        done = await declare_lost(kv, keys, stored, broker_id)
        if done is not None:
            lost.append(done)
    # Takeovers that begin later (topics nobody has taken over yet) skip at once, until the
    # broker starts again (``clear_forgotten``).
    at = json.dumps({"at_ms": _now_ms()}).encode()
    await kv.txn([], [Put(keys.forgotten_broker(broker_id), at)])
    return lost


async def declare_lost(kv: KV, keys: Keys, stored: KeyValue, broker_id: str) -> Handover | None:
    """Resolve the takeover record ``stored`` as lost if it is pending on ``broker_id``, with a
    recorded jump over ``[committed, reserved)`` in the same transaction; returns the resolved
    record (None: not pending on that broker, as read again if it changed meanwhile)."""
    keyed = stored.key
    topic = _topic_of(keys, keyed)
    current: KeyValue | None = stored
    while current is not None:
        record = Handover.decode(topic, current.value, keyed)
        if record.state != PENDING or record.previous != broker_id:
            return None
        done = dataclasses.replace(record, state=LOST, end=record.reserved, at_ms=_now_ms())
        jump = OffsetJump(
            topic=topic,
            start=record.committed,
            end=record.reserved,
            epoch=record.epoch,
            broker=broker_id,
            reason="lost",
            at_ms=done.at_ms,
        )
        result = await kv.txn(
            [Compare.value_is(keyed, current.value)],
            [
                Put(keyed, done.encode()),
                Put(keys.storage_jump(topic, record.committed), jump.encode()),
            ],
        )
        if result.succeeded:
            log.warning(
                "offsets declared lost topic=%s from=%d to=%d broker=%s",
                topic,
                record.committed,
                record.reserved,
                broker_id,
            )
            return done
        current = await kv.get(keyed)
    return None


async def is_forgotten(kv: KV, keys: Keys, broker_id: str) -> bool:
    """Whether ``brokers forget`` declared ``broker_id`` lost and it has not started since."""
    return await kv.get(keys.forgotten_broker(broker_id)) is not None


async def clear_forgotten(kv: KV, keys: Keys, broker_id: str) -> None:
    """A broker that starts is no longer forgotten: later takeovers from it wait again."""
    await kv.txn([], [Delete(keys.forgotten_broker(broker_id))])


def _now_ms() -> int:
    return int(time.time() * 1000)


__all__ = [
    "LOST",
    "PENDING",
    "RECOVERED",
    "BrokerAliveError",
    "Handover",
    "begin_handover",
    "clear_forgotten",
    "commit_tail",
    "declare_lost",
    "forget_broker",
    "is_forgotten",
    "list_handovers",
    "read_handover",
    "resolve_recovered",
]
