"""The "danube" Spark data source on a real local[2] SparkSession: a topic with an Avro
schema, written through the real TopicStore and uploader (manifest on the real etcd, objects
on fs), read back with ``spark.read.format("danube")`` and compared with what was produced."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest

from danube_ingest.analytics.spark_source import DanubeDataSource
from danube_ingest.errors import ConfigError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore
from danube_ingest.wal.framing import Entry
from tests.objects.support import ColdStack

T = "/default/orders"
SCHEMA = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "item", "type": "string"},
        {"name": "qty", "type": ["null", "int"], "default": None},
    ],
}


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from danube_ingest.analytics.spark_source import register

    session = (
        SparkSession.builder.master("local[2]")
        .appName("danube-source-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    register(session)
    yield session
    session.stop()


def datum(i: int) -> bytes:
    out = io.BytesIO()
    value = {"id": i, "item": f"item-{i}", "qty": None if i % 4 == 0 else i}
    fastavro.schemaless_writer(out, fastavro.parse_schema(SCHEMA), value)
    return out.getvalue()


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_spark_reads_a_produced_avro_topic(
    spark: Any, etcd_server: str, etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    registry = SchemaRegistry(KVSchemaStore(etcd_kv, keys))
    registered = await registry.register("orders", "avro", json.dumps(SCHEMA).encode())
    await registry.configure_topic_schema(T, "orders")
    root = tmp_path / "objects"
    stack = await ColdStack(etcd_kv, keys, ObjectStore("fs", options={"root": str(root)}),
                            tmp_path / "wal").open()  # fmt: skip
    sent: list[Entry] = []
    try:
        await stack.acquire(T)
        stack.uploader.start()
        for round_ in range(3):
            batch = [
                Entry(
                    datum(i) if i != 17 else b"\x00garbage",
                    schema_id=registered.schema_id,
                    schema_version=1,
                    producer_name="p",
                    attributes={"round": str(round_)},
                )
                for i in range(round_ * 30, round_ * 30 + 30)
            ]
            await asyncio.gather(*(stack.store.append(T, e) for e in batch))
            sent.extend(batch)
            await stack.seal_and_upload()
    finally:
        await stack.close()

    options = {
        "topic": T,
        "etcd.endpoints": etcd_server,
        "etcd.prefix": keys.prefix,
        "objects.root": str(root),
        "max_rows": "7",
    }

    def read(**extra: str) -> tuple[int, list[Any]]:
        df = spark.read.format("danube").options(**options, **extra).load()
        return df.rdd.getNumPartitions(), df.orderBy("offset").collect()

    partitions, rows = await asyncio.to_thread(read)
    assert partitions == 3  # one per manifest range
    assert [r["offset"] for r in rows] == [e.offset for e in sent] == list(range(90))
    for row, e in zip(rows, sent, strict=True):
        assert bytes(row["payload"]) == e.payload
        assert row["attributes"] == e.attributes
        assert (row["schema_subject"], row["schema_id"], row["schema_version"]) == (
            "orders",
            registered.schema_id,
            1,
        )
        if e.offset == 17:
            assert row["id"] is None and row["decode_error"]
            continue
        # Consumer-independent check: the fields as the producer wrote them.
        i = e.offset
        assert (row["id"], row["item"], row["qty"]) == (i, f"item-{i}", None if i % 4 == 0 else i)
        assert row["decode_error"] is None

    _, bounded = await asyncio.to_thread(read, start_offset="25", end_offset="65")
    assert [r["offset"] for r in bounded] == list(range(25, 65))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, 'option "topic" is required'),
        ({"topic": "orders"}, "invalid topic name"),
        ({"topic": T, "objects.root": "/x", "objects.option.secret_access_key": "k"}, "credential"),
        ({"topic": T}, "'objects.root' is required for the fs backend"),
        ({"topic": T, "objects.backend": "memory"}, "memory stores cannot be shared"),
        ({"topic": T, "objects.backend": "s3", "objects.bucket": "b"}, "'objects.region'"),
        ({"topic": T, "objects.root": "/x", "start_offset": "-1"}, "'start_offset' must be >= 0"),
        ({"topic": T, "objects.root": "/x", "end_time": "yesterday"}, "ISO 8601"),
    ],
)
def test_bad_options_are_refused_on_the_driver(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DanubeDataSource(options)


def test_time_options_take_iso_or_millis() -> None:
    source = DanubeDataSource(
        {
            "topic": T,
            "objects.root": "/x",
            "start_time": "2026-11-24T10:00:00Z",
            "end_time": "1764000000123",
        }
    )
    settings = source._settings
    assert settings.start_ms == 1_795_514_400_000
    assert settings.end_ms == 1_764_000_000_123
    assert DanubeDataSource.name() == "danube"


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_register_refuses_workers_that_cannot_import_the_source(tmp_path: Path) -> None:
    """A session started with PYSPARK_PYTHON naming an interpreter without danube_ingest and
    pyarrow (here: this one without site-packages) fails at ``register``, saying what to set,
    instead of in a worker at the first read."""
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    child = (
        "import time\n"
        "from pyspark.sql import SparkSession\n"
        "from danube_ingest.analytics.spark_source import register\n"
        "spark = SparkSession.builder.master('local[1]')"
        ".config('spark.ui.enabled', 'false').getOrCreate()\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    register(spark)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    print('seconds', time.monotonic() - started)\n"
        "spark.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYSPARK_PYTHON": str(bare)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ConfigError danube data source: Spark runs its Python workers")
    assert str(bare) in lines[0] and f"set PYSPARK_PYTHON={sys.executable}" in lines[0]
    assert float(lines[1].split()[1]) < 30
