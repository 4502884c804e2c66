"""The object manifest: which object holds which offsets of a topic.

One key per range, ``storage/topics/{ns}/{topic}/objects/{start:020}`` = ``ObjectRange`` as
compact JSON. Keys are zero-padded, so key order is offset order and one prefix read returns a
topic's whole manifest in order.

Guarantees:

* The ranges of a topic never overlap, and an entry's key is its range's start. ``commit`` and
  ``replace`` never write an overlap they can see; every read checks it again and raises
  ``ManifestConflictError`` rather than hand a reader duplicate offsets.
* ``commit`` writes a broker's ranges only while it owns their topics: each transaction
  compares every topic's owner key with this broker's value (epoch included), and stamps the
  entries with that broker and epoch. It is idempotent: a re-run finds its entries and writes
  nothing.
* ``replace`` swaps entries in one compare-and-swap, for rotation, which is not an owner.
* ``remove`` drops a topic's oldest entries in one compare-and-swap, for retention, and raises
  the topic's retained floor (``storage/topics/{ns}/{topic}/floor`` = ``TopicFloor``) in the
  same transaction: readers below the floor are moved up to it, never handed a silent gap.
* Retirement: a change that removes entries (``replace``, and any later removal) writes, in
  the same transaction, a retirement record ``storage/retired/{object key}`` =
  ``{object_key, retired_ms}`` for every object an old entry named (``retire_ops``). The
  orphan collector deletes an object no entry names only once both the object and its latest
  retirement are older than its grace period, so a reader that opened the object just before
  the change finishes with it. A record is rewritten by each later change that removes
  another entry naming the same object (a segment object holds many topics), so its time is
  never before the last reference went.

Transactions of ``commit``, one per chunk of at most ``_TXN_BUDGET`` topics + ranges::

    compares: owner(t) == this broker's value, for each topic t      (added by fenced_many)
              create(entry key) == 0, for each range
    success:  put(entry key, range), for each range
    failure:  get(entry key), for each range; get(owner(t)), for each topic t

A failed transaction thus says in the same round trip which topics were lost and which entry
keys exist; only a topic with an existing key costs one more read (its manifest).

Limit: the absent-key compare only sees an existing entry *at the same start*. An entry that
starts earlier and covers the range (after rotation merged a range into a bigger object) is
invisible to it, so rotation must only merge ranges that their owner can no longer re-commit:
ranges whose WAL segments the broker has recorded as committed (rotation takes only ranges
wholly below the topic's ingest clock offset, which the owner writes once everything below it
is uploaded and committed, and below which the uploader refuses to commit). Should an
overlap get written anyway, reads report it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV, Compare, Delete, Get, KeyValue, Put, TxnOp
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.observability.metrics import MANIFEST_TXN_SECONDS

log = logging.getLogger(__name__)

ObjectKind = Literal["segment", "topic"]

_COMMIT_TXN = MANIFEST_TXN_SECONDS.labels("commit")
_REPLACE_TXN = MANIFEST_TXN_SECONDS.labels("replace")

#: Topics + ranges per commit transaction. Compares and failure Gets are each one per topic
#: (owner key) plus one per range (entry key), puts one per range, and etcd's default
#: ``--max-txn-ops`` of 128 caps each of them; 100 leaves room, and with one range per topic
#: (one sealed segment) it means 50 topics per transaction. Far below the 1.5 MiB request limit:
#: an entry is about 400 bytes.
_TXN_BUDGET = 100
#: etcd's default ``--max-txn-ops``: the most compares, or ops of one branch, in a transaction.
_MAX_TXN_OPS = 128
#: Failed commit transactions in a row that taught nothing new (no topic lost, no range found
#: committed). Every failure normally does, so this only trips if the manifest keeps changing.
_STALLED_ATTEMPTS = 3

_INT_FIELDS = (
    "start_offset",
    "end_offset",
    "entries",
    "byte_start",
    "byte_length",
    "object_size",
    "object_crc",
    "first_ingest_ms",
    "last_ingest_ms",
    "epoch",
)


@dataclass(frozen=True, slots=True)
class Retired:
    """A retirement record: ``object_key`` stopped being named by some manifest entry at
    ``retired_ms`` (ms since the epoch); other entries may still name it."""

    object_key: str
    retired_ms: int

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> Retired:
        """Parse a record stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            record = cls(object_key=raw["object_key"], retired_ms=raw["retired_ms"])
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed retirement record at {key}: {exc}") from exc
        if not isinstance(record.object_key, str) or not isinstance(record.retired_ms, int):
            raise MetadataError(f"malformed retirement record at {key}: wrong field types")
        return record


