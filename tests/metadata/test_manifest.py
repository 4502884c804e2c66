"""The object manifest: entries, fenced idempotent commits of many topics, rotation swaps."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from danube_ingest.metadata import (
    KV,
    EtcdKV,
    FencedError,
    InvalidRangeError,
    Keys,
    KeyValue,
    Manifest,
    ManifestConflictError,
    MemoryKV,
    MetadataError,
    ObjectRange,
    Retired,
    retired_objects,
)

from .conftest import Broker
from .test_ownership import OtherProcess

T, U = "/default/orders", "/other/events"


def seg(
    topic: str, start: int, end: int, *, seq: int = 1, entries: int | None = None
) -> ObjectRange:
    """A range of a segment object, as the uploader builds it (no broker or epoch yet)."""
    return ObjectRange(
        topic=topic,
        object_key=f"segments/a/0/{seq:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start if entries is None else entries,
        byte_start=16 + start,
        byte_length=end - start,
        object_size=1 << 20,
        object_crc=0xE3069283,
        first_ingest_ms=1_700_000_000_000 + start,
        last_ingest_ms=1_700_000_000_000 + end,
        kind="segment",
    )


def merged(*parts: ObjectRange) -> ObjectRange:
    """The rotation output holding ``parts`` (one topic, in order)."""
    first, last = parts[0], parts[-1]
    return dataclasses.replace(
        first,
        object_key=f"topics/x/data-1-{first.start_offset:020d}-{last.end_offset:020d}.bin",
        end_offset=last.end_offset,
        entries=sum(p.entries for p in parts),
        byte_start=0,
        byte_length=sum(p.byte_length for p in parts),
        last_ingest_ms=last.last_ingest_ms,
        kind="topic",
        broker="rotation",
    )


def stamped(entry: ObjectRange, broker: str = "a", epoch: int = 1) -> ObjectRange:
    return dataclasses.replace(entry, broker=broker, epoch=epoch)


async def snapshot(kv: KV, keys: Keys) -> list[KeyValue]:
    """Every manifest key with its revisions: equal snapshots mean nothing was written."""
    return await kv.get_prefix(f"{keys.prefix}/storage/")


@pytest.fixture
def manifest(kv: KV, keys: Keys) -> Manifest:
    return Manifest(kv, keys)


async def own(broker: Broker, *topics: str) -> None:
    for topic in topics:
        owner = await broker.ownership.acquire(topic)
        assert owner.broker_id == broker.session.broker_id


# ObjectRange


def test_encode_decode_round_trip() -> None:
    entry = stamped(seg(T, 100, 250, entries=120), epoch=7)
    data = entry.encode()
    assert b" " not in data  # compact
    assert json.loads(data)["topic"] == T
    assert ObjectRange.decode(
        data, f"/danube/storage/topics/default/orders/objects/{100:020d}"
    ) == (entry)
    assert seg(T, 0, 1).encode() == seg(T, 0, 1).encode()  # deterministic: CAS compares bytes


def test_decode_ignores_unknown_fields() -> None:
    raw = json.loads(seg(T, 0, 10).encode()) | {"added_later": 1}
    key = f"/p/x/{0:020d}"
    assert ObjectRange.decode(json.dumps(raw).encode(), key) == seg(T, 0, 10)


@pytest.mark.parametrize(
    "change",
    [
        {"end_offset": "20"},
        {"entries": True},
        {"start_offset": -1},
        {"end_offset": 0},
        {"entries": 11},
        {"kind": "parquet"},
        {"topic": "orders"},
        {"object_crc": 1 << 32},
        {"byte_length": 1 << 21},
        {"first_ingest_ms": 2_000_000_000_000},
    ],
)
def test_decode_rejects_bad_fields_naming_the_key(change: dict[str, object]) -> None:
    raw = json.loads(seg(T, 0, 10).encode()) | change
    with pytest.raises(MetadataError, match="objects/00000000000000000000"):
        ObjectRange.decode(json.dumps(raw).encode(), f"/p/objects/{0:020d}")


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"\xff", b'{"topic": "/a/b"}'])
def test_decode_rejects_malformed_values(data: bytes) -> None:
    with pytest.raises(MetadataError, match="malformed manifest entry at /p/objects/7"):
        ObjectRange.decode(data, "/p/objects/7")


def test_decode_rejects_a_key_that_does_not_match_the_start() -> None:
    with pytest.raises(MetadataError, match="key does not match"):
        ObjectRange.decode(seg(T, 5, 10).encode(), f"/p/objects/{4:020d}")


def test_invalid_ranges_cannot_be_built() -> None:
    with pytest.raises(InvalidRangeError, match="end offset"):
        seg(T, 10, 10)
    with pytest.raises(InvalidRangeError, match="entries"):
        seg(T, 0, 10, entries=0)


# reads


async def test_ranges_and_end_offset(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV
) -> None:
    a, _ = brokers
    assert await manifest.ranges(T) == []
    assert await manifest.end_offset(T) == 0
    await own(a, T)
    # Offsets 300-399 never existed (a takeover's reservation gap): a gap between entries.
    given = [seg(T, 400, 450, seq=3), seg(T, 0, 100, seq=1), seg(T, 100, 300, seq=2)]
    result = await manifest.commit(a.ownership, given)
    assert sorted(result.committed, key=lambda r: r.start_offset) == [
        stamped(seg(T, 0, 100, seq=1)),
        stamped(seg(T, 100, 300, seq=2)),
        stamped(seg(T, 400, 450, seq=3)),
    ]
    assert [r.start_offset for r in await manifest.ranges(T)] == [0, 100, 400]
    assert [r.start_offset for r in await manifest.ranges(T, 100)] == [100, 400]
    assert [r.start_offset for r in await manifest.ranges(T, 299)] == [100, 400]
    assert [r.start_offset for r in await manifest.ranges(T, 300)] == [400]
    assert await manifest.ranges(T, 450) == []
    assert await manifest.end_offset(T) == 450
    assert await manifest.ranges(U) == []


async def test_reads_report_overlapping_or_foreign_entries(
    manifest: Manifest, kv: KV, keys: Keys
) -> None:
    await kv.put(keys.storage_object(T, 0), seg(T, 0, 100).encode())
    await kv.put(keys.storage_object(T, 50), seg(T, 50, 150).encode())
    with pytest.raises(ManifestConflictError, match="overlapping entries"):
        await manifest.ranges(T)
    await kv.put(keys.storage_object(U, 0), seg(T, 0, 100).encode())
    with pytest.raises(MetadataError, match="belongs to /default/orders"):
        await manifest.end_offset(U)


# commit


async def test_commit_of_many_topics_takes_few_transactions(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    topics = [f"/load/t{i:03d}" for i in range(120)]
    await own(a, *topics)
    given = [seg(t, 1000, 1000 + i + 1, seq=9) for i, t in enumerate(topics)]
    result = await manifest.commit(a.ownership, given)
    assert (result.already, result.fenced) == ([], [])
    assert result.committed == [stamped(r) for r in given]
    for entry in given:
        assert await manifest.ranges(entry.topic) == [stamped(entry)]
    stored = await snapshot(kv, keys)
    assert len(stored) == 120
    # 50 topics per transaction (each transaction has one revision): 50 + 50 + 20.
    assert sorted(Counter(kv.mod_revision for kv in stored).values()) == [20, 50, 50]


async def test_a_long_backlog_of_one_topic_is_split_below_the_txn_limit(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T, U)
    given = [seg(T, i * 10, i * 10 + 10, seq=i) for i in range(150)] + [seg(U, 0, 5)]
    result = await manifest.commit(a.ownership, given)
    assert len(result.committed) == 151
    assert await manifest.end_offset(T) == 1500
    stored = await snapshot(kv, keys)
    assert sorted(Counter(kv.mod_revision for kv in stored).values()) == [52, 99]


async def test_rerun_is_already_and_writes_nothing(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    topics = [f"/load/t{i:03d}" for i in range(60)]
    await own(a, *topics)
    given = [seg(t, 0, 10) for t in topics]
    first = await manifest.commit(a.ownership, given)
    assert len(first.committed) == 60
    before = await snapshot(kv, keys)
    again = await manifest.commit(a.ownership, given)
    assert again.committed == [] and again.fenced == []
    assert sorted(again.already, key=lambda r: r.topic) == given
    assert await snapshot(kv, keys) == before  # same values and revisions


async def test_rerun_after_later_ranges_were_added(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T, U)
    await manifest.commit(a.ownership, [seg(T, 0, 100, seq=1), seg(U, 0, 100, seq=1)])
    await manifest.commit(a.ownership, [seg(T, 100, 200, seq=2)])
    # The uploader restarts and re-commits everything it is not sure about, plus new ranges.
    result = await manifest.commit(
        a.ownership,
        [
            seg(T, 0, 100, seq=1),
            seg(U, 0, 100, seq=1),
            seg(T, 100, 200, seq=2),
            seg(T, 200, 300, seq=3),
            seg(U, 100, 150, seq=3),
        ],
    )
    assert sorted(r.span() for r in result.already) == sorted(
        [seg(T, 0, 100).span(), seg(U, 0, 100).span(), seg(T, 100, 200, seq=2).span()]
    )
    assert result.committed == [stamped(seg(T, 200, 300, seq=3)), stamped(seg(U, 100, 150, seq=3))]
    assert [r.end_offset for r in await manifest.ranges(T)] == [100, 200, 300]
    assert [r.end_offset for r in await manifest.ranges(U)] == [100, 150]


async def test_rerun_after_rotation_is_already(
    brokers: tuple[Broker, Broker], manifest: Manifest
) -> None:
    a, _ = brokers
    await own(a, T)
    parts = [seg(T, 0, 100, seq=1), seg(T, 100, 200, seq=2)]
    committed = (await manifest.commit(a.ownership, parts)).committed
    assert await manifest.replace(None, committed, [merged(*committed)])
    result = await manifest.commit(a.ownership, parts)
    assert result.already == parts and result.committed == []
    assert await manifest.ranges(T) == [merged(*committed)]


async def test_partial_overlap_is_a_conflict(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T, U)
    await manifest.commit(a.ownership, [seg(T, 0, 100)])
    before = await snapshot(kv, keys)
    with pytest.raises(ManifestConflictError, match=r"/default/orders\[0, 150\)"):
        await manifest.commit(a.ownership, [seg(T, 0, 150, seq=2), seg(U, 0, 10, seq=2)])
    assert await snapshot(kv, keys) == before  # nothing of that transaction was written


async def test_overlapping_ranges_in_one_call_are_rejected(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T)
    with pytest.raises(InvalidRangeError, match="overlap"):
        await manifest.commit(a.ownership, [seg(T, 0, 100), seg(T, 50, 60, seq=2)])
    with pytest.raises(InvalidRangeError, match="overlap"):
        await manifest.commit(a.ownership, [seg(T, 0, 100), seg(T, 0, 100)])
    assert await snapshot(kv, keys) == []


async def test_a_lost_topic_is_fenced_and_the_others_committed(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, b = brokers
    topics = [f"/load/t{i}" for i in range(5)]
    await own(a, *topics)
    given = [seg(t, 0, 10) for t in topics]
    await manifest.commit(a.ownership, given[:1])  # so one failure has two causes
    lost = topics[2]
    # lost is handed over behind a's back: its owner key deleted, b takes it with epoch 2.
    await kv.delete(keys.topic_owner(lost))
    assert (await b.ownership.acquire(lost)).epoch == 2
    result = await manifest.commit(a.ownership, given)
    assert result.fenced == [lost] and result.already == given[:1]
    assert result.committed == [stamped(r) for r in given[1:] if r.topic != lost]
    assert await manifest.ranges(lost) == []
    assert a.lost == [lost]
    assert (await manifest.commit(b.ownership, [seg(lost, 0, 10)])).committed == [
        stamped(seg(lost, 0, 10), "b", 2)
    ]


async def test_commit_holding_nothing_is_all_fenced(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, b = brokers
    await own(a, T)
    result = await manifest.commit(b.ownership, [seg(T, 0, 10), seg(U, 0, 10), seg(T, 10, 20)])
    assert result.fenced == [T, U] and result.committed == result.already == []
    assert await snapshot(kv, keys) == []
    assert b.lost == []


@pytest.mark.etcd
async def test_a_stale_owner_is_fenced_by_the_transaction(etcd_server: str, keys: Keys) -> None:
    """Broker a freezes; its lease is revoked and b takes a topic over and commits. When a
    resumes it still believes it owns both topics: only the commit's compare stops it."""
    kv_a = await EtcdKV.connect([etcd_server], timeout=5)
    a = await Broker(kv_a, keys, "a", ttl=10).start()
    manifest = Manifest(kv_a, keys)
    await own(a, T, U)
    a_lease = a.session.lease_id
    assert a_lease is not None
    other = OtherProcess()

    async def b_takes_over() -> Broker:
        kv_b = await EtcdKV.connect([etcd_server], timeout=5)
        await kv_b.revoke_lease(a_lease)
        b = await Broker(kv_b, keys, "b").start()
        await own(b, T)
        committed = await Manifest(kv_b, keys).commit(b.ownership, [seg(T, 0, 10, seq=5)])
        assert len(committed.committed) == 1
        return b

    async def b_closes(b: Broker) -> None:
        await b.close()
        await b.session.kv.close()

    try:
        b = other.run(b_takes_over())  # a is frozen meanwhile
        assert a.ownership.is_owner(T) and a.ownership.is_owner(U)  # a's stale view
        result = await manifest.commit(a.ownership, [seg(T, 0, 10), seg(U, 0, 10)])
        assert sorted(result.fenced) == [T, U] and result.committed == []
        assert sorted(a.lost) == [T, U]
        assert await manifest.ranges(T) == [stamped(seg(T, 0, 10, seq=5), "b", 2)]
        assert await manifest.ranges(U) == []
        other.run(b_closes(b))
    finally:
        other.stop()
        await a.close()
        await kv_a.close()


