"""OffsetReservation: an offset is never reused across owners."""

from __future__ import annotations

import json

import pytest

from danube_ingest.metadata import KV, FencedError, Keys

from .conftest import OFFSET_BLOCK, Broker, eventually

TOPIC = "/default/orders"


async def stored_reservation(kv: KV, keys: Keys) -> int | None:
    stored = await kv.get(keys.topic_offsets(TOPIC))
    return None if stored is None else int(json.loads(stored.value)["reserved"])


async def test_reservation_extends_by_blocks_and_skips_io_when_covered(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a = brokers[0]
    await a.ownership.acquire(TOPIC)
    own = a.offsets
    assert await own.start_offset(TOPIC) == 0
    assert not own.covered(TOPIC, 1)
    assert await own.ensure(TOPIC, 1) == 1 + OFFSET_BLOCK
    assert await stored_reservation(kv, keys) == 1 + OFFSET_BLOCK
    before = await kv.get(keys.topic_offsets(TOPIC))
    for next_offset in (2, 50, 1 + OFFSET_BLOCK):
        assert own.covered(TOPIC, next_offset)
        assert await own.ensure(TOPIC, next_offset) == 1 + OFFSET_BLOCK
    after = await kv.get(keys.topic_offsets(TOPIC))
    assert before is not None and after is not None
    assert after.mod_revision == before.mod_revision  # no write while covered
    assert await own.ensure(TOPIC, 2 + OFFSET_BLOCK) == 2 + 2 * OFFSET_BLOCK
    assert await own.ensure(TOPIC, 1000) == 1000 + OFFSET_BLOCK  # a big batch jumps at once


async def test_offsets_continue_across_owners_without_reuse(
    brokers: tuple[Broker, Broker], kv: KV
) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    next_offset = await a.offsets.start_offset(TOPIC)
    assigned_by_a = []
    for _ in range(150):  # a assigns offsets one by one, reserving ahead
        await a.offsets.ensure(TOPIC, next_offset + 1)
        assigned_by_a.append(next_offset)
        next_offset += 1

    lease = a.session.lease_id
    assert lease is not None
    await kv.revoke_lease(lease)  # a dies; b takes over
    assert (await b.ownership.acquire(TOPIC)).broker_id == "b"
    start = await b.offsets.start_offset(TOPIC)
    assert start > max(assigned_by_a)  # a gap, never a duplicate
    assert await b.offsets.ensure(TOPIC, start + 1) == start + 1 + OFFSET_BLOCK

    await eventually(lambda: a.lost == [TOPIC])
    assert not a.offsets.covered(TOPIC, 0)
    with pytest.raises(FencedError):
        await a.offsets.ensure(TOPIC, next_offset + 1)


async def test_only_the_owner_reserves(brokers: tuple[Broker, Broker]) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    with pytest.raises(FencedError):
        await b.offsets.start_offset(TOPIC)
    with pytest.raises(FencedError):
        await b.offsets.ensure(TOPIC, 1)
    assert not b.offsets.covered(TOPIC, 0)


async def test_a_new_acquisition_rereads_the_reservation(brokers: tuple[Broker, Broker]) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    assert await a.offsets.ensure(TOPIC, 5) == 5 + OFFSET_BLOCK
    await a.ownership.release(TOPIC)
    assert not a.offsets.covered(TOPIC, 1)
    await b.ownership.acquire(TOPIC)  # epoch 2 moves the reservation on
    assert await b.offsets.ensure(TOPIC, 5 + 2 * OFFSET_BLOCK) == 5 + 3 * OFFSET_BLOCK
    await b.ownership.release(TOPIC)
    await a.ownership.acquire(TOPIC)  # epoch 3: a must not trust what it cached at epoch 1
    assert not a.offsets.covered(TOPIC, 1)
    assert await a.offsets.ensure(TOPIC, 6) == 5 + 3 * OFFSET_BLOCK


async def test_own_last_reservation_continues_from_the_local_wal(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    assert await a.offsets.start_offset(TOPIC, local_next=0) == 0
    await a.offsets.ensure(TOPIC, 10)  # a assigns offsets 0..9
    await a.ownership.release(TOPIC)

    # a again (a restart with its WAL): nobody assigned offsets since, so no gap.
    await a.ownership.acquire(TOPIC)
    assert await a.offsets.start_offset(TOPIC, local_next=10) == 10
    assert a.offsets.covered(TOPIC, 11)
    # Without a local WAL for the topic, a cannot know where it stopped: the reservation.
    assert await a.offsets.start_offset(TOPIC) == 10 + OFFSET_BLOCK
    await a.ownership.release(TOPIC)

    # b reserves, then a comes back: a's WAL is stale, it must start after b's reservation.
    await b.ownership.acquire(TOPIC)
    start_b = await b.offsets.start_offset(TOPIC, local_next=None)
    await b.offsets.ensure(TOPIC, start_b + 1)
    await b.ownership.release(TOPIC)
    await a.ownership.acquire(TOPIC)
    assert await a.offsets.start_offset(TOPIC, local_next=10) == await stored_reservation(kv, keys)