@dataclass(frozen=True, slots=True)
class TopicFloor:
    """A topic's retained floor: retention removed every manifest range below ``offset``."""

    offset: int
    """Offsets below it are gone from objects (the WAL may still hold some of them)."""
    expired_ms: int
    """When the floor was last raised (ms since the epoch)."""
    reason: str
    """Why: ``"max_age"``, ``"max_bytes"`` or both, comma-separated."""

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> TopicFloor:
        """Parse a floor stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            floor = cls(offset=raw["offset"], expired_ms=raw["expired_ms"], reason=raw["reason"])
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed retained floor at {key}: {exc}") from exc
        if not isinstance(floor.offset, int) or not isinstance(floor.expired_ms, int):
            raise MetadataError(f"malformed retained floor at {key}: wrong field types")
        return floor


def retire_ops(keys: Keys, object_keys: Iterable[str], now_ms: int | None = None) -> list[Put]:
    """Puts of the retirement records of ``object_keys`` (distinct, in order), stamped
    ``now_ms`` (default: the wall clock). Add them to the transaction that removes the entries
    naming those objects."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    return [
        Put(keys.storage_retired(k), Retired(k, now).encode()) for k in dict.fromkeys(object_keys)
    ]


async def retired_objects(kv: KV, keys: Keys) -> dict[str, Retired]:
    """Object key -> its retirement record, from one prefix read."""
    head = keys.storage_retired_prefix()
    return {r.key[len(head) :]: Retired.decode(r.value, r.key) for r in await kv.get_prefix(head)}


class ManifestConflictError(MetadataError):
    """A range partially overlaps entries of the manifest, or stored entries overlap.

    This must never happen, and is never fixed silently: the message names the topic, the
    ranges and the keys. Nothing more was written for the range. Inspect the entries and the
    objects they name and repair the manifest by hand.
    """


class InvalidRangeError(MetadataError, ValueError):
    """A range, or a set of ranges given to ``commit`` or ``replace``, that cannot be valid."""


