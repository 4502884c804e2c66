"""The cold path assembled as the daemon assembles it, for store-level tests.

``ColdStack`` = a broker session and ownership on the real etcd, a TopicStore on a WAL
directory, the SegmentUploader, the CloudReader and the WalCleaner, over a given object store.
It can be closed and reopened on the same directories (a restart).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from danube_ingest.config import load_config
from danube_ingest.config.models import RetentionConfig
from danube_ingest.metadata import BrokerSession, Keys, Ownership
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.records import Records, TopicRecord
from danube_ingest.objects.cleaner import WalCleaner
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.objects.uploader import SegmentUploader
from danube_ingest.store import TopicReader, TopicStore
from danube_ingest.wal.framing import Entry

FAST_RETRY = RetryPolicy(max_retries=2, base_delay=0.01, max_delay=0.05)

T = "/default/cold"


def payloads(topic: str, n: int, start: int = 0, size: int = 300) -> list[bytes]:
    return [f"{topic}:{i}:".encode().ljust(size, b".") for i in range(start, start + n)]


async def read_n(reader: TopicReader, n: int, timeout: float = 20.0) -> list[Entry]:
    """The reader's next ``n`` entries (fails if they do not come within ``timeout``)."""
    out: list[Entry] = []

    async def run() -> None:
        while len(out) < n:
            out.extend(await reader.next_batch())

    await asyncio.wait_for(run(), timeout)
    return out


async def eventually(
    condition: Callable[[], bool], state: Callable[[], object], timeout: float = 20.0
) -> None:
    """Wait until ``condition()``; fail after ``timeout`` seconds showing ``state()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, state()
        await asyncio.sleep(0.05)


async def prune_all(stack: ColdStack, *topics: str) -> list[tuple[str, int]]:
    """Mark every topic fully prunable (what Dagster does once all is consumed) and clean."""
    marks = PruneMarks(stack.kv, stack.keys)
    for topic in topics:
        info = stack.store.info(topic)
        assert info is not None
        await marks.set_mark(stack.broker_id, info.region, topic, info.high_watermark)
    return await stack.cleaner.clean_once()


def retention(**values: Any) -> RetentionConfig:
    overrides: dict[str, Any] = {"storage.wal.segment_bytes": "64KiB"}
    overrides.update({f"storage.wal.retention.{key}": value for key, value in values.items()})
    config = load_config(None, overrides)
    return config.storage.wal.retention


class ColdStack:
    def __init__(
        self,
        kv: KV,
        keys: Keys,
        objects: ObjectStore,
        wal_dir: Path,
        *,
        broker_id: str = "b1",
        codec: str = "zstd",
        retention_values: dict[str, Any] | None = None,
        max_wal_bytes: int | None = None,
        segment_bytes: int = 64 * 1024,
        lease_ttl: int = 5,
        cache_bytes: int = 256 * 1024 * 1024,
        concurrency: int = 4,
        max_bytes_per_second: int | None = None,
    ) -> None:
        self.kv = kv
        self.keys = keys
        self.objects = objects
        self.wal_dir = wal_dir
        self.broker_id = broker_id
        self.codec = codec
        self.retention = retention(**(retention_values or {}))
        self.max_wal_bytes = max_wal_bytes
        self.segment_bytes = segment_bytes
        self.lease_ttl = lease_ttl
        self.cache_bytes = cache_bytes
        self.concurrency = concurrency
        self.max_bytes_per_second = max_bytes_per_second
        self.manifest = Manifest(kv, keys)

    async def open(self) -> ColdStack:
        self.session = BrokerSession(
            self.kv, self.keys, self.broker_id, f"http://{self.broker_id}", ttl=self.lease_ttl
        )
        await self.session.start()
        self.ownership = Ownership(self.kv, self.keys, self.session)
        self.store = await TopicStore.open(
            self.wal_dir,
            segment_bytes=self.segment_bytes,
            segment_seconds=3600,
            max_wal_bytes=self.max_wal_bytes,
            cache_max_bytes=self.cache_bytes,
            cache_topic_max_bytes=min(self.cache_bytes, 8 * 1024 * 1024),
        )
        self.store.attach_cloud(CloudReader(self.manifest, self.objects))
        self.uploader = SegmentUploader(
            self.store,
            self.objects,
            self.manifest,
            self.ownership,
            codec=self.codec,
            retry=FAST_RETRY,
            concurrency=self.concurrency,
            max_bytes_per_second=self.max_bytes_per_second,
        )
        self.cleaner = WalCleaner(
            self.store,
            broker_id=self.broker_id,
            retention=self.retention,
            kv=self.kv,
            keys=self.keys,
            require_upload=True,
            interval=3600,
        )
        return self

    async def acquire(self, *topics: str) -> None:
        """Create the topics' records (as a broker does before anyone owns a topic: the
        uploader never acquires a topic without one) and acquire them."""
        records = Records(self.kv, self.keys)
        for topic in topics:
            await records.create_topic_if_absent(TopicRecord(name=topic))
            owner = await self.ownership.acquire(topic)
            assert owner.broker_id == self.broker_id

    async def append(self, topic: str, payloads: Sequence[bytes]) -> list[int]:
        return list(await asyncio.gather(*(self.store.append(topic, Entry(p)) for p in payloads)))

    async def seal(self) -> None:
        """Seal every region's active segment now (waits until the seal is durable)."""
        for region in self.store.regions:
            active = region.active_seq
            region.rotate()
            while active not in region.sealed:
                await asyncio.sleep(0.005)

    async def seal_and_upload(self, timeout: float = 20.0) -> None:
        """Seal the active segments and wait until everything sealed is uploaded."""
        await self.seal()
        await self._settle(timeout)

    async def _settle(self, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            pending = [
                seq
                for region in self.store.regions
                for seq in region.sealed - region.uploaded
                if (region.region, seq) not in self.uploader.stats.orphans
            ]
            if not pending:
                return
            assert asyncio.get_running_loop().time() < deadline, f"not uploaded: {pending}"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.uploader.stop()
        await self.cleaner.stop()
        await self.store.close()
        await self.ownership.close()
        await self.session.close()


async def manifest_ranges(manifest: Manifest, topic: str) -> list[ObjectRange]:
    return await manifest.ranges(topic, 0)


def assert_one_line(ranges: Sequence[ObjectRange], end: int) -> None:
    """The ranges cover [0, end) exactly once, in order, with non-decreasing epochs."""
    position = 0
    epoch = 0
    for rng in ranges:
        assert rng.start_offset == position, (rng, position)
        assert rng.end_offset > rng.start_offset
        assert rng.epoch >= epoch
        position = rng.end_offset
        epoch = rng.epoch
    assert position == end, (position, end)
