"""Helpers of the table tests: the column schema written out literally, Arrow rows built from
offsets and ingest times, real manifest entries and clocks in the KV, a whole conversion run
through the library's steps, and the warehouse stores (memory, fs, s3 on moto)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from danube_ingest.analytics import layout
from danube_ingest.analytics.commit import CommitOutcome, advance_frontier, begin, commit_partition
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.plan import Partition, plan_run
from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.testing import MotoServer

TOPIC = "/default/orders"
ROOT = "warehouse/"
HOUR = 3_600_000
#: 2026-11-24T10:00:00Z: a partition start for every allowed width.
T0 = 1_795_514_400_000
FAST_RETRY = RetryPolicy(max_retries=2, base_delay=0.001, max_delay=0.005)

UTC_US = pa.timestamp("us", tz="UTC")
#: The table columns of a topic without a schema, exactly as issue 12's design fixes them.
SCHEMA = pa.schema(
    [
        ("offset", pa.int64()),
        ("ingest_time", UTC_US),
        ("publish_time", UTC_US),
        ("producer", pa.string()),
        ("routing_key", pa.string()),
        ("attributes", pa.map_(pa.string(), pa.string())),
        ("schema_subject", pa.string()),
        ("schema_id", pa.int64()),
        ("schema_version", pa.int32()),
        ("payload", pa.binary()),
    ]
)


def ingest_ms_of(offset: int) -> int:
    """The ingest time the tests give an offset: 100 offsets per 10 minutes from T0."""
    return T0 + offset * 6_000


def rows(offsets: Sequence[int], at: Callable[[int], int] = ingest_ms_of) -> pa.RecordBatch:
    """One batch of rows for ``offsets`` (payloads and attributes derived from the offset)."""
    n = len(offsets)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(offsets, pa.int64()),
            pa.array([at(o) * 1000 for o in offsets], UTC_US),
            pa.array([at(o) * 1000 - 5 for o in offsets], UTC_US),
            pa.array([f"p{o % 3}" for o in offsets], pa.string()),
            pa.array([None if o % 2 else f"k{o % 5}" for o in offsets], pa.string()),
            pa.array([[("n", str(o))] for o in offsets], pa.map_(pa.string(), pa.string())),
            pa.array([None] * n, pa.string()),
            pa.array([None] * n, pa.int64()),
            pa.array([None] * n, pa.int32()),
            pa.array([f"payload-{o}".encode() * (1 + o % 4) for o in offsets], pa.binary()),
        ],
        schema=SCHEMA,
    )


def object_range(start: int, end: int, at: Callable[[int], int] = ingest_ms_of) -> ObjectRange:
    """A manifest entry for offsets ``[start, end)`` (the object's bytes are not needed here)."""
    return ObjectRange(
        topic=TOPIC,
        object_key=f"segments/b1/0/{start:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=0,
        byte_length=100,
        object_size=100,
        object_crc=0,
        first_ingest_ms=at(start),
        last_ingest_ms=at(end - 1),
        kind="segment",
        broker="b1",
        epoch=1,
    )


async def publish_input(kv: KV, keys: Keys, ends: Sequence[int], clock: TopicClock) -> None:
    """Manifest ranges ending at each of ``ends`` (from 0, contiguous) and the topic clock."""
    start = 0
    for end in ends:
        entry = object_range(start, end)
        await kv.put(keys.storage_object(TOPIC, start), entry.encode())
        start = end
    await kv.put(keys.topic_clock(TOPIC), clock.encode())


def partition_rows(partition: Partition) -> list[pa.RecordBatch]:
    """The rows of a planned partition, as the converter would read them, in two batches
    (reversed, so the writer must sort)."""
    offsets = [
        o
        for o in range(partition.min_offset, partition.end_offset)
        if partition.start_ms <= ingest_ms_of(o) < partition.end_ms
    ]
    half = len(offsets) // 2
    return [rows(offsets[half:]), rows(offsets[:half])] if offsets else []


async def run_conversion(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    rendition: str,
    *,
    root: str = ROOT,
    converter_version: str = "test-1",
    limit: int = 100,
    intent_ttl: int = 30,
) -> list[CommitOutcome]:
    """One whole run, as the Spark job will do it: plan from etcd, announce the intent, stage
    each partition, commit it, advance the frontier."""
    plan = await plan_run(kv, keys, TOPIC, rendition, limit=limit)
    partitions, width_s = plan.partitions, plan.width_s
    outcomes = []
    starts = [p.start_ms for p in partitions]
    intent = await begin(kv, keys, TOPIC, rendition, starts, plan.input_revision, ttl=intent_ttl)
    async with intent:
        for partition in partitions:
            final_dir = layout.partition_dir(rendition, TOPIC, partition.start_ms, width_s)
            staged_dir = intent.staging_path(root, f"{root}{final_dir}")
            files = await write_partition(store, staged_dir, partition_rows(partition), SCHEMA)
            outcomes.append(
                await commit_partition(
                    intent, store, root, partition.start_ms, width_s, files, converter_version
                )
            )
    await advance_frontier(kv, keys, TOPIC, rendition)
    return outcomes


async def snapshot(store: ObjectStore, prefix: str = ROOT) -> dict[str, bytes]:
    """Every object below ``prefix``, key → bytes."""
    return {key: await store.get(key) for key in await store.list(prefix)}


@pytest.fixture(params=["memory", "fs", pytest.param("s3", marks=pytest.mark.s3)])
async def warehouse(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    """The same test on a memory, an fs and an s3 (moto) object store."""
    store: ObjectStore
    if request.param == "memory":
        store = ObjectStore.memory(retry=FAST_RETRY)
    elif request.param == "fs":
        store = ObjectStore("fs", options={"root": str(tmp_path / "objects")}, retry=FAST_RETRY)
    else:
        server: MotoServer = request.getfixturevalue("s3_server")
        bucket = server.create_bucket("danube-tables-test")
        root = f"/test-{uuid.uuid4().hex[:12]}"
        store = ObjectStore("s3", options=server.options(bucket, root), retry=FAST_RETRY)
    yield store
    await store.close()


def lose_first_commit_answer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the first Iceberg commit that adds a snapshot through a SQL catalog land, then
    raise ``CommitStateUnknownException`` as if its answer was lost (the catalog applied it).
    Returns a list that holds one item once that happened."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import CommitStateUnknownException

    real = SqlCatalog.commit_table
    lost: list[int] = []

    def commit_then_lose_the_answer(self: Any, *args: Any, **kwargs: Any) -> Any:
        answer = real(self, *args, **kwargs)
        if not lost and any(getattr(u, "action", "") == "add-snapshot" for u in args[2]):
            lost.append(1)
            raise CommitStateUnknownException("connection reset after the commit")
        return answer

    monkeypatch.setattr(SqlCatalog, "commit_table", commit_then_lose_the_answer)
    return lost