@dataclass(frozen=True, slots=True)
class ObjectRange:
    """One manifest entry: a topic's offsets stored contiguously in one object."""

    topic: str
    """``/namespace/topic`` (implied by the key, kept in the value too)."""
    object_key: str
    """The object's key in the object store."""
    start_offset: int
    """First offset of the range (inclusive); the entry's key."""
    end_offset: int
    """One past the last offset. Offsets in ``[start, end)`` without an entry were jumped over:
    they never existed."""
    entries: int
    """How many entries the range holds (at most ``end - start``)."""
    byte_start: int
    """Where the topic's bytes start in the object."""
    byte_length: int
    """Length of the topic's contiguous bytes in the object."""
    object_size: int
    """Size of the whole object in bytes."""
    object_crc: int
    """CRC32C of the whole object."""
    first_ingest_ms: int
    """Ingest time of the range's first entry."""
    last_ingest_ms: int
    """Ingest time of the range's last entry."""
    kind: ObjectKind
    """``"segment"``: a sealed WAL segment of many topics; ``"topic"``: a rotation output."""
    broker: str = ""
    """The broker that committed the range (``commit`` stamps it)."""
    epoch: int = 0
    """The ownership epoch the range was committed under (``commit`` stamps it)."""

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise InvalidRangeError(
                f"invalid range of {self.topic!r} [{self.start_offset}, {self.end_offset}) "
                f"in {self.object_key!r}: {problem}"
            )

    def _problem(self) -> str | None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"{name} must be a non-negative integer, got {value!r}"
        for name in ("topic", "object_key", "broker"):
            if not isinstance(getattr(self, name), str):
                return f"{name} must be a string"
        split_topic(self.topic)
        if not self.object_key:
            return "empty object key"
        if self.end_offset <= self.start_offset:
            return "end offset must be above the start offset"
        if not 1 <= self.entries <= self.end_offset - self.start_offset:
            return f"{self.entries} entries cannot fit the range"
        if self.byte_start + self.byte_length > self.object_size:
            return f"bytes end past the object's {self.object_size} bytes"
        if self.object_crc >= 1 << 32:
            return f"CRC {self.object_crc} is not a 32-bit value"
        if self.first_ingest_ms > self.last_ingest_ms:
            return "first ingest time is after the last"
        if self.kind not in ("segment", "topic"):
            return f"unknown kind {self.kind!r}"
        return None

    def encode(self) -> bytes:
        """The entry's stored value: compact JSON with sorted keys, so always the same bytes."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> ObjectRange:
        """Parse an entry stored at ``key``; ``MetadataError`` naming ``key`` if malformed.

        Fields this version does not know are ignored. The key must end with the range's start.
        """
        try:
            raw = values.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            known = {f.name for f in dataclasses.fields(cls)}
            entry = cls(**{k: v for k, v in raw.items() if k in known})
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"malformed manifest entry at {key}: {exc}") from exc
        if not key.endswith(f"/{entry.start_offset:020d}"):
            raise MetadataError(
                f"malformed manifest entry at {key}: it starts at {entry.start_offset}, "
                "which its key does not match"
            )
        return entry

    def span(self) -> str:
        """``/ns/topic[start, end) object`` for messages and logs."""
        return f"{self.topic}[{self.start_offset}, {self.end_offset}) {self.object_key}"


@dataclass(frozen=True, slots=True)
class CommitResult:
    """The outcome of ``Manifest.commit``, every given range in exactly one list."""

    committed: list[ObjectRange] = field(default_factory=list)
    """Newly written, as stored (stamped with this broker and its epoch)."""
    already: list[ObjectRange] = field(default_factory=list)
    """Already covered by the manifest (a re-run): nothing written. As given."""
    fenced: list[str] = field(default_factory=list)
    """Topics this broker does not own (any more): nothing was written for them."""


class Manifest:
    """Reads and writes the object manifest of every topic."""

    def __init__(self, kv: KV, keys: Keys) -> None:
        self.kv = kv
        self.keys = keys

    def key(self, entry: ObjectRange) -> str:
        """The key of ``entry``."""
        return self.keys.storage_object(entry.topic, entry.start_offset)

    async def ranges(self, topic: str, from_offset: int = 0) -> list[ObjectRange]:
        """The topic's ranges ending after ``from_offset``, in offset order (one prefix read).

        Raises ``ManifestConflictError`` if stored entries overlap, ``MetadataError`` if one is
        malformed.
        """
        return [r for r in await self._read(topic) if r.end_offset > from_offset]

    async def end_offset(self, topic: str) -> int:
        """One past the highest offset in the manifest, 0 when the topic has no entry."""
        entries = await self._read(topic)
        return entries[-1].end_offset if entries else 0

    async def commit(self, ownership: Ownership, ranges: Sequence[ObjectRange]) -> CommitResult:
        """Add ``ranges`` (of any topics) to the manifest, fenced by ``ownership``.

        Every range ends up in exactly one list of the result: written now (stamped with this
        broker and its epoch), already covered by the manifest, or of a topic this broker does
        not own (reported through ``Ownership.on_lost`` if it was lost meanwhile). Safe to
        re-run with the same ranges, also after ``CommitStateUnknownError``: what was written
        is found and not written again.

        Raises ``InvalidRangeError`` if ranges of one topic overlap each other,
        ``ManifestConflictError`` if one partially overlaps the manifest, and ``MetadataError``
        if the manifest keeps changing. Ranges are written in chunks (see the module
        docstring); chunks before the error may have been committed.
        """
        result = CommitResult()
        by_topic: dict[str, list[ObjectRange]] = {}
        for entry in ranges:
            by_topic.setdefault(entry.topic, []).append(entry)
        for topic, entries in by_topic.items():
            by_topic[topic] = _sorted_disjoint(entries, f"ranges of {topic} given to commit")
        for chunk in _chunks(by_topic):
            await self._commit_chunk(ownership, chunk, result)
        return result

    async def replace(
        self,
        ownership: Ownership | None,
        old: Sequence[ObjectRange],
        new: Sequence[ObjectRange],
        *,
        now_ms: int | None = None,
    ) -> bool:
        """Swap entries ``old`` of one topic for ``new``, atomically (rotation).

        ``new`` must hold exactly the offsets and entries of ``old``: the same offset intervals
        once adjacent ranges are joined (a gap between ranges stays a gap) and the same number
        of entries.

        Fencing: rotation is not an owner, so the compare-and-swap itself is the guard. It
        compares every old entry's exact stored value (which names the broker and epoch that
        committed it) and that every new key that is not an old key is absent. Owners only add
        entries at absent keys, so unchanged old entries mean nobody else touched these offsets.
        With ``ownership``, the swap is also fenced by that broker's ownership of the topic
        (``FencedError`` if it lost it).

        The same transaction writes the retirement records of the objects only old entries
        named (``retire_ops``, stamped ``now_ms``).

        Returns ``True`` once swapped, ``False`` if an old entry changed or a new key appeared
        (nothing written: re-read and plan again). Raises ``InvalidRangeError`` if ``new`` does
        not hold exactly what ``old`` holds, or if the swap needs more than etcd's 128 ops.
        """
        topic = _check_swap(old, new)
        old_keys = {self.key(r): r for r in old}
        new_keys = {self.key(r): r for r in new}
        compares = [Compare.value_is(k, r.encode()) for k, r in old_keys.items()]
        compares += [Compare.absent(k) for k in new_keys if k not in old_keys]
        ops: list[TxnOp] = [Delete(k) for k in old_keys if k not in new_keys]
        ops += [Put(k, r.encode()) for k, r in new_keys.items()]
        kept = {r.object_key for r in new}
        gone = [r.object_key for r in old if r.object_key not in kept]
        ops += retire_ops(self.keys, gone, now_ms)
        fence = 0 if ownership is None else 1
        if len(compares) + fence > _MAX_TXN_OPS or len(ops) > _MAX_TXN_OPS:
            raise InvalidRangeError(
                f"cannot swap {len(old)} entries of {topic} for {len(new)} in one transaction: "
                f"etcd allows {_MAX_TXN_OPS} ops; swap fewer at a time"
            )
        started = time.monotonic()
        if ownership is None:
            swapped = (await self.kv.txn(compares, ops)).succeeded
        else:
            swapped = (await ownership.fenced(topic, ops, compares)).succeeded
        _REPLACE_TXN.observe(time.monotonic() - started)
        log.info(
            "manifest replace topic=%s old=%s new=%s swapped=%s",
            topic,
            len(old),
            len(new),
            swapped,
        )
        return swapped

    async def floor(self, topic: str) -> TopicFloor | None:
        """The topic's retained floor, ``None`` while retention never removed a range."""
        stored = await self.kv.get(self.keys.topic_floor(topic))
        return None if stored is None else TopicFloor.decode(stored.value, stored.key)

    async def remove(
        self, old: Sequence[ObjectRange], now_ms: int | None = None, *, reason: str = "retention"
    ) -> bool:
        """Remove entries ``old`` of one topic, atomically (retention), and raise the topic's
        retained floor to the end of the highest of them (never lowering it).

        Like ``replace``, the compare-and-swap is the guard: it compares every old entry's
        exact stored value and the floor as read (or its absence). The same transaction writes
        the retirement records of every object an old entry named (``retire_ops``, stamped
        ``now_ms``): the orphan collector deletes those no other entry names once the
        retirement is older than its grace period.

        Returns ``True`` once removed, ``False`` if an old entry or the floor changed (nothing
        written: re-read and plan again). Raises ``InvalidRangeError`` for entries of several
        topics, overlapping ones, or more than one transaction holds.
        """
        if not old:
            raise InvalidRangeError("a manifest removal needs entries")
        topic = old[0].topic
        if any(r.topic != topic for r in old):
            raise InvalidRangeError(f"a manifest removal is of one topic; got {topic} and others")
        ordered = _sorted_disjoint(old, "entries to remove")
        now = int(time.time() * 1000) if now_ms is None else now_ms
        floor_key = self.keys.topic_floor(topic)
        stored = await self.kv.get(floor_key)
        previous = None if stored is None else TopicFloor.decode(stored.value, floor_key)
        offset = max(ordered[-1].end_offset, 0 if previous is None else previous.offset)
        compares = [Compare.value_is(self.key(r), r.encode()) for r in ordered]
        seen = Compare.absent(floor_key)
        if stored is not None:
            seen = Compare.value_is(floor_key, stored.value)
        compares.append(seen)
        ops: list[TxnOp] = [Delete(self.key(r)) for r in ordered]
        ops += retire_ops(self.keys, [r.object_key for r in ordered], now)
        ops.append(Put(floor_key, TopicFloor(offset, now, reason).encode()))
        if len(compares) > _MAX_TXN_OPS or len(ops) > _MAX_TXN_OPS:
            raise InvalidRangeError(
                f"cannot remove {len(old)} entries of {topic} in one transaction: etcd allows "
                f"{_MAX_TXN_OPS} ops; remove fewer at a time"
            )
        removed = (await self.kv.txn(compares, ops)).succeeded
        log.info(
            "manifest remove topic=%s entries=%s floor=%s reason=%s removed=%s",
            topic,
            len(old),
            offset,
            reason,
            removed,
        )
        return removed

    async def _read(self, topic: str) -> list[ObjectRange]:
        stored = await self.kv.get_prefix(self.keys.storage_objects_prefix(topic))
        return _checked(topic, stored)

    async def _commit_chunk(
        self, ownership: Ownership, pending: list[ObjectRange], result: CommitResult
    ) -> None:
        stalled = 0
        while True:
            # A topic fenced earlier in this call stays fenced, even if re-acquired meanwhile.
            owners = {
                r.topic: None if r.topic in result.fenced else ownership.owned(r.topic)
                for r in pending
            }
            for topic, owner in owners.items():
                if owner is None:
                    _add_fenced(result, topic)
            # Stamped just before the transaction, which compares exactly these epochs.
            stamped = [
                dataclasses.replace(r, broker=owner.broker_id, epoch=owner.epoch)
                for r in pending
                if (owner := owners[r.topic]) is not None
            ]
            pending = [r for r in pending if owners[r.topic] is not None]
            if not pending:
                return
            keys = [self.key(r) for r in stamped]
            started = time.monotonic()
            outcome = await ownership.fenced_many(
                list(dict.fromkeys(r.topic for r in stamped)),
                [Put(k, r.encode()) for k, r in zip(keys, stamped, strict=True)],
                compares=[Compare.absent(k) for k in keys],
                failure=[Get(k) for k in keys],
            )
            _COMMIT_TXN.observe(time.monotonic() - started)
            if outcome.succeeded:
                result.committed.extend(stamped)
                log.info(
                    "manifest committed ranges=%s topics=%s broker=%s",
                    len(stamped),
                    len({r.topic for r in stamped}),
                    ownership.session.broker_id,
                )
                return
            lost = set(outcome.fenced)
            for topic in outcome.fenced:
                _add_fenced(result, topic)
                log.warning("manifest commit fenced topic=%s: ownership lost", topic)
            # Failure Gets are in range order: a topic with an existing key is a re-run.
            rerun = {
                r.topic
                for r, got in zip(pending, outcome.responses, strict=False)
                if got.kvs and r.topic not in lost
            }
            stored = {topic: await self._read(topic) for topic in sorted(rerun)}
            found = len(result.already)
            remaining = []
            for entry in pending:
                if entry.topic in lost:
                    continue
                if entry.topic in stored and covered(entry, stored[entry.topic]):
                    result.already.append(entry)
                    log.info("manifest range already committed range=%s", entry.span())
                else:
                    remaining.append(entry)
            if lost or len(result.already) > found:
                stalled = 0
            else:
                stalled += 1
                if stalled >= _STALLED_ATTEMPTS:
                    topics = ", ".join(sorted({r.topic for r in remaining}))
                    raise MetadataError(
                        f"manifest commit failed {stalled} times in a row without a cause: "
                        f"the manifest of {topics} keeps changing; try again"
                    )
            pending = remaining


