"""A topic's ingest clock: which offsets are uploaded, and the time every later entry is past.

``storage/topics/{ns}/{topic}/clock`` = ``{"offset": N, "ingest_ms": T, "broker": B, "epoch": E}``
states two facts at once (Materialize's reclocking: offsets bound to times, durably):

* every offset of the topic below ``N`` that exists is committed to the object manifest, and
* every entry at offset ``N`` or above has an ingest time of at least ``T``.

So a time interval ``[s, e)`` with ``e <= T`` is *complete*: all of its entries have offsets
below ``N`` and can be read from objects; nothing will ever be added to it. The daemon that owns
the topic moves the clock forward (both numbers never decrease) after its uploads commit, and
writes durable time markers for idle topics so that a quiet topic's clock advances too. Readers
(the Parquet converter) only read it.

Writing (:class:`ClockWriter`): only the topic's owner writes, in a transaction that compares its
owner key (epoch included, ``Ownership.fenced_many``) and the clock key's revision as it read it
(compare-and-swap). The stored value becomes the field-wise maximum of the stored and the new
clock, which is as true as both (an entry at or above both offsets is past both times), so
neither field ever decreases, whoever wrote last.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Get, KeyValue, Put
from danube_ingest.metadata.ownership import Ownership

log = logging.getLogger(__name__)

#: Topics per clock transaction: each costs one owner compare and one clock compare, one put,
#: and two failure gets; etcd's default ``--max-txn-ops`` of 128 caps compares and each branch.
_TXN_TOPICS = 60
#: Compare failures in a row (another writer changed a clock between read and write) before a
#: batch gives up until the next call; each failure re-reads the clocks in the same round trip.
_CAS_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class TopicClock:
    """A topic's ingest clock (see the module docstring)."""

    offset: int
    """Every existing offset below it is committed to the manifest."""
    ingest_ms: int
    """Every entry at ``offset`` or above has an ingest time (ms since the epoch) of at least
    this."""
    broker: str = ""
    """The broker that wrote it."""
    epoch: int = 0
    """The ownership epoch it was written under."""

    def __post_init__(self) -> None:
        for name in ("offset", "ingest_ms", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"clock {name} must be a non-negative integer, got {value!r}")

    def complete(self, end_ms: int) -> bool:
        """Whether every entry with an ingest time below ``end_ms`` is known and uploaded."""
        return end_ms <= self.ingest_ms

    def encode(self) -> bytes:
        return json.dumps(
            {
                "offset": self.offset,
                "ingest_ms": self.ingest_ms,
                "broker": self.broker,
                "epoch": self.epoch,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> TopicClock:
        """Parse a stored clock; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            return cls(
                offset=raw["offset"],
                ingest_ms=raw["ingest_ms"],
                broker=str(raw.get("broker", "")),
                epoch=raw.get("epoch", 0),
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed topic clock at {key}: {exc!r}") from exc


async def read_clock(kv: KV, keys: Keys, topic: str) -> TopicClock | None:
    """The topic's clock, or None when none was written yet (nothing is complete then)."""
    key = keys.topic_clock(topic)
    stored = await kv.get(key)
    if stored is None:
        return None
    return TopicClock.decode(stored.value, key)


@dataclass(frozen=True, slots=True)
class ClockMark:
    """A candidate clock: a true statement about a topic's WAL that may be written."""

    offset: int
    """Every existing offset below it is committed to the manifest."""
    ingest_ms: int
    """Every entry at ``offset`` or above has an ingest time of at least this."""
    epoch: int
    """The ownership epoch it was made under: it is written only while this broker owns the
    topic at that epoch (another owner in between may have stamped entries it does not
    bound)."""


@dataclass
class ClockAdvance:
    """The outcome of ``ClockWriter.advance``."""

    stored: dict[str, TopicClock] = field(default_factory=dict)
    """The clock now stored for each topic written or found already as far (at least the
    mark, field-wise)."""
    fenced: list[str] = field(default_factory=list)
    """Topics this broker does not own (at the mark's epoch): nothing was written for them."""
    contended: list[str] = field(default_factory=list)
    """Topics whose clock kept changing under the compare-and-swap (retry later)."""
    writes: int = 0
    """Clock keys written."""


class ClockWriter:
    """Moves the clocks of the topics an ``Ownership`` holds forward. Use from one event loop.

    Guarantees: a stored clock never moves back (compare-and-swap on its revision, field-wise
    maximum); nothing is written for a topic this broker does not own at its current epoch (the
    owner key is compared in the same transaction); at most one transaction per
    ``_TXN_TOPICS`` topics per call when nobody else writes the clocks.
    """

    def __init__(self, ownership: Ownership) -> None:
        self._ownership = ownership
        self._keys = ownership.keys
        #: topic -> the clock key as last read or written (a compare-and-swap's expectation).
        self._seen: dict[str, KeyValue | None] = {}

    async def advance(self, marks: Mapping[str, ClockMark]) -> ClockAdvance:
        """Make each topic's stored clock at least its mark, field-wise.

        Raises ``MetadataError`` (etcd unreachable, a malformed stored clock): what was
        written before stays written, nothing is half-written (one transaction per batch).
        """
        result = ClockAdvance()
        topics = list(marks)
        for start in range(0, len(topics), _TXN_TOPICS):
            batch = {t: marks[t] for t in topics[start : start + _TXN_TOPICS]}
            await self._advance_batch(batch, result)
        return result

    def forget(self, topic: str) -> None:
        """Drop what is cached about ``topic`` (it is no longer owned here)."""
        self._seen.pop(topic, None)

    async def _advance_batch(self, marks: dict[str, ClockMark], result: ClockAdvance) -> None:
        keys = self._keys
        unknown = [t for t in marks if t not in self._seen]
        if unknown:
            read = await self._ownership.kv.txn([], [Get(keys.topic_clock(t)) for t in unknown])
            for i, topic in enumerate(unknown):
                self._seen[topic] = read.kv(i)
        pending = dict(marks)
        for _ in range(_CAS_ATTEMPTS):
            puts: dict[str, TopicClock] = {}
            for topic, mark in list(pending.items()):
                seen = self._seen[topic]
                stored = None if seen is None else TopicClock.decode(seen.value, seen.key)
                owner = self._ownership.owned(topic)
                if owner is None or owner.epoch != mark.epoch:
                    result.fenced.append(topic)
                    del pending[topic]
                    continue
                merged = _merge(stored, mark, owner.broker_id)
                if merged is None:
                    assert stored is not None
                    result.stored[topic] = stored
                    del pending[topic]
                else:
                    puts[topic] = merged
            if not puts:
                return
            names = list(puts)
            clock_keys = [keys.topic_clock(t) for t in names]
            outcome = await self._ownership.fenced_many(
                names,
                [
                    *(Put(k, puts[t].encode()) for t, k in zip(names, clock_keys, strict=True)),
                    *(Get(k) for k in clock_keys),
                ],
                [
                    Compare.unchanged(k, self._seen[t])
                    for t, k in zip(names, clock_keys, strict=True)
                ],
                [Get(k) for k in clock_keys],
            )
            if outcome.fenced:
                for topic in outcome.fenced:
                    result.fenced.append(topic)
                    pending.pop(topic, None)
                    self.forget(topic)
                log.warning(
                    "clock not advanced: topics not owned topics=%s", ",".join(outcome.fenced)
                )
                continue
            offset = len(names) if outcome.succeeded else 0
            for i, topic in enumerate(names):
                self._seen[topic] = outcome.kv(offset + i)
            if outcome.succeeded:
                result.writes += len(names)
                for topic in names:
                    result.stored[topic] = puts[topic]
                    del pending[topic]
                return
        result.contended.extend(pending)


def _merge(stored: TopicClock | None, mark: ClockMark, broker: str) -> TopicClock | None:
    """The clock to write (field-wise maximum), or None when ``stored`` is already as far."""
    if stored is not None and stored.offset >= mark.offset and stored.ingest_ms >= mark.ingest_ms:
        return None
    return TopicClock(
        offset=max(mark.offset, 0 if stored is None else stored.offset),
        ingest_ms=max(mark.ingest_ms, 0 if stored is None else stored.ingest_ms),
        broker=broker,
        epoch=mark.epoch,
    )
