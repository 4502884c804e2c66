"""The cold path end to end below the gRPC layer: WAL → uploader → objects + manifest → cleaner
→ readers served from objects, then from the WAL, then live. Real etcd; object stores memory,
fs and s3 (moto) through the ``object_store`` fixture."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.dispatch import DispatchPolicy, ReliableSubscription, SubscriptionType
from danube_ingest.errors import WalBackpressureError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.records import Records, SubscriptionRecord, encode_cursor
from danube_ingest.objects.binfmt import decode_frame_bytes, parse_object
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import build_segment_object, segment_key
from danube_ingest.store import TopicReader
from danube_ingest.testing import MotoServer, free_port
from danube_ingest.wal.framing import Entry

from .support import FAST_RETRY, ColdStack, assert_one_line

pytestmark = pytest.mark.etcd

T = "/default/cold"


def payloads(topic: str, n: int, start: int = 0, size: int = 300) -> list[bytes]:
    return [f"{topic}:{i}:".encode().ljust(size, b".") for i in range(start, start + n)]


async def read_n(reader: TopicReader, n: int, timeout: float = 20.0) -> list[Entry]:
    out: list[Entry] = []

    async def run() -> None:
        while len(out) < n:
            out.extend(await reader.next_batch())

    await asyncio.wait_for(run(), timeout)
    return out


@pytest.fixture
async def stack(etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore, tmp_path: Path):  # type: ignore[no-untyped-def]
    s = await ColdStack(etcd_kv, keys, object_store, tmp_path / "wal").open()
    yield s
    await s.close()


async def prune_all(stack: ColdStack, *topics: str) -> list[tuple[str, int]]:
    """Mark every topic fully prunable (what Dagster does once all is consumed) and clean."""
    marks = PruneMarks(stack.kv, stack.keys)
    for topic in topics:
        info = stack.store.info(topic)
        assert info is not None
        await marks.set_mark(stack.broker_id, info.region, topic, info.high_watermark)
    return await stack.cleaner.clean_once()


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


# -- reading from objects ----------------------------------------------------------------


async def test_reader_below_the_wal_floor_reads_objects_then_wal_then_live(
    stack: ColdStack,
) -> None:
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 600)
    await stack.append(T, sent[:500])
    await stack.seal_and_upload()
    await stack.append(T, sent[500:550])  # stays in the WAL (active segment)
    deleted = await prune_all(stack, T)
    assert deleted, stack.cleaner.stats.blocked_by
    info = stack.store.info(T)
    assert info is not None and 0 < info.first_offset <= 500

    reader = stack.store.create_reader(T, 0, max_batch=64)
    first = await read_n(reader, 550)
    assert [e.offset for e in first] == list(range(550))
    assert [e.payload for e in first] == sent[:550]
    live = asyncio.ensure_future(read_n(reader, 50))
    await asyncio.sleep(0.05)
    await stack.append(T, sent[550:])
    tail = await live
    assert [e.offset for e in tail] == list(range(550, 600))
    reader.close()

    # From the middle of an object range, and from the middle of a frame.
    for start in (1, 77, 255, info.first_offset - 1):
        reader = stack.store.create_reader(T, start, max_batch=100)
        got = await read_n(reader, 600 - start)
        assert [e.offset for e in got] == list(range(start, 600))
        reader.close()


async def test_reader_in_memory_order_when_segments_are_pruned_under_it(
    stack: ColdStack,
) -> None:
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 400)
    await stack.append(T, sent)
    reader = stack.store.create_reader(T, 0, max_batch=10)
    first = await reader.next_batch()  # reading the WAL
    await stack.seal_and_upload()
    assert await prune_all(stack, T)
    rest = await read_n(reader, 400 - len(first))
    assert [e.offset for e in first + rest] == list(range(400))
    reader.close()


# -- the cleaner ---------------------------------------------------------------------------


async def test_cleaner_never_deletes_what_is_not_uploaded(stack: ColdStack) -> None:
    await stack.acquire(T)
    await stack.append(T, payloads(T, 300))
    await stack.seal()
    assert not await prune_all(stack, T)  # uploader not started: nothing uploaded
    assert "not uploaded" in (stack.cleaner.stats.blocked_by or "")
    stack.uploader.start()
    await stack.seal_and_upload()
    assert await stack.cleaner.clean_once()


async def test_cleaner_follows_the_slowest_subscription_until_a_mark_exists(
    stack: ColdStack,
) -> None:
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 400)
    for i in range(0, 400, 20):  # small commits: segments of about 180 entries
        await stack.append(T, sent[i : i + 20])
    await stack.seal_and_upload()
    region = stack.store.regions[0]
    records = Records(stack.kv, stack.keys)
    await records.put_subscription(SubscriptionRecord(T, "fast", "Exclusive"))
    await records.put_subscription(SubscriptionRecord(T, "slow", "Shared"))
    await stack.kv.put(stack.keys.subscription_cursor(T, "fast"), encode_cursor(400))
    # "slow" has no cursor yet: it holds everything.
    assert not await stack.cleaner.clean_once()
    await stack.kv.put(stack.keys.subscription_cursor(T, "slow"), encode_cursor(250))
    deleted = await stack.cleaner.clean_once()
    assert deleted, stack.cleaner.stats.blocked_by
    info = stack.store.info(T)
    assert info is not None and info.first_offset <= 250  # nothing at or above 250 went
    # Every deleted segment's offsets are below the slow cursor.
    remaining = sorted(region.sealed)
    assert remaining and region.topic(T).spans[0].first_offset <= 250  # type: ignore[union-attr]
    # A prune mark (from the control plane) overrides the cursors.
    await PruneMarks(stack.kv, stack.keys).set_mark("b1", "r0", T, 400)
    await stack.cleaner.clean_once()
    assert not region.sealed


async def test_cleaner_keeps_retention_minimums(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    objects = ObjectStore.memory()
    stack = await ColdStack(
        etcd_kv,
        keys,
        objects,
        tmp_path / "wal",
        retention_values={"min_minutes": 10},
    ).open()
    try:
        await stack.acquire(T)
        stack.uploader.start()
        await stack.append(T, payloads(T, 300))
        await stack.seal_and_upload()
        assert not await prune_all(stack, T)
        assert "min_minutes" in (stack.cleaner.stats.blocked_by or "")
        stack.cleaner._clock = lambda: time.time() + 11 * 60
        assert await stack.cleaner.clean_once()
    finally:
        await stack.close()

    stack = await ColdStack(
        etcd_kv,
        keys,
        objects,
        tmp_path / "wal2",
        broker_id="b2",
        retention_values={"min_bytes": "100KiB", "max_bytes": "10MiB"},
    ).open()
    try:
        await stack.acquire("/default/other")
        stack.uploader.start()
        await stack.append("/default/other", payloads("/default/other", 1000))
        await stack.seal_and_upload()
        await prune_all(stack, "/default/other")
        assert stack.store.wal_bytes() >= 100 * 1024
        assert stack.store.wal_bytes() < 100 * 1024 + 2 * 64 * 1024
    finally:
        await stack.close()


# -- backpressure --------------------------------------------------------------------------


async def test_object_store_down_means_backpressure_then_recovery_without_loss(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    port = free_port()
    options = {
        "bucket": "cold",
        "endpoint": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "access_key_id": "test",
        "secret_access_key": "test",
        "disable_config_load": "true",
        "disable_ec2_metadata": "true",
    }
    objects = ObjectStore("s3", options=options, retry=FAST_RETRY)
    stack = await ColdStack(
        etcd_kv,
        keys,
        objects,
        tmp_path / "wal",
        retention_values={"max_bytes": "256KiB"},
        max_wal_bytes=256 * 1024,
    ).open()
    moto = MotoServer(port=port)
    try:
        await stack.acquire(T)
        stack.uploader.start()
        acked: list[int] = []
        refused = 0
        for i in range(2000):
            try:
                acked.append(await stack.store.append(T, Entry(payloads(T, 1, i)[0])))
            except WalBackpressureError as exc:
                assert exc.retriable
                refused += 1
                break
        assert refused == 1, "the WAL never filled up"
        assert stack.store.full
        deadline = time.monotonic() + 20
        while not stack.uploader.stats.failures:  # the store is down: uploads keep failing
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert stack.store.full and not stack.store.regions[0].uploaded
        # Nothing acknowledged was lost: every acked offset reads back.
        got = await read_n(stack.store.create_reader(T, 0), len(acked))
        assert [e.offset for e in got] == acked

        moto.start()
        moto.create_bucket("cold")
        await stack._settle(timeout=30)
        await prune_all(stack, T)
        assert not stack.store.full
        offset = await stack.store.append(T, Entry(b"after"))
        assert offset == acked[-1] + 1
        ranges = await stack.manifest.ranges(T)
        assert_one_line(ranges, ranges[-1].end_offset)
        assert ranges[-1].end_offset >= stack.store.info(T).first_offset  # type: ignore[union-attr]
    finally:
        await stack.close()
        moto.stop()


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
        deadline = time.monotonic() + 10
        while not a.uploader.stats.orphans:
            assert time.monotonic() < deadline, a.uploader.stats
            await asyncio.sleep(0.05)
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
        deadline = time.monotonic() + 10
        while not a.uploader.stats.orphans:
            assert time.monotonic() < deadline, a.uploader.stats
            await asyncio.sleep(0.05)
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


async def test_a_subscription_behind_the_wal_waits_out_an_object_store_outage(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    moto = MotoServer()
    moto.start()
    moto.create_bucket("cold")
    objects = ObjectStore("s3", options=moto.options("cold"), retry=FAST_RETRY, timeout=1.0)
    stack = await ColdStack(etcd_kv, keys, objects, tmp_path / "wal", cache_bytes=16 * 1024).open()
    subscription = None
    try:
        await stack.acquire(T)
        stack.uploader.start()
        sent = payloads(T, 300)
        await stack.append(T, sent)
        await stack.seal_and_upload()
        assert await prune_all(stack, T)
        assert stack.store.info(T).first_offset == 300  # type: ignore[union-attr]

        assert moto.process is not None
        os.kill(moto.process.pid, signal.SIGSTOP)  # the store stops answering: reads time out
        try:
            subscription = ReliableSubscription(
                "late", T, SubscriptionType.EXCLUSIVE, stack.store, 0, DispatchPolicy(), None
            )
            handle = subscription.attach(1, "c")
            first = asyncio.ensure_future(handle.next())
            deadline = time.monotonic() + 20
            while caplog.text.count("dispatch read failed, retrying") < 2:  # failed, retried
                assert time.monotonic() < deadline, caplog.text[-2000:]
                await asyncio.sleep(0.1)
            assert not first.done()  # waiting, not failed: the subscription is still there
            assert not subscription.closed
        finally:
            os.kill(moto.process.pid, signal.SIGCONT)
        got = [(await asyncio.wait_for(first, 30)).entry]
        while len(got) < 300:
            delivery = await asyncio.wait_for(handle.next(), 30)
            got.append(delivery.entry)
            subscription.ack(delivery.entry.offset)
        subscription.ack(got[0].offset)
        assert [e.offset for e in got] == list(range(300))
        assert [e.payload for e in got] == sent
    finally:
        if subscription is not None:
            await subscription.close()
        await stack.close()
        moto.stop()
