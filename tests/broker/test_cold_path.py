"""The daemon with its cold path on (``storage.mode: wal_cloud``), driven by the real
danube-client: sealed segments reach the object store and the manifest, and a subscription
whose data left the WAL is served from objects and then live, without noticing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.policies import Policies, RetentionPolicy
from danube_ingest.metadata.records import Records, SubscriptionRecord
from danube_ingest.objects.retention import apply_retention

from .conftest import BrokerFactory
from .support import Clients, Subscribed, eventually, offsets, payloads

T = "/default/cold"

COLD: dict[str, Any] = {
    "storage.mode": "wal_cloud",
    "storage.wal.segment_bytes": "64KiB",
    "storage.wal.segment_seconds": 1,
    "storage.wal.retention.check_seconds": 0.2,
    "limits.max_unacked_messages": 20,
    # A small cache, so what left the WAL is really read from objects.
    "storage.cache.max_bytes": "16KiB",
    "storage.cache.topic_max_bytes": "16KiB",
}


async def take_acking(sub: Subscribed, n: int, timeout: float = 30.0) -> list[Any]:
    """The next ``n`` messages, acking each as it arrives."""
    got: list[Any] = []
    async with asyncio.timeout(timeout):
        while len(got) < n:
            message = await sub.queue.get()
            await sub.consumer.ack(message)
            got.append(message)
    return got


async def _store_floor(broker: Broker) -> int:
    assert broker.store is not None
    info = broker.store.info(T)
    return 0 if info is None else info.first_offset


async def test_subscription_pruned_beneath_reads_objects_then_live(
    make_broker: BrokerFactory, etcd_server: str, etcd_prefix: str, tmp_path: Path
) -> None:
    broker: Broker = await make_broker(**COLD)
    assert broker.objects is not None and broker.uploader is not None
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        async with Clients(broker.url) as clients:
            producer = await clients.producer(T, "p1")
            # The subscription exists, then its consumer goes away before anything is sent.
            sub = await clients.consumer(T, "s1", "c1")
            await sub.consumer.close()
            sent = [f"m{i:04}".encode().ljust(500, b".") for i in range(400)]
            for payload in sent[:300]:
                await producer.send(payload)
            # Sealed within a second, uploaded, committed; then the control plane marks the
            # topic prunable and the cleaner deletes its WAL beneath the subscription.
            await eventually(lambda: broker.uploader.stats.ranges >= 1, "an upload")
            info = broker.store.info(T)  # type: ignore[union-attr]
            assert info is not None
            marks = PruneMarks(kv, Keys(etcd_prefix))
            await marks.set_mark("broker-1", info.region, T, 300)
            await eventually(lambda: broker.cleaner.stats.segments >= 1, "pruning")  # type: ignore[union-attr]
            floor = await _store_floor(broker)
            assert floor > 0
            gets_before = broker.objects.stats.gets

            again = await clients.consumer(T, "s1", "c1")  # the same consumer, back
            got = await take_acking(again, 300)  # (the window is 20 unacked messages)
            for payload in sent[300:]:
                await producer.send(payload)
            live = await take_acking(again, 100)
            everything = got + live
            assert offsets(everything) == list(range(400))  # exactly once, in order
            assert payloads(everything) == sent
            assert broker.objects.stats.gets > gets_before  # the history came from objects
            await asyncio.sleep(0.3)
            assert again.queue.empty()  # nothing delivered twice
    finally:
        await kv.close()


async def test_segments_are_uploaded_once_each(make_broker: BrokerFactory) -> None:
    broker: Broker = await make_broker(**COLD)
    assert broker.objects is not None and broker.uploader is not None
    async with Clients(broker.url) as clients:
        producers = [await clients.producer(f"/default/t{i}", f"p{i}") for i in range(10)]
        for _ in range(5):
            for producer in producers:
                await producer.send(b"x" * 200)
        await eventually(lambda: broker.uploader.stats.ranges >= 10, "uploads")
    keys = await broker.objects.list("segments/")
    assert keys and broker.objects.stats.puts == len(keys)
    assert broker.uploader.stats.segments >= len(keys)


@pytest.fixture(autouse=True)
def _no_env_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)


async def test_a_full_wal_is_cleaned_at_once_not_at_the_next_pass(
    make_broker: BrokerFactory,
) -> None:
    # local_only: the WAL is the only copy and retention.max_bytes bounds it (oldest data
    # goes first). The cleaner's periodic pass is far away: a full WAL must wake it.
    broker: Broker = await make_broker(
        **{
            "storage.wal.segment_bytes": "64KiB",
            "storage.wal.retention.max_bytes": "256KiB",
            "storage.wal.retention.check_seconds": 600,
        }
    )
    assert broker.store is not None and broker.cleaner is not None
    async with Clients(broker.url) as clients:
        producer = await clients.producer(T, "p1")
        async with asyncio.timeout(60):
            for i in range(2000):  # ~1.1 MB through a 256 KiB WAL
                await producer.send(f"m{i}".encode().ljust(500, b"."))
    assert broker.cleaner.stats.forced > 0
    assert broker.store.wal_bytes() <= 256 * 1024 + 2 * 64 * 1024
    info = broker.store.info(T)
    assert info is not None and info.first_offset > 0 and info.high_watermark == 2000


async def test_subscription_below_the_retained_floor_resumes_at_it(
    make_broker: BrokerFactory,
    etcd_server: str,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Retention removed the oldest range under a subscription persisted at cursor 0 (as a
    restarted broker finds it): the subscription moves up to the floor, says so in the log,
    and persists the moved cursor."""
    broker: Broker = await make_broker(**COLD)
    assert broker.objects is not None and broker.uploader is not None
    keys = Keys(etcd_prefix)
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    manifest = Manifest(kv, keys)
    try:
        async with Clients(broker.url) as clients:
            producer = await clients.producer(T, "p1")
            sent = [f"m{i:04}".encode().ljust(500, b".") for i in range(400)]
            for payload in sent[:300]:
                await producer.send(payload)
            async with asyncio.timeout(20):
                while await manifest.end_offset(T) < 300:
                    await asyncio.sleep(0.1)
            info = broker.store.info(T)  # type: ignore[union-attr]
            assert info is not None
            await PruneMarks(kv, keys).set_mark("broker-1", info.region, T, 300)
            await eventually(lambda: broker.cleaner.stats.segments >= 1, "pruning")  # type: ignore[union-attr]
            ranges = await manifest.ranges(T)
            assert len(ranges) >= 2
            # Keep the bytes of every range but the oldest: it expires.
            kept = sum(r.byte_length for r in ranges[1:])
            await Policies(kv, keys).set(T, RetentionPolicy(max_bytes=kept))
            report = await apply_retention(kv, keys)
            floor = ranges[0].end_offset
            assert [t.floor for t in report.topics] == [floor]
            # A subscription whose cursor is 0, not loaded by the broker yet.
            records = Records(kv, keys)
            await records.put_subscription(SubscriptionRecord(T, "s1", "Exclusive"))
            await records.set_cursor(T, "s1", 0)

            with caplog.at_level(logging.WARNING, logger="danube_ingest.dispatch.reliable"):
                again = await clients.consumer(T, "s1", "c1")
                got = await take_acking(again, 300 - floor)
            for payload in sent[300:]:
                await producer.send(payload)
            live = await take_acking(again, 100)
            everything = got + live
            assert offsets(everything) == list(range(floor, 400))  # from the floor, in order
            assert payloads(everything) == sent[floor:]
            moved = [r.getMessage() for r in caplog.records if "retained floor" in r.getMessage()]
            assert moved == [
                f"subscription below the retained floor, moved to it topic={T} subscription=s1 "
                f"cursor=0 floor={floor} skipped={floor}"
            ]
            async with asyncio.timeout(10):  # cursors are written by a periodic flush
                while (await records.get_cursor(T, "s1") or 0) < 400:
                    await asyncio.sleep(0.1)
    finally:
        await kv.close()
