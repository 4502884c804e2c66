"""Takeover records: the previous owner's tail committed under a pending record, or the
broker declared lost (a recorded jump); neither can race the other."""

from __future__ import annotations

import json

import pytest

from danube_ingest.broker.errors import TakeoverPendingError
from danube_ingest.broker.takeover import TakeoverGate
from danube_ingest.metadata import KV, Keys, Manifest, ObjectRange
from danube_ingest.metadata.handover import (
    LOST,
    PENDING,
    RECOVERED,
    BrokerAliveError,
    Handover,
    begin_handover,
    clear_forgotten,
    commit_tail,
    forget_broker,
    is_forgotten,
    list_handovers,
    read_handover,
    resolve_recovered,
)
from danube_ingest.metadata.jumps import read_jumps

from .conftest import OFFSET_BLOCK, Broker

TOPIC = "/default/orders"


def _range(start: int, end: int, broker: str = "a", seq: int = 0) -> ObjectRange:
    return ObjectRange(
        topic=TOPIC,
        object_key=f"segments/{broker}/0/{seq:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=16,
        byte_length=end - start,
        object_size=1 << 20,
        object_crc=0xE3069283,
        first_ingest_ms=1_700_000_000_000 + start,
        last_ingest_ms=1_700_000_000_000 + end,
        kind="segment",
    )


async def _taken_over(kv: KV, keys: Keys, a: Broker, b: Broker) -> tuple[Handover, int]:
    """A owns the topic, reserves a block and commits [0, 10); then B owns it and records
    that it waits for A's tail. Returns (the record, A's reservation end)."""
    manifest = Manifest(kv, keys)
    await a.ownership.acquire(TOPIC)
    reserved = await a.offsets.ensure(TOPIC, 25)
    assert (await manifest.commit(a.ownership, [_range(0, 10)])).committed
    await a.ownership.release(TOPIC)
    owner = await b.ownership.acquire(TOPIC)
    assert owner.broker_id == "b"
    assert await b.offsets.start_offset(TOPIC) == reserved
    assert b.offsets.previous(TOPIC) == (reserved, "a")
    record, _ = await begin_handover(
        b.ownership, TOPIC, previous="a", committed=10, reserved=reserved
    )
    assert (record.state, record.owner, record.epoch) == (PENDING, "b", owner.epoch)
    return record, reserved