def _add_fenced(result: CommitResult, topic: str) -> None:
    if topic not in result.fenced:
        result.fenced.append(topic)


def _chunks(by_topic: dict[str, list[ObjectRange]]) -> list[list[ObjectRange]]:
    """Split into transactions of at most ``_TXN_BUDGET`` topics + ranges."""
    chunks: list[list[ObjectRange]] = []
    current: list[ObjectRange] = []
    topics: set[str] = set()
    for topic, entries in by_topic.items():
        for entry in entries:
            cost = 1 if topic in topics else 2
            if len(current) + len(topics) + cost > _TXN_BUDGET:
                chunks.append(current)
                current, topics = [], set()
            current.append(entry)
            topics.add(topic)
    if current:
        chunks.append(current)
    return chunks


def _checked(topic: str, stored: Sequence[KeyValue]) -> list[ObjectRange]:
    """Decode a topic's entries (in key order) and check they belong to it and do not overlap."""
    entries: list[ObjectRange] = []
    previous_key = ""
    for kv in stored:
        entry = ObjectRange.decode(kv.value, kv.key)
        if entry.topic != topic:
            raise MetadataError(
                f"manifest entry at {kv.key} belongs to {entry.topic}, not {topic}: "
                "its value does not match its key"
            )
        if entries and entry.start_offset < entries[-1].end_offset:
            raise ManifestConflictError(
                f"manifest of {topic} has overlapping entries: {entries[-1].span()} at "
                f"{previous_key} and {entry.span()} at {kv.key}; repair it by hand"
            )
        entries.append(entry)
        previous_key = kv.key
    return entries


