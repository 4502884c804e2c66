"""Entries to Arrow batches: the fixed columns, Avro and JSON Schema payloads decoded into
typed columns through schemas registered with the real ``SchemaRegistry``, and payloads that
do not decode (kept, with their error)."""

from __future__ import annotations

import datetime as dt
import io
import json
import pickle
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from danube_ingest.analytics import FIXED_SCHEMA, entries_to_batch, load_decoder, table_schema
from danube_ingest.metadata import Keys, MemoryKV
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore
from danube_ingest.wal.framing import Entry

T = "/default/orders"
UTC = dt.UTC

ORDER_V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "offset", "type": "string"},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "props", "type": {"type": "map", "values": "int"}},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {
            "name": "amount",
            "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2},
        },
        {
            "name": "addr",
            "type": {
                "type": "record",
                "name": "Addr",
                "fields": [{"name": "city", "type": "string"}],
            },
        },
        {"name": "choice", "type": ["int", "string"]},
    ],
}
ORDER_V2 = {
    **ORDER_V1,
    "fields": [*ORDER_V1["fields"], {"name": "channel", "type": "string", "default": "web"}],
}


def avro_bytes(schema: dict[str, Any], value: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), value)
    return out.getvalue()


def order(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "offset": f"o{i}",
        "note": None if i % 2 else f"note {i}",
        "kind": "AB"[i % 2],
        "tags": [f"t{i}", "x"],
        "props": {"k": i},
        "at": dt.datetime(2026, 11, 24, 10, 0, i, 123000, tzinfo=UTC),
        "day": dt.date(2026, 11, 24),
        "amount": Decimal(f"{i}.25"),
        "addr": {"city": "Vienna"},
        "choice": i if i % 2 else "s",
    }


def entry(payload: bytes, offset: int, schema_id: int | None = None, version: int = 0) -> Entry:
    e = Entry(payload, schema_id=schema_id, schema_version=version, producer_name="p1")
    e.offset = offset
    e.ingest_ms = 1_764_000_000_000 + offset
    return e


@pytest.fixture
def registry() -> SchemaRegistry:
    return SchemaRegistry(KVSchemaStore(MemoryKV(), Keys("/t")))


def spark_round_trip(schema: pa.Schema) -> pa.Schema:
    # (pyspark 4.1: timestamps come back in UTC, timestamp_utc=True.)
    return to_arrow_schema(from_arrow_schema(schema), timestamp_utc=True)


async def test_fixed_columns_without_schema() -> None:
    entries = [entry(b"a", 0), entry(b"b", 1)]
    entries[0].attributes = {"k": "v", "k2": "v2"}
    entries[0].routing_key = "rk"
    entries[1].publish_ms = 1_764_000_000_500
    entries[1].schema_id = 9  # a schema id on a topic without a subject is kept as is
    entries[1].schema_version = 3
    batch = entries_to_batch(entries, None)
    assert batch.schema == table_schema(None)
    assert batch.schema.names == [*FIXED_SCHEMA.names, "decode_error"]
    rows = batch.to_pylist()
    assert [r["offset"] for r in rows] == [0, 1]
    assert rows[0]["ingest_time"] == dt.datetime(2025, 11, 24, 16, 0, tzinfo=UTC)
    assert rows[1]["publish_time"] == dt.datetime(2025, 11, 24, 16, 0, 0, 500000, tzinfo=UTC)
    assert rows[0]["attributes"] == [("k", "v"), ("k2", "v2")]
    assert rows[1]["attributes"] == []
    assert [r["routing_key"] for r in rows] == ["rk", None]
    assert [r["producer"] for r in rows] == ["p1", "p1"]
    assert [(r["schema_subject"], r["schema_id"], r["schema_version"]) for r in rows] == [
        (None, None, None),
        (None, 9, 3),
    ]
    assert [r["payload"] for r in rows] == [b"a", b"b"]
    assert [r["decode_error"] for r in rows] == [None, None]
    assert spark_round_trip(batch.schema).equals(batch.schema)


