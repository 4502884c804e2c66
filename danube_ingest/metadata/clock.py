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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV


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
            raw = json.loads(data)
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
