"""``read_overview``: every topic's progress from one read, as the library wrote it (on
``MemoryKV`` and on a real etcd)."""

from __future__ import annotations

import json

import pytest

from danube_ingest.metadata import (
    KV,
    Keys,
    Manifest,
    MetadataError,
    ObjectRange,
    Owner,
    PruneMarks,
    Records,
    SubscriptionRecord,
    TopicRecord,
)
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.overview import read_overview

T, U = "/default/orders", "/other/orders.v2-eu:1"


def _range(topic: str, start: int, end: int) -> ObjectRange:
    return ObjectRange(
        topic=topic,
        object_key=f"segments/b1/r0/{start + 1:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=8,
        byte_length=100,
        object_size=200,
        object_crc=1,
        first_ingest_ms=1,
        last_ingest_ms=2,
        kind="segment",
        broker="b1",
        epoch=3,
    )


async def test_overview_of_topics_subscriptions_manifest_clock_and_marks(
    kv: KV, keys: Keys
) -> None:
    records = Records(kv, keys)
    for name in (U, T):
        await records.create_topic_if_absent(TopicRecord(name))
    await kv.put(keys.broker("b1"), json.dumps({"url": "http://x:1", "regions": 2}).encode())
    await kv.put(keys.topic_owner(T), Owner("b1", "http://x:1", 3).encode())
    await kv.put(keys.topic_offsets(T), json.dumps({"reserved": 10_000}).encode())
    manifest = Manifest(kv, keys)
    for start, end in ((0, 100), (100, 250)):
        entry = _range(T, start, end)
        await kv.put(manifest.key(entry), entry.encode())
    await kv.put(keys.topic_clock(T), TopicClock(250, 1_700_000_000_000, "b1", 3).encode())
    for sub, cursor in (("a", 120), ("b", None)):
        await records.put_subscription(SubscriptionRecord(T, sub, "Shared"))
        if cursor is not None:
            await records.set_cursor(T, sub, cursor)
    await records.set_cursor(T, "deleted", 5)  # a cursor without its record: ignored
    await PruneMarks(kv, keys).set_mark("b1", "r1", T, 90)

    overview = await read_overview(kv, keys)

    assert list(overview.topics) == [T, U]  # name order
    assert overview.brokers == {"b1": 2}
    t = overview.topics[T]
    assert t.owner == Owner("b1", "http://x:1", 3)
    assert (t.reserved, t.manifest_end, t.ranges) == (10_000, 250, 2)
    assert t.clock == TopicClock(250, 1_700_000_000_000, "b1", 3)
    assert t.cursors == {"a": 120, "b": None}
    assert t.lags() == {"a": 130, "b": None}
    assert t.marks == {("b1", "r1"): 90}
    u = overview.topics[U]
    assert (u.owner, u.reserved, u.manifest_end, u.clock, u.cursors, u.marks) == (
        None,
        0,
        0,
        None,
        {},
        {},
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("topic_offsets", b'{"reserved": "many"}'),
        ("topic_owner", b"{}"),
        ("topic_clock", b'{"offset": -1, "ingest_ms": 1}'),
    ],
)
async def test_a_malformed_value_is_reported_with_its_key(
    kv: KV, keys: Keys, key: str, value: bytes
) -> None:
    await Records(kv, keys).create_topic_if_absent(TopicRecord(T))
    where = getattr(keys, key)(T)
    await kv.put(where, value)
    with pytest.raises(MetadataError, match=where):
        await read_overview(kv, keys)