async def test_avro_topic_decodes_typed_columns(registry: SchemaRegistry) -> None:
    v1 = await registry.register("orders-value", "avro", json.dumps(ORDER_V1).encode())
    await registry.configure_topic_schema(T, "orders-value")
    decoder = await load_decoder(registry, T)
    assert decoder is not None
    sid = v1.schema_id
    entries = [entry(avro_bytes(ORDER_V1, order(i)), i, sid, 1) for i in range(3)]
    entries.append(entry(b"\xff\xff not avro", 3, sid, 1))
    entries.append(entry(avro_bytes(ORDER_V1, order(4)) + b"!", 4, sid, 1))
    entries.append(entry(avro_bytes(ORDER_V1, order(5)), 5, sid + 100, 1))
    batch = entries_to_batch(entries, decoder)

    schema = batch.schema
    assert schema == table_schema(decoder)
    decoded = schema.names[len(FIXED_SCHEMA) : -1]
    # "offset" clashes with a fixed column: it becomes value_offset.
    assert decoded == [
        "id", "value_offset", "note", "kind", "tags", "props", "at", "day", "amount", "addr",
        "choice",
    ]  # fmt: skip
    assert schema.field("id").type == pa.int64()
    assert schema.field("kind").type == pa.string()
    assert schema.field("tags").type == pa.list_(pa.field("element", pa.string(), False))
    assert schema.field("props").type == pa.map_(pa.string(), pa.field("value", pa.int32(), False))
    assert schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert schema.field("day").type == pa.date32()
    assert schema.field("amount").type == pa.decimal128(10, 2)
    assert schema.field("addr").type == pa.struct([pa.field("city", pa.string(), False)])
    assert schema.field("choice").type == pa.string()  # a union of two types: JSON text
    assert spark_round_trip(schema).equals(schema)

    rows = batch.to_pylist()
    assert len(rows) == len(entries)  # nothing dropped
    for i in range(3):
        expected = order(i)
        row = rows[i]
        assert row["decode_error"] is None
        assert (row["schema_subject"], row["schema_id"], row["schema_version"]) == (
            "orders-value",
            sid,
            1,
        )
        assert row["id"] == i and row["value_offset"] == f"o{i}"
        assert row["note"] == expected["note"]
        assert row["kind"] == expected["kind"] and row["tags"] == expected["tags"]
        assert row["props"] == [("k", i)]
        assert row["at"] == expected["at"] and row["day"] == expected["day"]
        assert row["amount"] == expected["amount"] and row["addr"] == {"city": "Vienna"}
        assert row["choice"] == json.dumps(expected["choice"])
    for i in (3, 4, 5):
        row = rows[i]
        assert row["payload"] == entries[i].payload
        assert all(row[name] is None for name in decoded)
        assert row["decode_error"]
    assert "Avro datum" in rows[3]["decode_error"]
    assert "1 bytes left" in rows[4]["decode_error"]
    assert f"schema id {sid + 100}" in rows[5]["decode_error"]
    assert rows[5]["schema_subject"] is None


async def test_avro_older_version_is_read_into_the_decode_version(
    registry: SchemaRegistry,
) -> None:
    v1 = await registry.register("orders-value", "avro", json.dumps(ORDER_V1).encode())
    await registry.configure_topic_schema(T, "orders-value")
    await registry.register("orders-value", "avro", json.dumps(ORDER_V2).encode())
    latest = await load_decoder(registry, T)
    pinned = await load_decoder(registry, T, version=1)
    assert latest is not None and pinned is not None
    new = {**order(1), "channel": "app"}
    entries = [
        entry(avro_bytes(ORDER_V1, order(0)), 0, v1.schema_id, 1),
        entry(avro_bytes(ORDER_V2, new), 1, v1.schema_id, 2),
    ]
    rows = entries_to_batch(entries, latest).to_pylist()
    assert [r["channel"] for r in rows] == ["web", "app"]  # v1's datum gets v2's default
    assert [r["schema_version"] for r in rows] == [1, 2]
    assert [r["decode_error"] for r in rows] == [None, None]
    # Pinned to version 1: v2's field is not a column, v2's datum is resolved to v1.
    pinned_rows = entries_to_batch(entries, pinned).to_pylist()
    assert "channel" not in pinned_rows[0]
    assert [r["id"] for r in pinned_rows] == [0, 1]
    # A decoder travels to Spark tasks by pickle, and decodes the same there.
    clone = pickle.loads(pickle.dumps(latest))
    assert entries_to_batch(entries, clone).to_pylist() == rows


