"""Schema evolution without a rewrite (``analytics/evolve.py``): a topic's Avro subject gains a
version that widens two columns and adds one; the next conversion follows it in the active
rendition, the files already written stay as they are, and the Iceberg table (pyiceberg and
Spark SQL by name) and ``read_topic`` read every row with the new columns. A version that
changes a column's type is not followed. Real etcd, real ``.bin`` objects, an fs warehouse,
the SQLite catalog, Spark ``local[2]``."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import fastavro
import pyarrow as pa
import pytest

from danube_ingest.analytics import catalog_session
from danube_ingest.analytics.convert import StoreSpec, convert
from danube_ingest.analytics.evolve import evolve_schema
from danube_ingest.analytics.iceberg import IcebergTarget, _schema_grows, check_table, identifier
from danube_ingest.analytics.read import _aligned, open_topic
from danube_ingest.analytics.renditions import read_rendition, read_table
from danube_ingest.analytics.tail import extend_tail
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.objects.store import ObjectStore
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore
from danube_ingest.wal.framing import Entry
from tests.analytics.test_iceberg_lifecycle import target as make_target
from tests.pipelines.parquet_support import (
    H0,
    HOUR,
    MINUTE,
    PER_HOUR,
    ROOT,
    TOPIC,
    ingest_ms,
    publish_topic,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]

SUBJECT = "orders-value"
V1 = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "int"},
        {"name": "price", "type": "float"},
        {"name": "name", "type": "string"},
    ],
}
#: ``id`` and ``price`` widened, ``channel`` added (with a default: v1 data still reads).
V2 = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "price", "type": "double"},
        {"name": "name", "type": "string"},
        {"name": "channel", "type": "string", "default": "web"},
    ],
}
#: ``name`` becomes a number: not an extension.
V3 = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "price", "type": "double"},
        {"name": "name", "type": "long", "default": 0},
        {"name": "channel", "type": "string", "default": "web"},
    ],
}


def _avro(schema: dict[str, Any], value: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), value)
    return out.getvalue()


def _entry_of(schema_id: int) -> Any:
    """Offsets of the first hour are written with v1, the rest with v2 (channel ``app``)."""

    def entry(offset: int) -> Entry:
        value: dict[str, Any] = {"id": offset, "price": offset / 4, "name": f"n{offset}"}
        version, schema = (1, V1) if offset < PER_HOUR else (2, {**V2})
        if version == 2:
            value["channel"] = "app"
        return Entry(
            _avro(schema, value),
            producer_name="p",
            publish_ms=ingest_ms(offset) - 5,
            schema_id=schema_id,
            schema_version=version,
        )

    return entry


async def _convert(kv: EtcdKV, keys: Keys, store: ObjectStore, target: IcebergTarget) -> None:
    await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target)


async def _clock(kv: EtcdKV, keys: Keys, at_ms: int, offset: int) -> None:
    clock = TopicClock(offset=offset, ingest_ms=at_ms, broker="b1", epoch=1)
    await kv.put(keys.topic_clock(TOPIC), clock.encode())


def _parquet_files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in (root / ROOT / "r1").rglob("*.parquet")}


async def test_a_wider_version_is_followed_without_a_rewrite(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    registry = SchemaRegistry(KVSchemaStore(etcd_kv, keys))
    v1 = await registry.register(SUBJECT, "avro", json.dumps(V1).encode())
    await registry.configure_topic_schema(TOPIC, SUBJECT)
    objects = tmp_path / "objects"
    store = ObjectStore("fs", options={"root": str(objects)})
    target: IcebergTarget = make_target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store, entry_of=_entry_of(v1.schema_id))
    await _clock(etcd_kv, keys, H0 + HOUR, PER_HOUR)  # only the first hour is complete

    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    table = target.catalog().load_table(identifier(TOPIC))
    assert {f.name: str(f.field_type) for f in table.schema().fields if f.name in V2_NAMES} == {
        "id": "int",
        "price": "float",
        "name": "string",
    }
    first_hour = _parquet_files(objects)
    assert len(first_hour) == 1

    # Nothing newer yet: nothing to follow.
    assert await evolve_schema(etcd_kv, keys, TOPIC) is None
    await registry.register(SUBJECT, "avro", json.dumps(V2).encode())
    # The tail (half of the second hour) follows it first: its piece has the new columns.
    await _clock(etcd_kv, keys, H0 + HOUR + 30 * MINUTE, PER_HOUR + PER_HOUR // 2)
    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    assert step is not None and step.rows == PER_HOUR // 2
    record = await read_rendition(etcd_kv, keys, TOPIC, "r1")
    assert record is not None and record.schema_ref == f"{SUBJECT}:2"
    await _clock(etcd_kv, keys, H0 + 2 * HOUR, 2 * PER_HOUR)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )

    # Same rendition, the first hour's file untouched, the second hour's with the new columns.
    tables = await read_table(etcd_kv, keys, TOPIC)
    assert tables is not None and tables.active == "r1"
    files = _parquet_files(objects)
    assert {p: files[p] for p in first_hour} == first_hour and len(files) == 2
    table = target.catalog().load_table(identifier(TOPIC))
    assert {f.name: str(f.field_type) for f in table.schema().fields if f.name in V2_NAMES} == {
        "id": "long",
        "price": "double",
        "name": "string",
        "channel": "string",
    }
    rows = table.scan(selected_fields=("offset", "id", "price", "channel")).to_arrow()
    rows = rows.sort_by("offset").to_pylist()
    assert [r["offset"] for r in rows] == list(range(2 * PER_HOUR))
    assert [r["id"] for r in rows] == list(range(2 * PER_HOUR))
    assert [r["price"] for r in rows] == [o / 4 for o in range(2 * PER_HOUR)]
    assert [r["channel"] for r in rows] == [None] * PER_HOUR + ["app"] * PER_HOUR
    assert await check_table(etcd_kv, keys, TOPIC, target) == []

    # Spark SQL by name, and read_topic (the rendition's files with its current columns).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = catalog_session(
        "evolve-test",
        master="local[2]",
        config={"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC"},
        broker_config=target_config(tmp_path),
    )
    try:
        by_name = spark.sql(
            "SELECT count(*) AS n, count(channel) AS with_channel, sum(id) AS ids, "
            "typeof(max(id)) AS id_type FROM danube.default.orders"
        ).first()
        total = sum(range(2 * PER_HOUR))
        assert (by_name.n, by_name.with_channel, by_name.ids, by_name.id_type) == (
            2 * PER_HOUR,
            PER_HOUR,
            total,
            "bigint",
        )
        spec = StoreSpec("fs", {"root": str(objects)})
        async with open_topic(spark, TOPIC, kv=etcd_kv, keys=keys, warehouse=spec) as frame:
            read = frame.selectExpr("count(*) AS n", "count(channel) AS c", "sum(id) AS ids")
            got = read.first()
        assert (got.n, got.c, got.ids) == (2 * PER_HOUR, PER_HOUR, total)
    finally:
        spark.stop()

    # v3 changes a column's type: not followed; the table keeps v2 and converts on.
    await registry.set_compatibility_mode(SUBJECT, "NONE")
    await registry.register(SUBJECT, "avro", json.dumps(V3).encode())
    refused = await evolve_schema(etcd_kv, keys, TOPIC)
    assert refused is not None and refused.refused is not None
    assert "'name'" in refused.refused and "string" in refused.refused
    record = await read_rendition(etcd_kv, keys, TOPIC, "r1")
    assert record is not None and record.schema_ref == f"{SUBJECT}:2"
    await store.close()


V2_NAMES = {"id", "price", "name", "channel"}


def target_config(tmp_path: Path) -> Any:
    from danube_ingest.config import load_config

    return load_config(
        None, {"broker.data_dir": str(tmp_path), "storage.cloud.root": str(tmp_path / "objects")}
    )


def test_old_files_are_read_with_the_current_columns() -> None:
    """``read_topic``'s pyarrow path: a file from before the evolution gets the added column
    as null and its narrower column cast."""
    current = pa.schema([("offset", pa.int64()), ("id", pa.int64()), ("channel", pa.string())])
    old = pa.table({"offset": pa.array([1, 2], pa.int64()), "id": pa.array([5, 6], pa.int32())})
    aligned = _aligned(old, current)
    assert aligned.schema == current
    assert aligned.to_pylist() == [
        {"offset": 1, "id": 5, "channel": None},
        {"offset": 2, "id": 6, "channel": None},
    ]


def test_a_widened_column_alone_changes_the_iceberg_schema() -> None:
    """The publish updates the table's schema for a widening even when no column is new."""
    table = pa.schema([("offset", pa.int64()), ("id", pa.int32()), ("price", pa.float32())])
    same = pa.schema([("offset", pa.int64()), ("id", pa.int32()), ("price", pa.float32())])
    assert not _schema_grows(table, same)
    assert _schema_grows(table, same.set(1, pa.field("id", pa.int64())))
    assert _schema_grows(table, same.set(2, pa.field("price", pa.float64())))
    assert _schema_grows(table, same.append(pa.field("channel", pa.string())))
    # A narrower wanted type (a slow publisher with the older schema) changes nothing.
    assert not _schema_grows(same.set(1, pa.field("id", pa.int64())), same)
