"""SegmentUploader: one object per sealed segment, manifest ranges committed exactly once
(crashes between steps repaired by re-running), fencing of a broker that lost its topics.
Real etcd; object stores memory, fs and s3 (moto) through the ``object_store`` fixture."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import ClockMark, ClockWriter
from danube_ingest.metadata.manifest import TopicFloor
from danube_ingest.objects.binfmt import decode_frame_bytes, parse_object
from danube_ingest.objects.orphans import MIN_GRACE_S, collect_orphans
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import (
    OBJECT_REFRESH_SECONDS,
    build_segment_object,
    segment_key,
)

from .support import ColdStack, T, assert_one_line, eventually, payloads, prune_all, read_n

pytestmark = pytest.mark.etcd


# -- uploads -------------------------------------------------------------------------------


async def test_every_sealed_segment_becomes_one_object_and_one_line_of_ranges(
    stack: ColdStack,
) -> None:
    topics = [f"/default/t{i}" for i in range(3)]
    await stack.acquire(*topics)
    stack.uploader.start()
    sent = {t: payloads(t, 400) for t in topics}
    for i in range(0, 400, 50):  # interleaved, so segments hold all three
        for t in topics:
            await stack.append(t, sent[t][i : i + 50])
    await stack.seal_and_upload()
    region = stack.store.regions[0]
    sealed = sorted(region.sealed)
    assert len(sealed) >= 5  # 360 KB in 64 KiB segments
    keys = await stack.objects.list("segments/")
    assert keys == [segment_key("b1", "r0", seq) for seq in sealed]
    assert stack.objects.stats.puts == len(sealed)
    assert stack.uploader.stats.segments == len(sealed)
    assert 0 < stack.uploader.stats.last_lag_ms <= stack.uploader.stats.max_lag_ms < 20_000
    for t in topics:
        ranges = await stack.manifest.ranges(t)
        assert_one_line(ranges, 400)
        assert {r.kind for r in ranges} == {"segment"}
        # The bytes the manifest points at decode to exactly what was appended.
        got: list[bytes] = []
        for rng in ranges:
            data = await stack.objects.get(rng.object_key)
            footer = parse_object(data, rng.object_key)
            span = footer.topics[t]
            assert (span.position, span.length) == (rng.byte_start, rng.byte_length)
            for ref in span.frames:
                entries = decode_frame_bytes(
                    data[ref.position : ref.position + ref.length], ref, rng.object_key
                )
                got.extend(e.payload for e in entries)
        assert got == sent[t]


@pytest.mark.parametrize("ntopics", [1, 10, 100])
async def test_one_put_per_sealed_segment_whatever_the_number_of_topics(
    stack: ColdStack, ntopics: int
) -> None:
    topics = [f"/default/many{i}" for i in range(ntopics)]
    await stack.acquire(*topics)
    stack.uploader.start()
    for t in topics:
        await stack.append(t, payloads(t, 3, size=40))
    await stack.seal_and_upload()
    assert stack.objects.stats.puts == 1
    assert len(await stack.objects.list("segments/")) == 1
    assert stack.uploader.stats.ranges == ntopics
    for t in topics:
        assert_one_line(await stack.manifest.ranges(t), 3)


async def test_segment_without_messages_needs_no_object(stack: ColdStack) -> None:
    stack.uploader.start()
    await stack.seal_and_upload()  # an empty segment (only its checkpoint)
    assert stack.objects.stats.puts == 0
    assert stack.store.regions[0].uploaded == stack.store.regions[0].sealed


# -- crashes -------------------------------------------------------------------------------

CHILD = Path(__file__).with_name("crash_child.py")


def run_child(mode: str, etcd: str, prefix: str, wal: Path, objects: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    result = subprocess.run(
        [sys.executable, str(CHILD), mode, etcd, prefix, str(wal), str(objects)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 9, result.stdout + result.stderr  # it crashed where told


@pytest.mark.parametrize("crash", ["after_put", "after_commit"])
async def test_crash_between_steps_is_repaired_by_rerunning(
    etcd_server: str, etcd_kv: EtcdKV, keys: Keys, tmp_path: Path, crash: str
) -> None:
    wal, root = tmp_path / "wal", tmp_path / "objects"
    run_child(crash, etcd_server, keys.prefix, wal, root)
    objects = ObjectStore("fs", options={"root": str(root)})
    stored_before = await objects.list("segments/")
    assert stored_before  # the PUTs happened before the crash
    manifest_before = await etcd_kv.get_prefix(keys.storage_objects_prefix(T))
    if crash == "after_put":
        assert manifest_before == []
    else:
        assert manifest_before

    # The broker restarts (same id): it waits out its old registration, as the daemon does.
    deadline = time.monotonic() + 15
    while True:
        try:
            stack = await ColdStack(etcd_kv, keys, objects, wal, lease_ttl=2).open()
            break
        except Exception:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
    try:
        region = stack.store.regions[0]
        assert region.sealed - region.uploaded  # the marks were lost with the crash
        stack.uploader.start()
        await stack.uploader.drain(timeout=30)
        await stack._settle(timeout=30)
        assert stack.uploader.stats.puts == 0  # every object was there already
        assert stack.objects.stats.bytes_written == 0
        assert await objects.list("segments/") == stored_before
        ranges = await stack.manifest.ranges(T)
        assert_one_line(ranges, 500)
        if crash == "after_commit":
            assert [r.encode() for r in ranges] == [kv.value for kv in manifest_before]  # untouched
        assert await prune_all(stack, T)
        got = await read_n(stack.store.create_reader(T, 0), 500)
        assert [e.payload for e in got] == payloads(T, 500)
    finally:
        await stack.close()


# -- fencing -------------------------------------------------------------------------------


async def test_a_broker_that_lost_the_topic_cannot_commit_and_keeps_its_wal(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    objects = ObjectStore.memory()
    a = await ColdStack(etcd_kv, keys, objects, tmp_path / "a", broker_id="a").open()
    b = await ColdStack(etcd_kv, keys, objects, tmp_path / "b", broker_id="b").open()
    try:
        await a.acquire(T)
        await a.append(T, payloads(T, 200))
        await a.seal()
        # a is cut off: its lease expires (revoked here) and b takes the topic over.
        assert a.session.lease_id is not None
        await etcd_kv.revoke_lease(a.session.lease_id)
        deadline = time.monotonic() + 10
        while (await b.ownership.acquire(T)).broker_id != "b":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await b.store.ensure_topic(T, min_next_offset=1000)
        await b.append(T, payloads(T, 100, 1000))
        b.uploader.start()
        await b.seal_and_upload()

        a.uploader.start()
        await eventually(lambda: bool(a.uploader.stats.orphans), lambda: a.uploader.stats, 10)
        ranges = await a.manifest.ranges(T)
        assert [(r.start_offset, r.end_offset, r.broker) for r in ranges] == [(1000, 1100, "b")]
        region = a.store.regions[0]
        assert not region.uploaded  # so the cleaner never deletes a's data
        assert not await prune_all(a, T)
        assert a.store.info(T).first_offset == 0  # type: ignore[union-attr]

        # b lets the topic go; a restarts and gets it back: its old range now lies below
        # b's, so it stays orphaned rather than breaking the line of epochs.
        await b.ownership.release(T)
        await a.close()
        a = await ColdStack(etcd_kv, keys, objects, tmp_path / "a", broker_id="a").open()
        a.uploader.start()
        await eventually(lambda: bool(a.uploader.stats.orphans), lambda: a.uploader.stats, 10)
        assert a.ownership.is_owner(T)
        ranges = await a.manifest.ranges(T)
        assert [(r.start_offset, r.end_offset, r.broker) for r in ranges] == [(1000, 1100, "b")]
        assert list(a.uploader.stats.orphans) == [("r0", 0)]
        assert 0 not in a.store.regions[0].uploaded  # its data stays on a's disk
    finally:
        await a.close()
        await b.close()


async def test_a_torn_object_under_the_brokers_own_key_is_replaced(stack: ColdStack) -> None:
    await stack.acquire(T)
    await stack.append(T, payloads(T, 50))
    await stack.seal()
    seq = min(stack.store.regions[0].sealed)
    key = segment_key("b1", "r0", seq)
    # What an fs store holds after a crash in the middle of writing the object in place.
    region = stack.store.regions[0]
    data = await region.read(seq, 0, region.segment_sizes[seq])
    whole = build_segment_object(data, key=key, codec="zstd").data
    assert whole is not None
    await stack.objects.put(key, whole[: len(whole) // 2])
    stack.uploader.start()
    await stack.seal_and_upload()
    assert parse_object(await stack.objects.get(key), key).topics[T].entries == 50
    assert_one_line(await stack.manifest.ranges(T), 50)


async def test_a_range_below_another_owners_clock_is_never_committed(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    objects = ObjectStore.memory()
    a = await ColdStack(etcd_kv, keys, objects, tmp_path / "a", broker_id="a").open()
    b = await ColdStack(etcd_kv, keys, objects, tmp_path / "b", broker_id="b").open()
    try:
        await a.acquire(T)
        await a.append(T, payloads(T, 200))
        await a.seal()
        # a is cut off before uploading; b takes the topic over and, idle, declares every
        # offset below its start complete (its clock), without writing any range.
        assert a.session.lease_id is not None
        await etcd_kv.revoke_lease(a.session.lease_id)
        deadline = time.monotonic() + 10
        while (owner := await b.ownership.acquire(T)).broker_id != "b":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await b.store.ensure_topic(T, min_next_offset=1000)
        mark = await b.store.advance_time(T)
        assert mark.offset == 1000 and b.store.uploaded_below(T, mark.offset)
        written = await ClockWriter(b.ownership).advance(
            {T: ClockMark(mark.offset, mark.ingest_ms, owner.epoch)}
        )
        assert written.writes == 1
        await b.ownership.release(T)

        # a restarts and gets the topic back: nothing later is in the manifest, but its old
        # range lies below the clock, so committing it would add to completed hours.
        await a.close()
        a = await ColdStack(etcd_kv, keys, objects, tmp_path / "a", broker_id="a").open()
        a.uploader.start()
        await eventually(lambda: bool(a.uploader.stats.orphans), lambda: a.uploader.stats, 10)
        assert a.ownership.is_owner(T)
        assert await a.manifest.ranges(T) == []
        assert list(a.uploader.stats.orphans) == [("r0", 0)]
        assert 0 not in a.store.regions[0].uploaded  # its data stays on a's disk
    finally:
        await a.close()
        await b.close()


async def test_a_range_below_the_retained_floor_is_never_committed_again(
    stack: ColdStack,
) -> None:
    """Retention removed the topic's range [0, 200) (its floor is 200) after a commit the
    broker never recorded (it crashed before marking the segment uploaded): the re-run finds
    no entry there and must not commit it again."""
    await stack.acquire(T)
    await stack.append(T, payloads(T, 200))
    await stack.seal()
    floor = TopicFloor(offset=200, expired_ms=1, reason="max_age")
    await stack.kv.put(stack.keys.topic_floor(T), floor.encode())
    stack.uploader.start()
    await eventually(lambda: bool(stack.uploader.stats.orphans), lambda: stack.uploader.stats, 10)
    assert await stack.manifest.ranges(T) == []
    assert list(stack.uploader.stats.orphans) == [("r0", 0)]


async def test_a_stored_object_whose_commit_was_delayed_is_stored_again_before_it(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    """An object stored long ago whose manifest commit never landed (etcd away, a crash) is an
    orphan to the collector; the uploader stores it again right before committing it, so the
    collector's grace period (at least twice that age) can never expire between the two."""
    root = tmp_path / "objects"
    objects = ObjectStore("fs", options={"root": str(root)})
    stack = await ColdStack(etcd_kv, keys, objects, tmp_path / "wal").open()
    try:
        await stack.acquire(T)
        await stack.append(T, payloads(T, 50))
        await stack.seal()
        region = stack.store.regions[0]
        seq = min(region.sealed)
        key = segment_key("b1", "r0", seq)
        data = await region.read(seq, 0, region.segment_sizes[seq])
        whole = build_segment_object(data, key=key, codec="zstd").data
        assert whole is not None
        # An earlier run stored it two hours ago and never committed it.
        await objects.put(key, whole)
        two_hours_ago = time.time() - 7200
        os.utime(root / key, (two_hours_ago, two_hours_ago))
        report = await collect_orphans(etcd_kv, keys, objects, grace_s=MIN_GRACE_S, dry_run=True)
        assert report.deleted == [key]  # an orphan the collector may take

        stack.uploader.start()
        await stack.seal_and_upload()
        info = await objects.stat(key)
        assert info is not None and info.modified_ms is not None
        assert info.modified_ms > (time.time() - 60) * 1000  # stored again before the commit
        assert await objects.get(key) == whole
        assert_one_line(await stack.manifest.ranges(T), 50)
        report = await collect_orphans(etcd_kv, keys, objects, grace_s=MIN_GRACE_S)
        assert report.deleted == [] and report.kept == 1
    finally:
        await stack.close()


async def test_the_collectors_grace_covers_the_uploaders_refresh_age(
    etcd_kv: EtcdKV, keys: Keys
) -> None:
    assert MIN_GRACE_S >= 2 * OBJECT_REFRESH_SECONDS
    with pytest.raises(ValueError, match="at least"):
        await collect_orphans(etcd_kv, keys, ObjectStore.memory(), grace_s=MIN_GRACE_S - 1)