ORDER_JSON = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "price": {"type": "number"},
        "paid": {"type": "boolean"},
        "at": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "note": {"type": ["string", "null"]},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "anything": {},
        "topic": {"type": "string"},
    },
    "required": ["id"],
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku"],
        }
    },
}


async def test_json_schema_topic(registry: SchemaRegistry) -> None:
    reg = await registry.register("orders-json", "json_schema", json.dumps(ORDER_JSON).encode())
    await registry.configure_topic_schema(T, "orders-json")
    decoder = await load_decoder(registry, T)
    assert decoder is not None
    good = {
        "id": 7,
        "price": 3,
        "paid": True,
        "at": "2026-11-24T10:00:00.250+01:00",
        "day": "2026-11-24",
        "note": None,
        "items": [{"sku": "a", "qty": 2}, {"sku": "b"}],
        "labels": {"x": "y"},
        "anything": [1, {"a": 2}],
        "topic": "t",
        "extra": "ignored",
    }
    naive = {"id": 8, "at": "2026-11-24T10:00:00"}
    payloads = [
        json.dumps(good).encode(),
        json.dumps(naive).encode(),
        b"{not json",
        json.dumps({"id": "seven"}).encode(),
        json.dumps({"id": 2**70}).encode(),  # valid JSON Schema integer, too big for int64
        json.dumps({"id": 9, "day": "2026-13-45"}).encode(),
    ]
    entries = [entry(p, i, reg.schema_id, 1) for i, p in enumerate(payloads)]
    batch = entries_to_batch(entries, decoder)
    schema = batch.schema
    assert schema.field("id").type == pa.int64()
    assert schema.field("price").type == pa.float64()
    assert schema.field("at").type == pa.timestamp("us", tz="UTC")
    assert schema.field("day").type == pa.date32()
    assert schema.field("items").type == pa.list_(
        pa.field(
            "element",
            pa.struct([pa.field("sku", pa.string(), False), pa.field("qty", pa.int64())]),
            False,
        )
    )
    assert schema.field("labels").type == pa.map_(
        pa.string(), pa.field("value", pa.string(), False)
    )
    assert schema.field("anything").type == pa.string()
    assert "value_topic" in schema.names and "topic" not in schema.names
    assert spark_round_trip(schema).equals(schema)

    rows = batch.to_pylist()
    assert len(rows) == len(payloads)
    first = rows[0]
    assert first["decode_error"] is None
    assert (first["id"], first["price"], first["paid"]) == (7, 3.0, True)
    assert first["at"] == dt.datetime(2026, 11, 24, 9, 0, 0, 250000, tzinfo=UTC)
    assert first["day"] == dt.date(2026, 11, 24)
    assert first["items"] == [{"sku": "a", "qty": 2}, {"sku": "b", "qty": None}]
    assert first["labels"] == [("x", "y")]
    assert first["anything"] == '[1,{"a":2}]'
    assert first["value_topic"] == "t"
    assert rows[1]["at"] == dt.datetime(2026, 11, 24, 10, tzinfo=UTC)  # no offset: UTC
    assert rows[1]["decode_error"] is None and rows[1]["price"] is None
    assert "not a JSON document" in rows[2]["decode_error"]
    assert "does not satisfy version 1 at id" in rows[3]["decode_error"]
    assert "does not fit int64" in rows[4]["decode_error"]
    assert "2026-13-45" in rows[5]["decode_error"] or "month" in rows[5]["decode_error"]
    for row, payload in zip(rows[2:], payloads[2:], strict=True):
        assert row["payload"] == payload and row["id"] is None
    # The bad rows did not disturb their neighbours.
    assert [r["id"] for r in rows[:2]] == [7, 8]


async def test_topic_without_schema_config(registry: SchemaRegistry) -> None:
    assert await load_decoder(registry, "/default/plain") is None


async def test_string_subject_has_no_decoded_columns(registry: SchemaRegistry) -> None:
    reg = await registry.register("names", "string", b"")
    await registry.configure_topic_schema(T, "names")
    decoder = await load_decoder(registry, T)
    assert decoder is not None and not decoder.decodes
    rows = entries_to_batch([entry(b"x", 0, reg.schema_id, 1)], decoder).to_pylist()
    assert rows[0]["schema_subject"] == "names" and rows[0]["decode_error"] is None
    assert list(rows[0]) == [*FIXED_SCHEMA.names, "decode_error"]
