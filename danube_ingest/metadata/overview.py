"""``read_overview``: every topic's progress as etcd states it, in one read.

What the control plane shows and decides from (the Dagster ``topics`` observation and the
prune-mark sensor): per topic its owner, its offset reservation, the end of its object manifest,
its ingest clock, its subscriptions' cursors and its prune marks, plus every broker's region
count. Nothing here talks to a broker: a figure only the broker knows (its WAL end, the exact
next offset) is not in it, so a subscription's lag is measured against the uploaded end (the
manifest end), not against the newest message.

Guarantees: one etcd transaction of five prefix reads (``brokers/``, ``topics/``,
``subscriptions/``, ``storage/topics/``, ``wal/``), so every figure is from the same revision;
a malformed value raises ``MetadataError`` naming its key; nothing is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from danube_ingest.metadata import values
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Get, KeyValue
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.records import TopicRecord, decode_cursor


@dataclass
class TopicProgress:
    """One topic's progress (see the module docstring)."""

    name: str
    """``/namespace/topic``."""
    owner: Owner | None = None
    """The live owner, ``None`` while nobody holds the topic."""
    reserved: int = 0
    """Offsets below this may have been assigned (the offset reservation; 0: none yet). An
    upper bound of the next offset: an owner reserves a block ahead."""
    manifest_end: int = 0
    """One past the last offset committed to the object manifest (0: no range)."""
    ranges: int = 0
    """Manifest ranges (objects' slices) the topic has."""
    clock: TopicClock | None = None
    """The ingest clock, ``None`` until the owner wrote one."""
    cursors: dict[str, int | None] = field(default_factory=dict)
    """Subscription → its cursor (every offset below is acked), ``None`` while it has none."""
    marks: dict[tuple[str, str], int] = field(default_factory=dict)
    """(broker, region) → the topic's prune mark in that WAL region."""

    def lags(self) -> dict[str, int | None]:
        """Subscription → uploaded messages it has not acked yet (``manifest_end - cursor``,
        at least 0), ``None`` for a subscription without a cursor."""
        return {
            name: None if cursor is None else max(0, self.manifest_end - cursor)
            for name, cursor in self.cursors.items()
        }


@dataclass
class Overview:
    """Every topic's progress and every broker's region count, read at one revision."""

    topics: dict[str, TopicProgress]
    """Topic name → progress, in name order; only topics with a record."""
    brokers: dict[str, int]
    """Registered broker id → its WAL region count."""


def _topic_of(rest: str) -> tuple[str, str]:
    """``{ns}/{topic}[/{more}]`` → (``/ns/topic``, ``more``)."""
    ns, _, tail = rest.partition("/")
    name, _, more = tail.partition("/")
    return f"/{ns}/{name}", more


def _broker_regions(stored: KeyValue, head: str) -> tuple[str, int]:
    try:
        regions = int(values.loads(stored.value).get("regions", 1))
    except (ValueError, TypeError, AttributeError) as exc:
        raise MetadataError(f"malformed broker registration at {stored.key}") from exc
    if regions < 1:
        raise MetadataError(f"broker registration at {stored.key} has {regions} regions")
    return stored.key[len(head) :], regions


def _reserved(stored: KeyValue) -> int:
    try:
        return int(json.loads(stored.value)["reserved"])
    except (ValueError, TypeError, KeyError) as exc:
        raise MetadataError(
            f"malformed offset reservation at {stored.key}: {stored.value!r}"
        ) from exc


def _mark(stored: KeyValue) -> int:
    try:
        offset = int(values.loads(stored.value)["offset"])
    except (ValueError, TypeError, KeyError) as exc:
        raise MetadataError(f"malformed prune mark at {stored.key}: {stored.value!r}") from exc
    if offset < 0:
        raise MetadataError(f"malformed prune mark at {stored.key}: negative offset {offset}")
    return offset


async def read_overview(kv: KV, keys: Keys) -> Overview:
    """Every topic's progress, from one etcd transaction (see the module docstring)."""
    heads = {
        "brokers": keys.brokers_prefix(),
        "topics": keys.topics_prefix(),
        "subscriptions": f"{keys.prefix}/subscriptions/",
        "storage": f"{keys.prefix}/storage/topics/",
        "wal": f"{keys.prefix}/wal/",
    }
    result = await kv.txn([], [Get(head, prefix=True) for head in heads.values()])
    found = dict(zip(heads, (r.kvs for r in result.responses), strict=True))

    brokers = dict(_broker_regions(s, heads["brokers"]) for s in found["brokers"])
    topics: dict[str, TopicProgress] = {}
    owners: dict[str, Owner] = {}
    reserved: dict[str, int] = {}
    for stored in found["topics"]:
        name, more = _topic_of(stored.key[len(heads["topics"]) :])
        if not more:
            topics[name] = TopicProgress(TopicRecord.decode(stored.value, stored.key).name)
        elif more == "owner":
            owners[name] = Owner.decode(stored.value, stored.key)
        elif more == "offsets":
            reserved[name] = _reserved(stored)
    for name, progress in topics.items():
        progress.owner = owners.get(name)
        progress.reserved = reserved.get(name, 0)

    cursors: dict[tuple[str, str], int] = {}
    for stored in found["subscriptions"]:
        name, more = _topic_of(stored.key[len(heads["subscriptions"]) :])
        sub, slash, rest = more.partition("/")
        if name not in topics:
            continue
        if not slash:
            topics[name].cursors.setdefault(sub, None)
        elif rest == "cursor":
            cursors[(name, sub)] = decode_cursor(stored.value, stored.key)
    for (name, sub), cursor in cursors.items():
        # A cursor without its subscription's record (a progress write racing the deletion)
        # is ignored, as ``marks.subscription_cursors`` does.
        if sub in topics[name].cursors:
            topics[name].cursors[sub] = cursor

    for stored in found["storage"]:
        name, more = _topic_of(stored.key[len(heads["storage"]) :])
        topic = topics.get(name)
        if topic is None:
            continue
        if more.startswith("objects/"):
            entry = ObjectRange.decode(stored.value, stored.key)
            topic.ranges += 1
            topic.manifest_end = entry.end_offset  # key order is offset order: the last wins
        elif more == "clock":
            topic.clock = TopicClock.decode(stored.value, stored.key)

    for stored in found["wal"]:
        # wal/{broker}/{region}/floor/{ns}/{topic}
        broker, region, floor, rest = (stored.key[len(heads["wal"]) :].split("/", 3) + [""] * 3)[:4]
        topic = topics.get("/" + rest) if floor == "floor" else None
        if topic is not None:
            topic.marks[(broker, region)] = _mark(stored)
    return Overview(topics=dict(sorted(topics.items())), brokers=brokers)


__all__ = ["Overview", "TopicProgress", "read_overview"]