# replace (rotation)


async def test_replace_swaps_entries_atomically(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T)
    parts = [seg(T, 0, 100, seq=1), seg(T, 100, 250, seq=2), seg(T, 250, 300, seq=3)]
    old = (await manifest.commit(a.ownership, parts)).committed
    new = merged(old[0], old[1])
    assert await manifest.replace(None, old[:2], [new], now_ms=1234)
    assert await manifest.ranges(T) == [new, old[2]]
    stored = await snapshot(kv, keys)
    # The two entries left, and (same transaction) the retirement records of the objects
    # that only the replaced entries named.
    assert [s.key for s in stored] == [
        keys.storage_retired(old[0].object_key),
        keys.storage_retired(old[1].object_key),
        keys.storage_object(T, 0),
        keys.storage_object(T, 250),
    ]
    assert len({s.mod_revision for s in stored[:3]}) == 1
    assert await retired_objects(kv, keys) == {
        o.object_key: Retired(o.object_key, 1234) for o in old[:2]
    }
    # The same swap again: its old entries are gone, so it fails and changes nothing.
    assert not await manifest.replace(None, old[:2], [new])
    assert await snapshot(kv, keys) == stored


async def test_replace_may_split_differently(
    brokers: tuple[Broker, Broker], manifest: Manifest
) -> None:
    a, _ = brokers
    await own(a, T)
    old = (await manifest.commit(a.ownership, [seg(T, 0, 100), seg(T, 100, 200)])).committed
    whole = merged(*old)
    new = [
        dataclasses.replace(whole, end_offset=50, entries=50, byte_length=50),
        dataclasses.replace(whole, start_offset=50, entries=150, byte_length=150),
    ]
    assert await manifest.replace(None, old, new)
    assert await manifest.ranges(T) == new


