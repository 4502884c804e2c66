"""Recorded offset jumps: where an owner skipped offsets, so a manifest gap can be told apart
from a lost range.

``storage/topics/{ns}/{topic}/jumps/{from:020}`` = JSON ``OffsetJump`` ``{from, to, epoch,
broker, reason, at_ms}`` says: offsets ``[from, to)`` were never assigned by the owner of
``epoch`` (broker ``broker``), which continued the topic at ``to``; ``from`` was the end of what
it knew to exist (the manifest's end and its own WAL's next offset). Earlier owners may have
assigned some of those offsets and not uploaded them yet (a takeover from a broker that died
with segments not uploaded): the record names the interval such ranges would fill.

Where jumps come from: a broker that acquires a topic continues at ``max(reservation,
manifest end)`` (``metadata.offsets``), which lies past what it knows when the last
reservation was another broker's (a takeover) or its WAL no longer knows the topic. That is
the only place offsets are skipped: entries are checked before they get an offset and a WAL
that fails to frame or write an assigned offset stops assigning any (``wal.log``), so a
restart reuses those offsets.

Guarantees:

* ``record_jump`` writes the record fenced by the owner's epoch (``Ownership.fenced``) and
  returns only once it is in etcd: the caller assigns no offset at or above ``from`` before,
  so a jump is recorded before any offset past it exists. One write per acquisition that
  jumps, none per append.
* Writing the same jump again (a retried load) overwrites the record with the same interval.
* Records are small and rare (one per takeover); topic deletion removes them with the rest of
  ``storage/topics/{ns}/{topic}/``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Put
from danube_ingest.metadata.ownership import Ownership

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffsetJump:
    """Offsets ``[start, end)`` of ``topic`` were never assigned by the owner of ``epoch``."""

    topic: str
    start: int
    """The end of what the owner knew to exist (stored as ``from``)."""
    end: int
    """Where the owner continued (stored as ``to``)."""
    epoch: int
    broker: str
    reason: str
    """Why the owner jumped: ``"reservation"`` (it continued from the offset reservation)."""
    at_ms: int
    """When it was recorded (ms since the epoch)."""

    def encode(self) -> bytes:
        doc = {
            "from": self.start,
            "to": self.end,
            "epoch": self.epoch,
            "broker": self.broker,
            "reason": self.reason,
            "at_ms": self.at_ms,
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, topic: str, data: bytes, key: str) -> OffsetJump:
        """Parse a record stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            jump = cls(
                topic=topic,
                start=raw["from"],
                end=raw["to"],
                epoch=raw["epoch"],
                broker=raw["broker"],
                reason=raw["reason"],
                at_ms=raw["at_ms"],
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed offset jump at {key}: {exc}") from exc
        if not all(isinstance(v, int) for v in (jump.start, jump.end, jump.epoch, jump.at_ms)):
            raise MetadataError(f"malformed offset jump at {key}: wrong field types")
        if not 0 <= jump.start < jump.end:
            raise MetadataError(f"malformed offset jump at {key}: from must be below to")
        return jump


async def record_jump(
    ownership: Ownership, topic: str, start: int, end: int, *, reason: str = "reservation"
) -> OffsetJump | None:
    """Record that this owner skips offsets ``[start, end)`` of ``topic``; nothing when
    ``end <= start`` (no jump). Fenced by the owner's epoch: raises ``FencedError`` (nothing
    written) if this broker does not own the topic; assign no offset then."""
    if end <= start:
        return None
    owner = ownership.owned(topic)
    epoch = 0 if owner is None else owner.epoch  # not owned: fenced() raises below
    jump = OffsetJump(
        topic=topic,
        start=start,
        end=end,
        epoch=epoch,
        broker=ownership.session.broker_id,
        reason=reason,
        at_ms=int(time.time() * 1000),
    )
    await ownership.fenced(topic, [Put(ownership.keys.storage_jump(topic, start), jump.encode())])
    log.info(
        "offset jump recorded topic=%s from=%d to=%d epoch=%d broker=%s reason=%s",
        topic,
        start,
        end,
        epoch,
        jump.broker,
        reason,
    )
    return jump


async def read_jumps(kv: KV, keys: Keys, topic: str) -> list[OffsetJump]:
    """The topic's recorded jumps, in ``start`` order (one prefix read)."""
    head = keys.storage_jumps_prefix(topic)
    found = [OffsetJump.decode(topic, s.value, s.key) for s in await kv.get_prefix(head)]
    return sorted(found, key=lambda j: (j.start, j.end))


def uncovered(start: int, end: int, jumps: Sequence[OffsetJump]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` that no jump covers, in order (empty: fully covered)."""
    left: list[tuple[int, int]] = []
    position = start
    for jump in sorted(jumps, key=lambda j: j.start):
        if jump.end <= position:
            continue
        if jump.start >= end:
            break
        if jump.start > position:
            left.append((position, jump.start))
        position = max(position, jump.end)
        if position >= end:
            return left
    if position < end:
        left.append((position, end))
    return left


__all__ = ["OffsetJump", "read_jumps", "record_jump", "uncovered"]
