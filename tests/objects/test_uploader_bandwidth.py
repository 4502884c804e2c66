"""SegmentUploader under ``storage.uploader.max_bytes_per_second``: real segments, a real fs
object store, real etcd. Elapsed time is bounded from below (deterministic: the bucket cannot
grant faster), bytes written from above only against a clock read *after* the bytes, and every
upload still ends committed in the manifest."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import STAGING_PREFIX, ObjectStore
from danube_ingest.objects.uploader import build_segment_object, segment_key
from danube_ingest.testing import broker_config, running_broker

from .support import FAST_RETRY, ColdStack, assert_one_line, eventually

pytestmark = pytest.mark.etcd

MiB = 1 << 20


def fs_store(tmp_path: Path) -> ObjectStore:
    return ObjectStore("fs", options={"root": str(tmp_path / "objects")}, retry=FAST_RETRY)


async def fill(stack: ColdStack, topics: list[str], per_topic: int, size: int) -> None:
    """Incompressible payloads (objects as large as segments), interleaved across topics."""
    for _ in range(0, per_topic, 10):
        for topic in topics:
            await stack.append(topic, [os.urandom(size) for _ in range(10)])


async def upload_watching(
    stack: ColdStack, created: float, rate: int, burst: int, timeout: float
) -> tuple[float, int]:
    """Start the uploader, wait until every sealed segment is uploaded while checking that
    the bytes written never ran ahead of the bucket; (seconds taken, most staging objects
    seen at once)."""
    objects = stack.objects
    started = time.monotonic()
    stack.uploader.start()
    most_staging = 0
    region = stack.store.regions[0]
    deadline = started + timeout
    while region.sealed - region.uploaded:
        written = objects.stats.bytes_written
        now = time.monotonic()  # read after the bytes: the bound below can only be looser
        assert written <= burst + rate * (now - created), (written, now - created)
        most_staging = max(most_staging, len(await objects.list(STAGING_PREFIX)))
        assert now < deadline, f"not uploaded: {sorted(region.sealed - region.uploaded)}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started, most_staging


async def test_uploads_keep_to_the_limit_and_still_commit(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    rate = 2 * MiB
    topics = [f"/default/bw{i}" for i in range(3)]
    created = time.monotonic()
    stack = await ColdStack(
        etcd_kv, keys, fs_store(tmp_path), tmp_path / "wal", max_bytes_per_second=rate
    ).open()
    try:
        bucket = stack.uploader.bandwidth
        assert bucket is not None and bucket.rate == rate
        await stack.acquire(*topics)
        await fill(stack, topics, per_topic=200, size=4000)  # 2.4 MB in 64 KiB segments
        await stack.seal()
        elapsed, _ = await upload_watching(stack, created, rate, bucket.burst, timeout=30)
        written = stack.uploader.stats.bytes
        assert written > 2 * MiB
        # Everything written went through the bucket, so it took at least this long.
        assert bucket.granted == written == stack.objects.stats.bytes_written
        assert elapsed >= (written - bucket.burst) / rate
        # Every segment is one object under its key, committed, and nothing was left staged.
        region = stack.store.regions[0]
        assert await stack.objects.list("segments/") == [
            segment_key("b1", "r0", seq) for seq in sorted(region.sealed)
        ]
        assert await stack.objects.list(STAGING_PREFIX) == []
        assert stack.uploader.stats.segments == len(region.sealed)
        for topic in topics:
            assert_one_line(await stack.manifest.ranges(topic), 200)
    finally:
        await stack.close()


async def test_the_limit_is_shared_by_concurrent_uploads(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    rate = 2 * MiB
    created = time.monotonic()
    stack = await ColdStack(
        etcd_kv,
        keys,
        fs_store(tmp_path),
        tmp_path / "wal",
        segment_bytes=512 * 1024,
        concurrency=4,
        max_bytes_per_second=rate,
    ).open()
    try:
        bucket = stack.uploader.bandwidth
        assert bucket is not None
        topic = "/default/bw-shared"
        await stack.acquire(topic)
        await fill(stack, [topic], per_topic=600, size=4000)  # 2.4 MB: 4-5 segments
        await stack.seal()
        assert len(stack.store.regions[0].sealed) >= 4
        elapsed, most_staging = await upload_watching(
            stack, created, rate, bucket.burst, timeout=30
        )
        # Several objects were being streamed at once ...
        assert most_staging >= 2
        # ... and together they still kept to one limit (a bucket per upload would have taken
        # a quarter of this).
        written = stack.uploader.stats.bytes
        assert elapsed >= (written - bucket.burst) / rate
        assert_one_line(await stack.manifest.ranges(topic), 600)
    finally:
        await stack.close()


async def test_the_daemon_uploads_with_the_configured_limit(
    etcd_server: str, tmp_path: Path
) -> None:
    config = broker_config(
        tmp_path / "data",
        etcd_server,
        prefix="/danube-bw",
        overrides={
            "storage.mode": "wal_cloud",
            "storage.uploader.max_bytes_per_second": "3MiB",
        },
    )
    async with asyncio.timeout(30), running_broker(config) as broker:
        assert broker.uploader is not None
        assert broker.uploader.bandwidth is not None
        assert broker.uploader.bandwidth.rate == 3 * MiB
    unlimited = broker_config(
        tmp_path / "data2",
        etcd_server,
        prefix="/danube-bw2",
        overrides={"storage.mode": "wal_cloud"},
    )
    async with asyncio.timeout(30), running_broker(unlimited) as broker:
        assert broker.uploader is not None and broker.uploader.bandwidth is None


async def test_every_store_uploads_under_a_limit_and_reruns_find_stored_objects(
    etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore, tmp_path: Path
) -> None:
    """memory, fs and s3: the paced path (``put_large``, multipart parts on s3) stores every
    segment and commits it; an object already stored by an earlier run is used, not built
    and written again."""
    rate = 8 * MiB
    stack = await ColdStack(
        etcd_kv, keys, object_store, tmp_path / "wal", max_bytes_per_second=rate
    ).open()
    try:
        topic = "/default/bw-stores"
        await stack.acquire(topic)
        await fill(stack, [topic], per_topic=200, size=4000)
        await stack.seal()
        region = stack.store.regions[0]
        sealed = sorted(region.sealed)
        # As if an earlier run had stored the first segment's object and crashed before its
        # commit: the same bytes under the same key.
        first = sealed[0]
        data = await region.read(first, 0, region.segment_sizes[first])
        key = segment_key("b1", "r0", first)
        built = build_segment_object(data, key=key, codec=stack.codec)
        assert built.data is not None
        await object_store.put(key, built.data)
        puts_before = object_store.stats.puts
        started = time.monotonic()
        stack.uploader.start()
        await eventually(
            lambda: not region.sealed - region.uploaded, stack.uploader.stats.__repr__, 30
        )
        elapsed = time.monotonic() - started
        bucket = stack.uploader.bandwidth
        assert bucket is not None
        # memory keeps no modification time: a found object counts as stored long ago and is
        # stored again (paced too) right before its commit (OBJECT_REFRESH_SECONDS).
        refreshed = 1 if object_store.scheme == "memory" else 0
        assert stack.uploader.stats.puts == len(sealed) - 1 + refreshed
        assert object_store.stats.puts - puts_before == len(sealed) - 1 + refreshed
        assert elapsed >= (bucket.granted - bucket.burst) / rate
        assert bucket.granted == stack.uploader.stats.bytes > 0
        assert await object_store.list("segments/") == [
            segment_key("b1", "r0", seq) for seq in sealed
        ]
        assert await object_store.list(STAGING_PREFIX) == []
        assert_one_line(await stack.manifest.ranges(topic), 200)
    finally:
        await stack.close()