def covered(entry: ObjectRange, stored: Sequence[ObjectRange]) -> bool:
    """Whether the stored (non-overlapping) entries cover ``entry``: ``True`` if wholly,
    ``False`` if not at all; ``ManifestConflictError`` if partly."""
    overlapping = [
        s for s in stored if s.start_offset < entry.end_offset and entry.start_offset < s.end_offset
    ]
    overlap = sum(
        min(entry.end_offset, s.end_offset) - max(entry.start_offset, s.start_offset)
        for s in overlapping
    )
    if overlap == 0:
        return False
    if overlap == entry.end_offset - entry.start_offset:
        return True
    raise ManifestConflictError(
        f"cannot commit {entry.span()}: it partially overlaps the manifest of {entry.topic} "
        f"({'; '.join(s.span() for s in overlapping)}); nothing was written for it"
    )


def _sorted_disjoint(entries: Sequence[ObjectRange], what: str) -> list[ObjectRange]:
    """``entries`` by start offset; ``InvalidRangeError`` if two of them overlap."""
    ordered = sorted(entries, key=lambda r: r.start_offset)
    for before, after in itertools.pairwise(ordered):
        if after.start_offset < before.end_offset:
            raise InvalidRangeError(f"{what} overlap: {before.span()} and {after.span()}")
    return ordered


