"""The cold path end to end below the gRPC layer: readers below the WAL floor served from
objects, then from the WAL, then live; backpressure while the object store is down; a
subscription waiting out an object store outage. Real etcd; memory, fs and s3 stores."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from danube_ingest.dispatch import DispatchPolicy, ReliableSubscription, SubscriptionType
from danube_ingest.errors import WalBackpressureError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import MotoServer, free_port
from danube_ingest.wal.block import IDEMPOTENT_BIT, BlockLimits, check_block, encode_block
from danube_ingest.wal.framing import Entry

from .support import (
    FAST_RETRY,
    ColdStack,
    T,
    assert_one_line,
    eventually,
    payloads,
    prune_all,
    read_n,
)

pytestmark = pytest.mark.etcd


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


async def test_batch_path_blocks_are_uploaded_and_read_back_from_objects(
    stack: ColdStack,
) -> None:
    """Entry blocks (the batch path's frames) go through the uploader and .bin objects like
    any frame, and decode from there with their stamped producer id and sequence."""
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 400)
    pid = IDEMPOTENT_BIT | 99
    limits = BlockLimits(max_payload_bytes=4096, max_attributes=4)
    for seq in range(4):
        block, sizes = encode_block([Entry(p) for p in sent[seq * 100 : seq * 100 + 100]])
        checked = check_block(bytearray(block), sizes, 100, limits)
        await stack.store.append_block(T, checked, pid, seq).future
    await stack.seal_and_upload()
    assert await prune_all(stack, T)
    meta = stack.store.regions[0].topic(T)
    assert meta is not None
    stack.store.cache.drop(meta)  # (so the read below comes from objects)
    reader = stack.store.create_reader(T, 0, max_batch=64)
    got = await read_n(reader, 400)
    reader.close()
    assert [e.payload for e in got] == sent
    assert [e.offset for e in got] == list(range(400))
    assert {(e.producer_id, e.request_id) for e in got[100:200]} == {(pid, 1)}


async def test_a_reader_caught_up_after_objects_holds_no_object_cursor(
    stack: ColdStack,
) -> None:
    """A reader that read a topic from objects to its end and waits for appends lets go of
    its object cursor (decoded reads and prefetches: up to 3 x 4 MiB per reader, held by
    every idle subscription otherwise), and still reads what comes next."""
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 300)
    await stack.append(T, sent[:200])
    await stack.seal_and_upload()
    assert await prune_all(stack, T)
    meta = stack.store.regions[0].topic(T)
    assert meta is not None
    stack.store.cache.drop(meta)  # (so the read below comes from objects)
    reader = stack.store.create_reader(T, 0, max_batch=64)
    assert [e.offset for e in await read_n(reader, 200)] == list(range(200))
    waiting = asyncio.ensure_future(reader.next_batch())
    await asyncio.sleep(0.05)
    assert not waiting.done() and reader._cold is None
    await stack.append(T, sent[200:])
    got = await waiting
    got += await read_n(reader, 100 - len(got))
    assert [e.payload for e in got] == sent[200:]
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
        # The store is down: uploads keep failing.
        await eventually(lambda: stack.uploader.stats.failures > 0, lambda: stack.uploader.stats)
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
            await eventually(  # failed, retried
                lambda: caplog.text.count("dispatch read failed, retrying") >= 2,
                lambda: caplog.text[-2000:],
            )
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


async def test_a_topic_back_from_another_broker_reads_that_brokers_entries_from_objects(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    # a owns the topic, then b (a rolling restart), then a again: a's WAL has a hole where
    # b's entries are, and those are in objects.
    objects = ObjectStore.memory()
    a = await ColdStack(etcd_kv, keys, objects, tmp_path / "a", broker_id="a").open()
    b = await ColdStack(etcd_kv, keys, objects, tmp_path / "b", broker_id="b").open()
    try:
        a.uploader.start()
        b.uploader.start()
        await a.acquire(T)
        await a.append(T, payloads(T, 100))
        await a.seal_and_upload()
        await a.ownership.release(T)

        await b.acquire(T)
        await b.store.ensure_topic(T, min_next_offset=1000)
        await b.append(T, payloads(T, 100, 1000))
        await b.seal_and_upload()
        await b.ownership.release(T)

        await a.acquire(T)
        await a.store.ensure_topic(T, min_next_offset=2000)
        await a.append(T, payloads(T, 100, 2000))
        info = a.store.info(T)
        assert info is not None and info.first_offset == 0  # a's own old entries are local

        expected = [*range(100), *range(1000, 1100), *range(2000, 2100)]
        for start, max_batch in ((0, 1024), (0, 7), (50, 64), (1050, 64), (150, 10)):
            reader = a.store.create_reader(T, start, max_batch=max_batch)
            want = [o for o in expected if o >= start]
            got = await read_n(reader, len(want))
            assert [e.offset for e in got] == want
            reader.close()
    finally:
        await a.close()
        await b.close()
