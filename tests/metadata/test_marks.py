"""WAL prune marks (forward only) and the subscription cursors they are computed from."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.metadata import (
    KV,
    Keys,
    MetadataError,
    PruneMarks,
    Records,
    SubscriptionRecord,
    subscription_cursors,
)

T, U = "/default/orders", "/other/orders.v2-eu:1"


@pytest.fixture
def marks(kv: KV, keys: Keys) -> PruneMarks:
    return PruneMarks(kv, keys)


async def test_a_mark_only_moves_forward(marks: PruneMarks) -> None:
    assert await marks.marks("a", "0") == {}
    assert await marks.set_mark("a", "0", T, 100)
    assert not await marks.set_mark("a", "0", T, 50)
    assert not await marks.set_mark("a", "0", T, 100)
    assert await marks.marks("a", "0") == {T: 100}
    assert await marks.set_mark("a", "0", T, 250)
    assert await marks.marks("a", "0") == {T: 250}
    with pytest.raises(MetadataError, match="offsets start at 0"):
        await marks.set_mark("a", "0", T, -1)


async def test_marks_round_trip_topic_names_per_broker_region(
    marks: PruneMarks, kv: KV, keys: Keys
) -> None:
    await marks.set_mark("a", "0", T, 10)
    await marks.set_mark("a", "0", U, 20)
    await marks.set_mark("a", "1", T, 30)
    await marks.set_mark("b", "0", T, 40)
    assert await marks.marks("a", "0") == {T: 10, U: 20}
    assert await marks.marks("a", "1") == {T: 30}
    assert await marks.marks("b", "0") == {T: 40}
    stored = await kv.get(keys.wal_floor("a", "0", U))
    assert stored is not None and stored.key.endswith("/wal/a/0/floor/other/orders.v2-eu:1")
    assert await marks.delete_mark("a", "0", T)
    assert not await marks.delete_mark("a", "0", T)
    assert await marks.marks("a", "0") == {U: 20}


async def test_concurrent_writers_leave_the_highest_mark(marks: PruneMarks) -> None:
    offsets = [30, 10, 50, 20, 40, 50, 0]
    changed = await asyncio.gather(*(marks.set_mark("a", "0", T, o) for o in offsets))
    assert changed.count(True) >= 1
    assert await marks.marks("a", "0") == {T: 50}


async def test_a_malformed_mark_is_reported_with_its_key(
    marks: PruneMarks, kv: KV, keys: Keys
) -> None:
    key = keys.wal_floor("a", "0", T)
    await kv.put(key, b'{"offset": "many"}')
    with pytest.raises(MetadataError, match=f"malformed prune mark at {key}"):
        await marks.marks("a", "0")
    with pytest.raises(MetadataError, match=f"malformed prune mark at {key}"):
        await marks.set_mark("a", "0", T, 5)


async def test_subscription_cursors_with_and_without_cursors(kv: KV, keys: Keys) -> None:
    records = Records(kv, keys)
    assert await subscription_cursors(kv, keys, T) == {}
    for name in ("s", "s-2", "analytics"):
        await records.put_subscription(SubscriptionRecord(T, name, "Shared"))
    await records.put_subscription(SubscriptionRecord("/default/orders2", "s", "Shared"))
    await records.set_cursor(T, "s", 120)
    await records.set_cursor(T, "analytics", 0)
    await records.set_cursor("/default/orders2", "s", 7)
    # A cursor whose subscription was deleted (a progress write that lost the race) is no
    # subscription: it must not hold pruning back.
    await records.set_cursor(T, "gone", 3)
    assert await subscription_cursors(kv, keys, T) == {"s": 120, "s-2": None, "analytics": 0}
    assert await subscription_cursors(kv, keys, "/default/orders2") == {"s": 7}
