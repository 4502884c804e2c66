"""``apply_retention`` on the real etcd, over memory, fs and s3: exactly the expired ranges
leave the manifest, the floor rises with them, and their objects go after orphan collection."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from danube_ingest.errors import OffsetOutOfRangeError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.kv import Delete, MemoryKV
from danube_ingest.metadata.manifest import Manifest, ObjectRange, retired_objects
from danube_ingest.metadata.policies import (
    InvalidPolicyError,
    Policies,
    RetentionPolicy,
    effective,
)
from danube_ingest.objects.orphans import collect_orphans, manifest_integrity
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.retention import apply_retention, expired_prefix
from danube_ingest.objects.store import ObjectStore

from .test_orphans import HOUR_MS, Topic
from .test_reader import T

pytestmark = pytest.mark.etcd


@pytest.fixture
async def owner(etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore) -> AsyncIterator[Topic]:
    t = await Topic(etcd_kv, keys, object_store).start()
    yield t
    await t.close()


KEYS = [f"segments/b/r0/{seq:020d}.bin" for seq in range(1, 5)]


async def _four_ranges(owner: Topic) -> list[ObjectRange]:
    """Ranges [0,100) .. [300,400) of ``T`` in four objects; ingest times 1000 + offset."""
    ranges = []
    for i, key in enumerate(KEYS):
        rng = await owner.put(key, i * 100, (i + 1) * 100)
        await owner.commit(rng)
        ranges.append(rng)
    return ranges


def _starts(entries: list[ObjectRange]) -> list[int]:
    return [r.start_offset for r in entries]


async def test_by_time_removes_exactly_the_expired_and_collection_deletes_them(
    owner: Topic,
) -> None:
    await _four_ranges(owner)
    now = int(time.time() * 1000)
    # Cut-off at ingest time 1200: the ranges whose last entry (1099, 1199) is older expire.
    await Policies(owner.kv, owner.keys).set("/default", RetentionPolicy(max_age_ms=now - 1200))

    report = await apply_retention(owner.kv, owner.keys, now_ms=now)

    [done] = report.topics
    assert _starts(done.expired) == [0, 100] and done.reason == "max_age"
    assert done.floor == 200 and done.expired_bytes == sum(r.byte_length for r in done.expired)
    assert _starts(await owner.manifest.ranges(T)) == [200, 300]
    floor = await owner.manifest.floor(T)
    assert floor is not None and (floor.offset, floor.expired_ms) == (200, now)
    assert sorted(await retired_objects(owner.kv, owner.keys)) == KEYS[:2]

    again = await apply_retention(owner.kv, owner.keys, now_ms=now)
    assert again.expired == 0 and again.topics[0].floor == 200
    assert _starts(await owner.manifest.ranges(T)) == [200, 300]

    gc = await collect_orphans(owner.kv, owner.keys, owner.objects, now_ms=now + 2 * HOUR_MS)
    assert sorted(gc.deleted) == KEYS[:2]
    assert sorted(await owner.objects.list("segments/")) == KEYS[2:]
    assert await retired_objects(owner.kv, owner.keys) == {}
    # Offsets below the retained floor are no gap: the manifest checks still pass.
    integrity = await manifest_integrity(owner.kv, owner.keys, owner.objects, deep=True)
    assert integrity.ok and integrity.gaps == 0, integrity.problems


async def test_by_bytes_topic_over_namespace(owner: Topic) -> None:
    ranges = await _four_ranges(owner)
    policies = Policies(owner.kv, owner.keys)
    now = int(time.time() * 1000)
    # The namespace would expire everything by age; the topic's own age keeps it all, and
    # its namespace's byte limit (kept: it sets no bytes of its own) keeps the newest two.
    await policies.set("/default", RetentionPolicy(max_age_ms=1, max_bytes=1))
    await policies.set(T, RetentionPolicy(max_age_ms=now))
    last_two = sum(r.byte_length for r in ranges[2:])
    await policies.set("/default", RetentionPolicy(max_bytes=last_two))

    report = await apply_retention(owner.kv, owner.keys, now_ms=now)

    [done] = report.topics
    assert done.policy == RetentionPolicy(max_age_ms=now, max_bytes=last_two)
    assert _starts(done.expired) == [0, 100] and done.reason == "max_bytes"
    assert done.kept_bytes == last_two
    assert _starts(await owner.manifest.ranges(T)) == [200, 300]
    assert (await apply_retention(owner.kv, owner.keys, now_ms=now)).expired == 0


async def test_no_policy_keeps_everything(owner: Topic) -> None:
    await _four_ranges(owner)
    report = await apply_retention(owner.kv, owner.keys, now_ms=10**15)
    assert report.topics == [] and len(await owner.manifest.ranges(T)) == 4
    assert await owner.manifest.floor(T) is None


async def test_remove_compares_the_exact_entries_and_keeps_the_floor_rising(owner: Topic) -> None:
    ranges = await _four_ranges(owner)
    stale = dataclasses.replace(ranges[0], entries=99)
    assert not await owner.manifest.remove([stale], 5)
    assert len(await owner.manifest.ranges(T)) == 4 and await owner.manifest.floor(T) is None
    stored = await owner.manifest.ranges(T)
    assert await owner.manifest.remove(stored[1:2], 5)
    assert await owner.manifest.remove(stored[0:1], 6)  # below the floor: it never falls
    floor = await owner.manifest.floor(T)
    assert floor is not None and (floor.offset, floor.expired_ms) == (200, 6)


async def test_cold_reader_below_the_floor_names_it(owner: Topic) -> None:
    await _four_ranges(owner)
    stored = await owner.manifest.ranges(T)
    assert await owner.manifest.remove(stored[:2], 5)
    cursor = CloudReader(owner.manifest, owner.objects).cursor(T)
    with pytest.raises(OffsetOutOfRangeError) as caught:
        await cursor.read(50, 10)
    assert (caught.value.offset, caught.value.first_offset) == (50, 200)
    batch, reached = await cursor.read(200, 10)
    assert [e.offset for e in batch] == list(range(200, 210)) and reached == 210


def test_expired_prefix_and_effective_policy() -> None:
    def rng(start: int, last_ms: int, size: int) -> ObjectRange:
        return ObjectRange(T, "k", start, start + 10, 10, 0, size, size, 0, 0, last_ms, "segment")

    entries = [rng(0, 100, 10), rng(10, 200, 10), rng(20, 300, 10)]
    assert expired_prefix(entries, RetentionPolicy(), 10**6) == (0, "")
    assert expired_prefix(entries, RetentionPolicy(max_age_ms=140), 350) == (2, "max_age")
    assert expired_prefix(entries, RetentionPolicy(max_bytes=15), 0) == (2, "max_bytes")
    both = RetentionPolicy(max_age_ms=220, max_bytes=5)
    assert expired_prefix(entries, both, 350) == (3, "max_age,max_bytes")
    stored = {
        "/default": RetentionPolicy(max_age_ms=5, max_bytes=6),
        T: RetentionPolicy(max_age_ms=7),
    }
    default = RetentionPolicy(max_bytes=1, table_max_age_ms=9)
    assert effective(T, stored, default) == RetentionPolicy(7, 6, 9)
    assert effective("/other/t", stored, default) == default


async def test_policies_store_and_reject_bad_values() -> None:
    policies = Policies(MemoryKV(), Keys())
    with pytest.raises(InvalidPolicyError, match="max_age_ms must be a positive integer"):
        RetentionPolicy(max_age_ms=0)
    await policies.set("/ns", RetentionPolicy(max_age_ms=5))
    assert await policies.set("/ns", RetentionPolicy(max_bytes=7)) == RetentionPolicy(5, 7)
    await policies.set("/ns/t", RetentionPolicy(table_max_age_ms=3))
    assert await policies.all() == {
        "/ns": RetentionPolicy(5, 7),
        "/ns/t": RetentionPolicy(table_max_age_ms=3),
    }
    assert await policies.clear("/ns") and not await policies.clear("/ns")
    with pytest.raises(ValueError, match="expected '/namespace' or '/namespace/topic'"):
        await policies.get("ns")


class _RotatingKV(MemoryKV):
    """A MemoryKV on which a rotation lands right before the first removal transaction."""

    rotate: ObjectRange | None = None

    async def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        old = self.rotate
        if old is not None and any(isinstance(op, Delete) for op in success):
            self.rotate = None
            new = dataclasses.replace(old, object_key="topics/default/rolled/x.bin", kind="topic")
            assert await Manifest(self, Keys()).replace(None, [old], [new], now_ms=1)
        return await super().txn(compares, success, failure)


async def test_a_rotation_landing_first_makes_retention_plan_again() -> None:
    kv = _RotatingKV()
    manifest = Manifest(kv, Keys())
    ranges = [
        ObjectRange(T, f"k{i}", i * 10, i * 10 + 10, 10, 0, 5, 5, 0, 0, 100 + i, "segment")
        for i in range(3)
    ]
    for rng in ranges:
        await kv.put(manifest.key(rng), rng.encode())
    kv.rotate = ranges[0]
    await Policies(kv, Keys()).set(T, RetentionPolicy(max_age_ms=10))
    report = await apply_retention(kv, Keys(), now_ms=112)  # expires last ingest < 102
    [done] = report.topics
    assert [(r.start_offset, r.object_key) for r in done.expired] == [
        (0, "topics/default/rolled/x.bin"),
        (10, "k1"),
    ]
    assert _starts(await manifest.ranges(T)) == [20] and done.floor == 20
    assert sorted(await retired_objects(kv, Keys())) == ["k0", "k1", "topics/default/rolled/x.bin"]
