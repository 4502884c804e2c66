"""Rotation into rolling topic objects: planning, the bound on manifest entries, crashes and
races, readers during the swap. Real etcd; memory, fs and s3 (moto) object stores."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.errors import RotationError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import ClockMark, ClockWriter, TopicClock
from danube_ingest.metadata.kv import Compare, TxnOp, TxnResult
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import parse_object
from danube_ingest.objects.orphans import collect_orphans, manifest_integrity, referenced_objects
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.rotation import (
    MAX_GROUP_RANGES,
    RotationLimits,
    plan_ranges,
    plan_rotation,
    rolling_key,
    rotate_group,
    rotate_topic,
    rotation_candidates,
)
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import OBJECT_REFRESH_SECONDS

from .test_orphans import Topic
from .test_reader import T

pytestmark = pytest.mark.etcd

HOUR_MS = 3_600_000
PER = 10
"""Offsets per seeded segment range; entry ``o`` is ingested at ``1000 + o`` ms."""
#: Four seeded ranges per rolling object: 40 offsets are 40 ms of ingest time.
LIMITS = RotationLimits(max_object_seconds=0.039, frame_bytes=4096)


def _range(start: int, end: int, *, size: int = 100, kind: str = "segment") -> ObjectRange:
    return ObjectRange(
        topic=T,
        object_key=f"segments/b/r0/{start:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=8,
        byte_length=size,
        object_size=size + 100,
        object_crc=0,
        first_ingest_ms=1000 + start,
        last_ingest_ms=1000 + end - 1,
        kind=kind,  # type: ignore[arg-type]
    )


def _chain(n: int, *, start: int = 0, size: int = 100) -> list[ObjectRange]:
    return [_range(start + i * PER, start + (i + 1) * PER, size=size) for i in range(n)]


def _spans(plan: Any) -> list[tuple[int, int, str]]:
    return [(g.start, g.end, g.closed_by) for g in plan.groups]


# -- planning (pure) -------------------------------------------------------------------


def test_plan_packs_by_bytes_and_leaves_the_tail_until_it_is_old() -> None:
    limits = RotationLimits(max_object_bytes=350, max_object_seconds=3600)
    young = TopicClock(offset=110, ingest_ms=2000)
    plan = plan_ranges(T, _chain(11), young, limits)
    assert _spans(plan) == [(0, 30, "full"), (30, 60, "full"), (60, 90, "full")]
    # Every later entry is more than an hour younger than the tail's first: it is closed.
    old = TopicClock(offset=110, ingest_ms=1000 + 90 + HOUR_MS + 1)
    assert _spans(plan_ranges(T, _chain(11), old, limits))[-1] == (90, 110, "age")
    # A closed tail of one range is below min_ranges: left alone.
    old = TopicClock(offset=100, ingest_ms=1000 + 90 + HOUR_MS + 1)
    assert len(plan_ranges(T, _chain(10), old, limits).groups) == 3


def test_plan_merges_only_below_the_clock_offset() -> None:
    limits = RotationLimits(max_object_bytes=350)
    ranges = _chain(10)
    assert plan_ranges(T, ranges, None, limits).groups == ()
    plan = plan_ranges(T, ranges, TopicClock(offset=65, ingest_ms=10**12), limits)
    # [60, 70) reaches past the clock offset: the owner may still commit there.
    assert _spans(plan) == [(0, 30, "full"), (30, 60, "age")]
    assert plan.safe_below == 65


def test_plan_keeps_gaps_and_large_objects_as_boundaries() -> None:
    limits = RotationLimits(max_object_bytes=1000)
    large = _range(40, 50, size=600, kind="topic")
    ranges = [*_chain(2), *_chain(2, start=25), large, *_chain(3, start=50)]
    plan = plan_ranges(T, ranges, TopicClock(offset=80, ingest_ms=1000), limits)
    assert _spans(plan) == [(0, 20, "gap"), (25, 45, "large")]
    assert all(g.start != 40 for g in plan.groups)


def test_plan_caps_a_group_at_the_transaction_limit_and_honours_min_ranges() -> None:
    ranges = _chain(MAX_GROUP_RANGES + 5)
    clock = TopicClock(offset=10**6, ingest_ms=10**12)
    plan = plan_ranges(T, ranges, clock, RotationLimits(max_object_seconds=10**6))
    assert [len(g.ranges) for g in plan.groups] == [MAX_GROUP_RANGES, 5]
    plan = plan_ranges(T, ranges, clock, RotationLimits(max_object_seconds=10**6, min_ranges=6))
    assert [len(g.ranges) for g in plan.groups] == [MAX_GROUP_RANGES]


def test_rolling_keys_are_deterministic() -> None:
    plan = plan_ranges(T, _chain(4), TopicClock(40, 10**12), RotationLimits())
    [group] = plan.groups
    assert group.key == rolling_key(T, 0, 0, 40)
    assert group.key == "topics/default/rolled/data-0-" + f"{0:020d}-{40:020d}.bin"


# -- rotating on etcd and a real object store --------------------------------------------


@pytest.fixture
async def topic(etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore) -> AsyncIterator[Topic]:
    t = await Topic(etcd_kv, keys, object_store).start()
    yield t
    await t.close()


async def seed(topic: Topic, n: int, *, start: int = 0, clock: bool = True) -> list[ObjectRange]:
    """``n`` single-topic segment objects of ``PER`` offsets each, committed; then the clock
    (what the owner writes once they are uploaded), its time an hour past them."""
    ranges = []
    for i in range(n):
        first = start + i * PER
        rng = await topic.put(f"segments/b/r0/{first // PER + 1:020d}.bin", first, first + PER)
        await topic.commit(rng)
        ranges.append(rng)
    if clock:
        await advance_clock(topic, start + n * PER)
    return ranges


async def advance_clock(topic: Topic, offset: int, *, young: bool = False) -> None:
    """Write ``T``'s clock at ``offset``: its time an hour past the entries there, or (young)
    just past them."""
    owner = topic.ownership.owned(T)
    assert owner is not None
    mark = ClockMark(offset, 1000 + offset + (0 if young else HOUR_MS), owner.epoch)
    await ClockWriter(topic.ownership).advance({T: mark})


async def read_all(manifest: Manifest, store: ObjectStore, end: int) -> list[int]:
    cursor = CloudReader(manifest, store, read_bytes=4096).cursor(T)
    offsets: list[int] = []
    nxt = 0
    while nxt < end:
        batch, reached = await cursor.read(nxt, 64)
        assert reached > nxt, f"the objects end at offset {nxt}"
        offsets += [e.offset for e in batch]
        nxt = reached
    cursor.close()
    return offsets


async def _frames(topic: Topic, ranges: Sequence[ObjectRange]) -> int:
    """Object frames of ``T`` in the objects of ``ranges``."""
    count = 0
    for key in dict.fromkeys(r.object_key for r in ranges):
        count += len(parse_object(await topic.objects.get(key)).topics[T].frames)
    return count


def assert_contiguous(ranges: Sequence[ObjectRange], end: int) -> None:
    position = 0
    for rng in ranges:
        assert rng.start_offset == position, (rng.span(), position)
        position = rng.end_offset
    assert position == end


async def assert_no_orphans(topic: Topic) -> None:
    """After collecting with a clock past the grace period: every object the manifest names
    exists, and nothing else is left under segments/ and topics/."""
    later = int(time.time() * 1000) + 2 * HOUR_MS
    await collect_orphans(topic.kv, topic.keys, topic.objects, now_ms=later)
    named = set(await referenced_objects(topic.kv, topic.keys))
    stored = set(await topic.objects.list("segments/")) | set(await topic.objects.list("topics/"))
    assert stored == named
    integrity = await manifest_integrity(topic.kv, topic.keys, topic.objects, deep=True)
    assert integrity.ok, integrity.problems


@pytest.mark.parametrize("frame_bytes", [4096, 1 << 20], ids=["copied", "recompressed"])
async def test_rotation_reaches_the_bound_and_keeps_every_offset(
    topic: Topic, frame_bytes: int
) -> None:
    """Frames of at least half ``frame_bytes`` are copied as stored; smaller ones are merged
    and re-compressed."""
    await seed(topic, 40)
    input_frames = await _frames(topic, await topic.manifest.ranges(T))
    limits = RotationLimits(max_object_seconds=0.039, frame_bytes=frame_bytes)
    report = await rotate_topic(topic.manifest, topic.objects, T, limits)
    ranges = await topic.manifest.ranges(T)
    assert report.entries_before == 40 and report.entries_after == len(ranges) == 10
    assert all(r.kind == "topic" and r.object_key.startswith("topics/") for r in ranges)
    assert len({r.object_key for r in ranges}) == 10
    assert report.ranges_replaced == 40 and report.bytes_in > 0 and report.bytes_out > 0
    assert_contiguous(ranges, 400)
    output_frames = await _frames(topic, ranges)
    if frame_bytes == 4096:
        assert output_frames == input_frames
    else:
        assert output_frames == 10 < input_frames
    assert await read_all(topic.manifest, topic.objects, 400) == list(range(400))
    again = await rotate_topic(topic.manifest, topic.objects, T, limits)
    assert again.objects == [] and again.entries_after == 10
    await assert_no_orphans(topic)


async def test_small_topics_merge_level_by_level_to_one_object_per_window(topic: Topic) -> None:
    """More ranges than one swap may replace: the first pass writes objects of 60 ranges, the
    next merges those, until one object per time window is left."""
    n = MAX_GROUP_RANGES * 2 + 10
    await seed(topic, n)
    limits = RotationLimits(max_object_seconds=3600, frame_bytes=4096)
    report = await rotate_topic(topic.manifest, topic.objects, T, limits)
    ranges = await topic.manifest.ranges(T)
    assert len(ranges) == 1 and report.passes == 2
    assert ranges[0].start_offset == 0 and ranges[0].end_offset == n * PER
    assert await read_all(topic.manifest, topic.objects, n * PER) == list(range(n * PER))
    await assert_no_orphans(topic)


async def test_a_gap_stays_a_gap(topic: Topic) -> None:
    await seed(topic, 4, clock=False)
    await seed(topic, 4, start=60)
    await rotate_topic(topic.manifest, topic.objects, T, RotationLimits(frame_bytes=4096))
    ranges = await topic.manifest.ranges(T)
    assert [(r.start_offset, r.end_offset) for r in ranges] == [(0, 40), (60, 100)]
    assert sum(r.entries for r in ranges) == 80


async def test_nothing_at_or_above_the_clock_offset_is_rotated(topic: Topic) -> None:
    await seed(topic, 8, clock=False)
    await advance_clock(topic, 45)  # inside [40, 50)
    await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    ranges = await topic.manifest.ranges(T)
    assert [r.kind for r in ranges] == ["topic", "segment", "segment", "segment", "segment"]
    assert ranges[0].end_offset == 40


class Crash(BaseException):
    """The process dies here."""


class CrashAfterPut(ObjectStore):
    """A store whose process dies right after storing a rolling object (armed by ``crash``)."""

    crash = False

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        written = await super().put_if_absent(key, data)
        if self.crash and key.startswith("topics/"):
            raise Crash(key)
        return written


class CrashAfterTxn:
    """An etcd client whose process dies right after a transaction succeeded."""

    def __init__(self, kv: EtcdKV) -> None:
        self.kv = kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kv, name)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        result = await self.kv.txn(compares, success, failure)
        if result.succeeded:
            raise Crash("after the swap")
        return result


def _crashing_store(store: ObjectStore) -> CrashAfterPut:
    """``store`` (same operator, so the same memory backend too) that crashes after a PUT."""
    crashing = CrashAfterPut.__new__(CrashAfterPut)
    crashing.__dict__.update(store.__dict__)
    return crashing


async def test_a_crash_after_the_put_converges_on_the_next_run(topic: Topic) -> None:
    await seed(topic, 8)
    crashing = _crashing_store(topic.objects)
    crashing.crash = True
    with pytest.raises(Crash):
        await rotate_topic(topic.manifest, crashing, T, LIMITS)
    assert len(await topic.manifest.ranges(T)) == 8  # nothing swapped
    assert len(await topic.objects.list("topics/")) == 1  # the object is stored
    report = await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    ranges = await topic.manifest.ranges(T)
    assert len(ranges) == report.entries_after == 2
    assert ranges[0].object_key in await topic.objects.list("topics/")
    assert await read_all(topic.manifest, topic.objects, 80) == list(range(80))
    await assert_no_orphans(topic)


async def test_an_object_stored_long_ago_is_stored_again_before_the_swap(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    """The uploader's rule: never swap in an object PUT more than 600 s ago without storing it
    again (the orphan collector's grace is only twice that). An fs store: its files are aged."""
    store = ObjectStore("fs", options={"root": str(tmp_path / "aged")})
    topic = await Topic(etcd_kv, keys, store).start()
    await seed(topic, 8)
    crashing = _crashing_store(topic.objects)
    crashing.crash = True
    with pytest.raises(Crash):
        await rotate_topic(topic.manifest, crashing, T, LIMITS)
    [key] = await topic.objects.list("topics/")
    past = time.time() - 2 * OBJECT_REFRESH_SECONDS
    os.utime(tmp_path / "aged" / key, (past, past))
    await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    info = await topic.objects.stat(key)
    assert info is not None and info.modified_ms is not None
    assert info.modified_ms > (past + OBJECT_REFRESH_SECONDS) * 1000
    assert (await topic.manifest.ranges(T))[0].object_key == key
    await topic.close()
    await store.close()


async def test_a_crash_after_the_swap_leaves_nothing_to_redo(topic: Topic) -> None:
    await seed(topic, 8)
    crashing = Manifest(CrashAfterTxn(topic.kv), topic.keys)  # type: ignore[arg-type]
    with pytest.raises(Crash):
        await rotate_topic(crashing, topic.objects, T, LIMITS)
    assert len(await topic.manifest.ranges(T)) == 5  # the first group swapped
    report = await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    assert len(report.objects) == 1 and report.entries_after == 2
    assert await read_all(topic.manifest, topic.objects, 80) == list(range(80))
    await assert_no_orphans(topic)


async def test_concurrent_rotations_lose_nothing(topic: Topic) -> None:
    await seed(topic, 24)
    reports = await asyncio.gather(
        *(rotate_topic(topic.manifest, topic.objects, T, LIMITS) for _ in range(3))
    )
    ranges = await topic.manifest.ranges(T)
    assert len(ranges) == 6 and all(r.entries_after == 6 for r in reports)
    assert_contiguous(ranges, 240)
    assert sorted(k for r in reports for k in r.objects) == sorted(r.object_key for r in ranges)
    assert await read_all(topic.manifest, topic.objects, 240) == list(range(240))
    await assert_no_orphans(topic)


async def test_a_stale_group_changes_nothing(topic: Topic) -> None:
    await seed(topic, 8)
    plan = await plan_rotation(topic.manifest, T, LIMITS)
    await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    before = await topic.manifest.ranges(T)
    assert await rotate_group(topic.manifest, topic.objects, plan.groups[0], LIMITS) is None
    assert await topic.manifest.ranges(T) == before


async def test_a_damaged_input_stops_rotation_and_changes_nothing(topic: Topic) -> None:
    ranges = await seed(topic, 4)
    key = ranges[1].object_key
    data = bytearray(await topic.objects.get(key))
    data[ranges[1].byte_start + 30] ^= 0x01
    await topic.objects.put(key, bytes(data))
    before = await topic.manifest.ranges(T)
    with pytest.raises(RotationError, match=key) as raised:
        await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    assert not raised.value.retriable
    assert await topic.manifest.ranges(T) == before


@pytest.mark.parametrize("collect", [False, True])
async def test_a_reader_during_the_swap_finishes_or_reads_the_manifest_again(
    topic: Topic, collect: bool
) -> None:
    """A reader that opened segment objects before the swap: without collection it finishes on
    them (the retirement grace keeps them); if they are collected under it, it re-reads the
    manifest and goes on in the rolling objects."""
    await seed(topic, 16)
    cursor = CloudReader(topic.manifest, topic.objects, read_bytes=600, prefetch=0).cursor(T)
    first, nxt = await cursor.read(0, 15)
    await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    if collect:
        later = int(time.time() * 1000) + 2 * HOUR_MS
        report = await collect_orphans(topic.kv, topic.keys, topic.objects, now_ms=later)
        assert len(report.deleted) == 16
    offsets = [e.offset for e in first]
    while nxt < 160:
        batch, nxt = await cursor.read(nxt, 64)
        offsets += [e.offset for e in batch]
    assert offsets == list(range(160))


async def test_candidates_for_the_sensor(topic: Topic) -> None:
    await seed(topic, 6, clock=False)
    assert (await rotation_candidates(topic.kv, topic.keys))[0] == {}
    # Below the clock, but the newest group is neither full nor an hour older than the clock.
    await advance_clock(topic, 40, young=True)
    assert (await rotation_candidates(topic.kv, topic.keys))[0] == {}
    await advance_clock(topic, 40)
    counts, revisions = await rotation_candidates(topic.kv, topic.keys)
    assert counts == {T: 4} and revisions[T] > 0
    await rotate_topic(topic.manifest, topic.objects, T, LIMITS)
    counts, after = await rotation_candidates(topic.kv, topic.keys)
    assert counts == {} and after[T] > revisions[T]