async def test_the_previous_owners_tail_is_committed_under_the_record(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    manifest = Manifest(kv, keys)
    record, reserved = await _taken_over(kv, keys, a, b)
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None and found[0] == record
    _, stored = found
    # Only the broker the record names, and only a range that continues the manifest.
    assert not await commit_tail(manifest, stored, [_range(10, 25, "b")], "b")
    assert not await commit_tail(manifest, stored, [_range(12, 25, seq=1)], "a")
    assert await manifest.end_offset(TOPIC) == 10
    tail = [_range(10, 18, seq=1), _range(18, 25, seq=2)]
    assert await commit_tail(manifest, stored, tail, "a")
    assert await commit_tail(manifest, stored, tail[:1], "a")  # a re-run: already there
    ranges = await manifest.ranges(TOPIC)
    assert [(r.start_offset, r.end_offset, r.broker) for r in ranges] == [
        (0, 10, "a"),
        (10, 18, "a"),
        (18, 25, "a"),
    ]
    assert {r.epoch for r in ranges[1:]} == {record.epoch}
    done = await resolve_recovered(manifest, stored)
    assert done is not None and (done.state, done.end) == (RECOVERED, 25)
    # Resolved once: the old value no longer matches, so neither a second resolution nor a
    # forget changes it.
    assert await resolve_recovered(manifest, stored) is None
    await a.close()
    assert await forget_broker(kv, keys, "a") == []
    assert [r for r, _ in await list_handovers(kv, keys)] == [done]
    # The new owner continues at 25 and makes the reservation its own (no wait next time).
    await b.offsets.adopt(TOPIC, 25)
    assert b.offsets.previous(TOPIC) == (reserved, "b")
    assert await read_jumps(kv, keys, TOPIC) == []


async def test_a_forgotten_brokers_range_is_recorded_lost_and_never_committed(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    manifest = Manifest(kv, keys)
    record, reserved = await _taken_over(kv, keys, a, b)
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None
    _, pending = found
    with pytest.raises(BrokerAliveError, match="broker a is alive"):
        await forget_broker(kv, keys, "a")
    await a.session.close()  # gone: its registration with it
    [lost] = await forget_broker(kv, keys, "a")
    assert (lost.state, lost.end, lost.lost_offsets) == (LOST, reserved, reserved - 10)
    [jump] = await read_jumps(kv, keys, TOPIC)
    assert (jump.start, jump.end, jump.broker, jump.reason, jump.epoch) == (
        10,
        reserved,
        "a",
        "lost",
        record.epoch,
    )
    assert await forget_broker(kv, keys, "a") == []  # idempotent
    # A, back with the pending record it read before, or reading it now, cannot commit into
    # the lost range.
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None
    current, stored = found
    assert current == lost
    assert not await commit_tail(manifest, pending, [_range(10, 25, seq=1)], "a")
    assert not await commit_tail(manifest, stored, [_range(10, 25, seq=1)], "a")
    assert await manifest.end_offset(TOPIC) == 10
    assert reserved == 25 + OFFSET_BLOCK


async def test_a_takeover_that_begins_after_forget_skips_at_once(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    manifest = Manifest(kv, keys)
    await a.ownership.acquire(TOPIC)
    reserved = await a.offsets.ensure(TOPIC, 25)
    assert (await manifest.commit(a.ownership, [_range(0, 10)])).committed
    await a.ownership.release(TOPIC)
    await a.session.close()
    assert await forget_broker(kv, keys, "a") == []  # nobody waits yet
    assert await is_forgotten(kv, keys, "a")
    # B takes the topic over only now: it records the wait and resolves it lost at once.
    await b.ownership.acquire(TOPIC)
    await b.offsets.start_offset(TOPIC)
    gate = TakeoverGate(b.ownership, b.offsets)
    record = await gate.check(TOPIC, 10)
    assert record is not None and (record.state, record.end) == (LOST, reserved)
    [jump] = await read_jumps(kv, keys, TOPIC)
    assert (jump.start, jump.end, jump.broker, jump.reason) == (10, reserved, "a", "lost")
    # A broker that starts again is no longer forgotten: takeovers from it wait again.
    await clear_forgotten(kv, keys, "a")
    assert not await is_forgotten(kv, keys, "a")


async def test_the_gate_waits_while_pending_and_continues_at_the_recovered_end(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    manifest = Manifest(kv, keys)
    await a.ownership.acquire(TOPIC)
    reserved = await a.offsets.ensure(TOPIC, 25)
    assert (await manifest.commit(a.ownership, [_range(0, 10)])).committed
    await a.ownership.release(TOPIC)
    await b.ownership.acquire(TOPIC)
    await b.offsets.start_offset(TOPIC)
    gate = TakeoverGate(b.ownership, b.offsets)
    for _ in range(2):  # the record is written once, then found again
        with pytest.raises(TakeoverPendingError, match="waits for broker a") as refused:
            await gate.check(TOPIC, 10)
        assert refused.value.retriable
    [(record, stored)] = await list_handovers(kv, keys)
    assert (record.committed, record.reserved) == (10, reserved)
    assert await commit_tail(manifest, stored, [_range(10, 20, seq=1)], "a")
    assert await resolve_recovered(manifest, stored) is not None
    done = await gate.check(TOPIC, 20)
    assert done is not None and (done.state, done.end) == (RECOVERED, 20)
    await b.offsets.adopt(TOPIC, 20)
    assert await gate.check(TOPIC, 20) is None  # the reservation is B's now


async def test_the_record_names_the_wal_the_previous_owner_reserved_under(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    a.offsets.wal_id = "wal-of-a"
    b.offsets.wal_id = "wal-of-b"
    await a.ownership.acquire(TOPIC)
    reserved = await a.offsets.ensure(TOPIC, 25)
    await a.ownership.release(TOPIC)
    await b.ownership.acquire(TOPIC)
    await b.offsets.start_offset(TOPIC)
    assert b.offsets.previous_wal_id(TOPIC) == "wal-of-a"
    gate = TakeoverGate(b.ownership, b.offsets)
    with pytest.raises(TakeoverPendingError):
        await gate.check(TOPIC, 0)
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None
    record, stored = found
    assert (record.previous, record.reserved, record.previous_wal_id) == ("a", reserved, "wal-of-a")
    # Records written before the WAL was named read as "not recorded", and encode as before.
    old = json.loads(stored.value)
    del old["previous_wal_id"]
    legacy = Handover.decode(TOPIC, json.dumps(old).encode(), stored.key)
    assert legacy.previous_wal_id is None
    assert json.loads(legacy.encode()) == old
    # The new owner's own reservation carries its WAL from now on.
    await b.offsets.adopt(TOPIC, 0)
    stored_reservation = await kv.get(keys.topic_offsets(TOPIC))
    assert stored_reservation is not None
    assert json.loads(stored_reservation.value)["wal_id"] == "wal-of-b"