async def test_replace_fails_cleanly_when_an_old_entry_changed(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T)
    old = (await manifest.commit(a.ownership, [seg(T, 0, 100), seg(T, 100, 200)])).committed
    changed = dataclasses.replace(old[1], object_key="segments/a/0/repaired.bin")
    await kv.put(keys.storage_object(T, 100), changed.encode())
    before = await snapshot(kv, keys)
    assert not await manifest.replace(None, old, [merged(*old)])
    assert await snapshot(kv, keys) == before


async def test_replace_fails_when_a_new_key_appeared(
    brokers: tuple[Broker, Broker], manifest: Manifest, kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await own(a, T)
    old = (await manifest.commit(a.ownership, [seg(T, 0, 100)])).committed
    new = [
        dataclasses.replace(old[0], end_offset=50, entries=50, byte_length=50),
        dataclasses.replace(old[0], start_offset=50, entries=50, byte_length=50),
    ]
    await kv.put(keys.storage_object(T, 50), new[1].encode())  # e.g. a concurrent swap
    before = await snapshot(kv, keys)
    assert not await manifest.replace(None, old, new)
    assert await snapshot(kv, keys) == before


async def test_replace_fenced_by_an_owner(
    brokers: tuple[Broker, Broker], manifest: Manifest
) -> None:
    a, b = brokers
    await own(a, T)
    old = (await manifest.commit(a.ownership, [seg(T, 0, 100), seg(T, 100, 200)])).committed
    with pytest.raises(FencedError):
        await manifest.replace(b.ownership, old, [merged(*old)])
    assert await manifest.replace(a.ownership, old, [merged(*old)])


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ([seg(T, 0, 100)], [seg(T, 0, 90)], "cover exactly"),
        ([seg(T, 0, 100), seg(T, 200, 300)], [seg(T, 0, 300, entries=200)], "cover exactly"),
        ([seg(T, 0, 100)], [seg(T, 0, 100, entries=99)], "hold 99 entries"),
        ([seg(T, 0, 100)], [seg(U, 0, 100)], "one topic"),
        ([seg(T, 0, 100), seg(T, 50, 60)], [seg(T, 0, 100)], "overlap"),
        ([], [seg(T, 0, 100)], "needs old and new"),
    ],
)
async def test_replace_rejects_swaps_that_change_what_is_stored(
    old: list[ObjectRange], new: list[ObjectRange], match: str
) -> None:
    with pytest.raises(InvalidRangeError, match=match):
        await Manifest(MemoryKV(), Keys()).replace(None, old, new)
