"""ProgressUpdater: batching by time and count, forced flush, fencing."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.metadata import KV, Keys, MetadataError, ProgressUpdater, encode_cursor

from .conftest import Broker, eventually

TOPIC = "/default/orders"


async def value_of(kv: KV, key: str) -> bytes | None:
    stored = await kv.get(key)
    return None if stored is None else stored.value


async def test_changes_are_written_after_the_interval_newest_value_only(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await a.ownership.acquire(TOPIC)
    progress = ProgressUpdater(a.ownership, interval=0.3, max_pending=100)
    cursor = keys.subscription_cursor(TOPIC, "s1")
    for offset in range(10):
        progress.set(TOPIC, cursor, encode_cursor(offset))
    assert progress.pending == 1
    await asyncio.sleep(0.1)
    assert await value_of(kv, cursor) is None  # not yet: the interval has not elapsed
    await eventually(lambda: progress.pending == 0, timeout=2)
    assert await value_of(kv, cursor) == encode_cursor(9)
    stored = await kv.get(cursor)
    assert stored is not None and stored.version == 1  # one write for ten updates
    await progress.close()


async def test_steady_changes_cost_one_write_per_interval(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    """A change set while a write was in flight used to keep the old due time, so under
    steady acks the next write followed at once: a write per etcd round trip (over a
    thousand in 1.5 s), not one per interval."""
    a, _ = brokers
    await a.ownership.acquire(TOPIC)
    progress = ProgressUpdater(a.ownership, interval=0.5, max_pending=100)
    cursor = keys.subscription_cursor(TOPIC, "s1")
    offset = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + 1.5
    while loop.time() < end:
        offset += 1
        progress.set(TOPIC, cursor, encode_cursor(offset))
        await asyncio.sleep(0)  # an ack arriving between the updater's steps
    await progress.close()
    stored = await kv.get(cursor)
    assert stored is not None and stored.value == encode_cursor(offset)
    # Rounds at 0.5, 1.0 and 1.5 s, plus close's flush (one more on a slow machine).
    assert stored.version <= 5, f"{stored.version} writes for 1.5 s of changes"


async def test_max_pending_keys_trigger_a_flush_before_the_interval(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await a.ownership.acquire(TOPIC)
    progress = ProgressUpdater(a.ownership, interval=60, max_pending=3)
    cursors = [keys.subscription_cursor(TOPIC, f"s{i}") for i in range(3)]
    progress.set(TOPIC, cursors[0], b"1")
    progress.set(TOPIC, cursors[1], b"2")
    await asyncio.sleep(0.1)
    assert await value_of(kv, cursors[0]) is None
    progress.set(TOPIC, cursors[2], b"3")
    await eventually(lambda: progress.pending == 0, timeout=2)
    assert [await value_of(kv, c) for c in cursors] == [b"1", b"2", b"3"]
    await progress.close()


async def test_forced_flush_and_close_write_everything_in_chunks(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await a.ownership.acquire(TOPIC)
    await a.ownership.acquire("/default/other")
    progress = ProgressUpdater(a.ownership, interval=60, max_pending=10_000)
    many = [keys.subscription_cursor(TOPIC, f"s{i}") for i in range(250)]  # > one txn's ops
    for key in many:
        progress.set(TOPIC, key, b"7")
    other = keys.subscription_cursor("/default/other", "s")
    progress.set("/default/other", other, b"8")
    await progress.flush(TOPIC)
    assert progress.pending == 1
    assert len(await kv.get_prefix(keys.subscriptions_prefix(TOPIC))) == 250
    assert await value_of(kv, other) is None
    await progress.close()
    assert await value_of(kv, other) == b"8"
    with pytest.raises(MetadataError):
        progress.set(TOPIC, many[0], b"9")


async def test_fenced_progress_is_dropped_and_never_overwrites_the_new_owner(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    a_progress = ProgressUpdater(a.ownership, interval=60)
    cursor = keys.subscription_cursor(TOPIC, "s1")
    a_progress.set(TOPIC, cursor, b"10")
    await a_progress.flush()
    assert await value_of(kv, cursor) == b"10"

    lease = a.session.lease_id
    assert lease is not None
    await kv.revoke_lease(lease)  # a loses the topic; b takes over and moves the cursor on
    await b.ownership.acquire(TOPIC)
    await b.ownership.fenced(TOPIC, [])  # b is the owner
    b_progress = ProgressUpdater(b.ownership, interval=60)
    b_progress.set(TOPIC, cursor, b"20")
    await b_progress.flush()

    a_progress.set(TOPIC, cursor, b"11")  # stale progress from the old owner
    await a_progress.flush()  # dropped, not raised
    assert a_progress.pending == 0
    assert await value_of(kv, cursor) == b"20"
    await eventually(lambda: a.lost == [TOPIC])
    await a_progress.close()
    await b_progress.close()
