"""``OffsetReservation``: offsets are never reused across owners.

``topics/{ns}/{topic}/offsets`` = ``{"reserved": N, "broker": id, "wal_id": W}`` means offsets
below ``N`` may have been assigned by some owner, ``id`` made the last reservation, and ``W``
identifies the WAL it wrote them to (``datadir.data_dir_id`` of its WAL directory; absent in
reservations written before it was recorded, or without a durable WAL). Before assigning an
offset at or past ``N``, the owner raises ``N`` by a block in a fenced transaction; a new owner
starts at the stored ``N``. A takeover may therefore leave a gap of up to a block, never a
duplicate, unless the new owner waits for the previous owner's exact end
(``metadata.handover``) and continues there (``adopt``). A broker that re-acquires a topic
whose last reservation is its own (a restart, with nobody assigning offsets in between)
continues from its own WAL instead: no gap.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

from danube_ingest.metadata.errors import FencedError, MetadataError
from danube_ingest.metadata.kv import Compare, Get, KeyValue, Put, TxnOp
from danube_ingest.metadata.ownership import Owner, Ownership

#: One fenced transaction per this many offsets; also the largest gap a takeover leaves.
DEFAULT_BLOCK = 10_000
#: Conflicts tolerated in a row: under fencing only a stale read can cause one.
_ATTEMPTS = 3


@dataclass
class _Reserved:
    epoch: int
    """The acquisition this reservation was made (or read) under."""
    reserved: int
    stored: KeyValue | None
    broker: str | None
    """The broker that made the stored reservation (None: unknown or none)."""
    wal_id: str | None = None
    """The identity of the WAL that broker wrote to (None: unknown)."""


class OffsetReservation:
    """Offset reservations of the topics one ``Ownership`` holds. Use from one event loop.

    Nothing is carried over from one acquisition of a topic to the next: state cached under
    one epoch is re-read under another.
    """

    def __init__(
        self, ownership: Ownership, *, block: int = DEFAULT_BLOCK, wal_id: str | None = None
    ) -> None:
        """``wal_id``: the identity of this broker's WAL directory, stored with every
        reservation it makes (None: not recorded, e.g. a WAL in memory)."""
        if block < 1:
            raise MetadataError(f"offset reservation block must be at least 1, got {block}")
        self._ownership = ownership
        self.block = block
        self.wal_id = wal_id
        self._cache: dict[str, _Reserved] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        ownership.on_lost(self._forget)

    async def start_offset(self, topic: str, local_next: int | None = None) -> int:
        """The first offset this owner may assign.

        ``local_next`` is the next offset of the topic in this broker's own WAL (None when the
        WAL does not know the topic). When the last reservation is this broker's own, nobody
        else assigned offsets since, and ``local_next`` is returned; otherwise the stored
        reservation (0 if none). The owner must start at ``max(start_offset, its next
        offset)``. Raises ``FencedError`` if this broker does not own the topic.
        """
        entry = await self._read(topic, self._owner(topic).epoch)
        self._cache[topic] = entry
        if local_next is not None and entry.broker == self._ownership.session.broker_id:
            return local_next
        return entry.reserved

    def previous(self, topic: str) -> tuple[int, str | None]:
        """(reserved end, broker that reserved it) as ``start_offset`` read it (no I/O);
        ``(0, None)`` before ``start_offset`` or without a stored reservation."""
        entry = self._cache.get(topic)
        return (0, None) if entry is None else (entry.reserved, entry.broker)

    def previous_wal_id(self, topic: str) -> str | None:
        """The WAL identity stored with the reservation ``previous`` describes (no I/O; None:
        not recorded)."""
        entry = self._cache.get(topic)
        return None if entry is None else entry.wal_id

    async def adopt(self, topic: str, next_offset: int) -> None:
        """Make the stored reservation this broker's, at least ``next_offset``, after a
        takeover was resolved (``metadata.handover``): a later acquisition by this broker then
        continues from its own WAL, and nobody waits for the previous broker again. Raises
        ``FencedError`` if this broker does not own the topic."""
        async with self._locks.setdefault(topic, asyncio.Lock()):
            epoch = self._owner(topic).epoch
            entry = self._cache.get(topic)
            if entry is None or entry.epoch != epoch:
                entry = await self._read(topic, epoch)
            broker = self._ownership.session.broker_id
            reserved = max(entry.reserved, next_offset)
            key = self._ownership.keys.topic_offsets(topic)
            value = self._value(reserved, broker)
            result = await self._ownership.fenced(topic, [Put(key, value), Get(key)])
            self._cache[topic] = _Reserved(epoch, reserved, result.kv(1), broker, self.wal_id)

    def covered(self, topic: str, next_offset: int) -> bool:
        """Whether every offset below ``next_offset`` is reserved by this owner (no I/O)."""
        owner = self._ownership.owned(topic)
        entry = self._cache.get(topic)
        return (
            owner is not None
            and entry is not None
            and entry.epoch == owner.epoch
            and next_offset <= entry.reserved
        )

    async def ensure(self, topic: str, next_offset: int) -> int:
        """Make sure every offset below ``next_offset`` is reserved by this owner.

        Returns the reservation. No I/O when already covered; otherwise raises it to at least
        ``next_offset + block`` in one fenced transaction. Raises ``FencedError`` if this broker
        does not own the topic: assign nothing then.
        """
        if self.covered(topic, next_offset):
            return self._cache[topic].reserved
        async with self._locks.setdefault(topic, asyncio.Lock()):
            epoch = self._owner(topic).epoch
            key = self._ownership.keys.topic_offsets(topic)
            entry = self._cache.get(topic)
            for _ in range(_ATTEMPTS):
                if entry is None or entry.epoch != epoch:
                    entry = await self._read(topic, epoch)
                if next_offset <= entry.reserved:
                    self._cache[topic] = entry
                    return entry.reserved
                reserved = max(next_offset, entry.reserved) + self.block
                broker = self._ownership.session.broker_id
                value = self._value(reserved, broker)
                result = await self._ownership.fenced(
                    topic,
                    [Put(key, value), Get(key)],
                    compares=[Compare.unchanged(key, entry.stored)],
                )
                if result.succeeded:
                    self._cache[topic] = _Reserved(
                        epoch, reserved, result.kv(1), broker, self.wal_id
                    )
                    return reserved
                entry = None  # changed since read: read again
            raise MetadataError(f"the offset reservation of {topic} kept changing under its owner")

    async def hand_over(self, topic: str, next_offset: int, also: Sequence[TxnOp] = ()) -> None:
        """Set the reservation to exactly ``next_offset`` before the topic is released, so
        the next owner continues there with no gap (an unload), with ``also`` (what else is
        handed over, e.g. the producer table) in the same fenced transaction.

        The caller guarantees that no offset at or past ``next_offset`` was assigned. Any later
        assignment by this broker must reserve again (fenced: after the release it fails), so
        the next owner never reuses an offset. Raises ``FencedError`` if this broker does not
        own the topic.
        """
        async with self._locks.setdefault(topic, asyncio.Lock()):
            epoch = self._owner(topic).epoch
            broker = self._ownership.session.broker_id
            key = self._ownership.keys.topic_offsets(topic)
            await self._ownership.fenced(topic, [Put(key, self._value(next_offset, broker)), *also])
            self._cache[topic] = _Reserved(epoch, next_offset, None, broker, self.wal_id)

    def _value(self, reserved: int, broker: str) -> bytes:
        doc: dict[str, object] = {"reserved": reserved, "broker": broker}
        if self.wal_id is not None:
            doc["wal_id"] = self.wal_id
        return json.dumps(doc).encode()

    def _owner(self, topic: str) -> Owner:
        owner = self._ownership.owned(topic)
        if owner is None:
            raise FencedError(topic, f"cannot reserve offsets of {topic}: not its owner")
        return owner

    async def _read(self, topic: str, epoch: int) -> _Reserved:
        key = self._ownership.keys.topic_offsets(topic)
        stored = await self._ownership.kv.get(key)
        if stored is None:
            return _Reserved(epoch, 0, None, None)
        try:
            doc = json.loads(stored.value)
            reserved = int(doc["reserved"])
            broker = doc.get("broker")
            wal_id = doc.get("wal_id")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise MetadataError(f"malformed offset reservation at {key}: {stored.value!r}") from exc
        return _Reserved(
            epoch,
            reserved,
            stored,
            broker if isinstance(broker, str) else None,
            wal_id if isinstance(wal_id, str) else None,
        )

    def _forget(self, topic: str) -> None:
        self._cache.pop(topic, None)