def _intervals(entries: Sequence[ObjectRange]) -> list[tuple[int, int]]:
    """The offsets of sorted, non-overlapping ranges as intervals, adjacent ones joined."""
    joined: list[tuple[int, int]] = []
    for entry in entries:
        if joined and joined[-1][1] == entry.start_offset:
            joined[-1] = (joined[-1][0], entry.end_offset)
        else:
            joined.append((entry.start_offset, entry.end_offset))
    return joined


def _check_swap(old: Sequence[ObjectRange], new: Sequence[ObjectRange]) -> str:
    """The topic of a valid swap; ``InvalidRangeError`` unless ``new`` holds what ``old`` does."""
    if not old or not new:
        raise InvalidRangeError("a manifest swap needs old and new entries")
    topic = old[0].topic
    if any(r.topic != topic for r in (*old, *new)):
        raise InvalidRangeError(f"a manifest swap is of one topic; got {topic} and others")
    old_sorted = _sorted_disjoint(old, "old entries of the swap")
    new_sorted = _sorted_disjoint(new, "new entries of the swap")
    if _intervals(old_sorted) != _intervals(new_sorted):
        raise InvalidRangeError(
            f"new entries of {topic} must cover exactly the offsets of the old: old "
            f"{_intervals(old_sorted)}, new {_intervals(new_sorted)}"
        )
    old_count, new_count = sum(r.entries for r in old), sum(r.entries for r in new)
    if old_count != new_count:
        raise InvalidRangeError(
            f"new entries of {topic} hold {new_count} entries, the old {old_count}"
        )
    return topic
