"""``read_topic`` on a real local[2] Spark over tables converted from the real daemon's objects
(``daemon_support``): exactly the committed partitions, read through their commit records, and
a hold on the rendition for as long as the read is open."""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.analytics.convert import StoreSpec, convert
from danube_ingest.analytics.errors import RenditionHeldError
from danube_ingest.analytics.layout import partition_start
from danube_ingest.analytics.read import read_topic
from danube_ingest.analytics.records import TableKeys
from danube_ingest.analytics.renditions import activate, collect_rendition, create_rendition
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from tests.analytics.daemon_support import (
    AVRO,
    PAYLOADS,
    WIDTH_S,
    Produced,
    clone,
    expected_fields,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("danube-read-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture
async def kv(produced: Produced) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    yield store
    await store.close()


async def _convert(kv: EtcdKV, keys: Keys, produced: Produced, wh: ObjectStore, **more: Any) -> Any:
    objects = ObjectStore("fs", options={"root": str(produced.objects)})
    try:
        return await convert(
            kv=kv, keys=keys, objects=objects, warehouse=wh, topic=AVRO, width_s=WIDTH_S, **more
        )
    finally:
        await objects.close()


async def test_read_topic_returns_the_committed_partitions_and_holds_the_rendition(
    spark: Any, produced: Produced, kv: EtcdKV, tmp_path: Path
) -> None:
    keys = await clone(kv, produced.early)  # burst B's minute not complete: not committed
    wh_dir = tmp_path / "wh"
    spec = StoreSpec("fs", {"root": str(wh_dir)})
    wh = spec.open()
    await _convert(kv, keys, produced, wh)
    tables = TableKeys(keys, AVRO)
    opened = dict(endpoints=[produced.endpoint], prefix=keys.prefix, warehouse=spec)

    with read_topic(spark, AVRO, **opened) as df:
        holds = await kv.get_prefix(tables.holds_prefix())
        assert len(holds) == 1
        rows = sorted(
            (r.asDict() for r in await _collect(df.orderBy("offset"))), key=lambda r: r["offset"]
        )
    assert await kv.get_prefix(tables.holds_prefix()) == []  # released on exit
    # Only burst A: B's rows are in objects but their partition is not committed.
    assert [r["offset"] for r in rows] == list(range(25))
    for row in rows:
        assert bytes(row["payload"]) == PAYLOADS[AVRO](row["offset"])
        for name, value in expected_fields(AVRO, row["offset"]).items():
            assert row[name] == value

    # Bounds select whole partitions overlapping [start, end).
    first = min(r["ingest_time"] for r in rows).replace(tzinfo=dt.UTC)
    start = partition_start(int(first.timestamp() * 1000), WIDTH_S)
    with read_topic(spark, AVRO, None, start, **opened) as df:
        assert await _collect(df) == []
    with read_topic(spark, AVRO, start, start + 1, **opened) as df:
        in_first = await _collect(df)
    assert in_first and {r["offset"] for r in in_first} <= set(range(25))
    end = (
        partition_start(
            int(max(r["ingest_time"] for r in in_first).replace(tzinfo=dt.UTC).timestamp() * 1000),
            WIDTH_S,
        )
        + WIDTH_S * 1000
    )
    assert all(r["ingest_time"].replace(tzinfo=dt.UTC).timestamp() * 1000 < end for r in in_first)

    # A reader holding r1 across a handover to r2 keeps r1's files: collection waits for it.
    reading = read_topic(spark, AVRO, **opened)
    r2 = await create_rendition(kv, keys, AVRO, "test-2")
    await _convert(kv, keys, produced, wh, rendition=r2)
    await activate(kv, keys, AVRO, r2)
    with pytest.raises(RenditionHeldError):
        await collect_rendition(kv, keys, AVRO, "r1", wh, "warehouse/")
    assert len(await _collect(reading.df)) == 25  # still readable, whole
    reading.release()
    assert await collect_rendition(kv, keys, AVRO, "r1", wh, "warehouse/") >= 1
    with read_topic(spark, AVRO, **opened) as df:
        assert len(await _collect(df)) == 25  # new readers get r2, complete
    await wh.close()


async def _collect(df: Any) -> list[Any]:
    import asyncio

    rows: list[Any] = await asyncio.to_thread(df.collect)
    return rows
