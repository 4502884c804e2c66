"""Dead letters apart (``iceberg.dead_letters: table``): rows whose payload does not decode go
to the ``<topic>__dlq`` Iceberg table instead of the topic's, from conversions and tails alike;
every offset is in exactly one of the two; a rendition that keeps them empties the ``__dlq``
table when it becomes active, and collection and maintenance treat dead-letter files like the
others. Real etcd, real ``.bin`` objects, an fs warehouse, the SQLite catalog."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import fastavro
import pyarrow.parquet as pq
import pytest

from danube_ingest.analytics.checks import check_files, check_rows
from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.iceberg import (
    IcebergTarget,
    check_table,
    dead_letters_identifier,
    held_keys,
    identifier,
    maintain,
    publish,
)
from danube_ingest.analytics.lifecycle import new_rendition
from danube_ingest.analytics.read import _arrow, _select
from danube_ingest.analytics.renditions import activate, collect_rendition, read_rendition
from danube_ingest.analytics.tail import extend_tail
from danube_ingest.config import load_config
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.objects.store import ObjectStore
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore
from danube_ingest.wal.framing import Entry
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

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(300)]

SCHEMA = {
    "type": "record",
    "name": "Order",
    "fields": [{"name": "id", "type": "long"}, {"name": "name", "type": "string"}],
}
ALL = range(2 * PER_HOUR)


def _bad(offset: int) -> bool:
    return offset % 7 == 3


def _entry_of(schema_id: int) -> Any:
    """Every 7th offset (from 3) carries bytes that are not an Avro datum of the schema."""

    def entry(offset: int) -> Entry:
        if _bad(offset):
            payload = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff not avro"
        else:
            out = io.BytesIO()
            fastavro.schemaless_writer(
                out, fastavro.parse_schema(SCHEMA), {"id": offset, "name": f"n{offset}"}
            )
            payload = out.getvalue()
        return Entry(
            payload,
            producer_name="p",
            publish_ms=ingest_ms(offset) - 5,
            schema_id=schema_id,
            schema_version=1,
        )

    return entry


def _target(tmp_path: Path, dead_letters: str) -> IcebergTarget:
    config = load_config(
        None,
        {
            "broker.data_dir": str(tmp_path),
            "storage.cloud.root": str(tmp_path / "objects"),
            "iceberg.dead_letters": dead_letters,
        },
    )
    found = IcebergTarget.from_config(config)
    assert found is not None and found.dead_letters == (dead_letters == "table")
    return found


async def _convert(
    kv: EtcdKV, keys: Keys, store: ObjectStore, target: IcebergTarget, rendition: str | None = None
) -> None:
    await convert(
        kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, rendition=rendition,
        iceberg=target,
    )  # fmt: skip


async def _clock(kv: EtcdKV, keys: Keys, at_ms: int, offset: int) -> None:
    clock = TopicClock(offset=offset, ingest_ms=at_ms, broker="b1", epoch=1)
    await kv.put(keys.topic_clock(TOPIC), clock.encode())


def _rows(target: IcebergTarget, ident: tuple[str, str]) -> list[dict[str, Any]]:
    table = target.catalog().load_table(ident)
    return sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["offset"])


async def test_rows_that_do_not_decode_go_to_the_dlq_table(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    registry = SchemaRegistry(KVSchemaStore(etcd_kv, keys))
    registered = await registry.register("orders-value", "avro", json.dumps(SCHEMA).encode())
    await registry.configure_topic_schema(TOPIC, "orders-value")
    objects = tmp_path / "objects"
    store = ObjectStore("fs", options={"root": str(objects)})
    target = _target(tmp_path, "table")
    await publish_topic(
        etcd_kv, keys, hours=2, objects=store, entry_of=_entry_of(registered.schema_id)
    )
    await _clock(etcd_kv, keys, H0 + HOUR + 30 * MINUTE, PER_HOUR + PER_HOUR // 2)

    # The first hour converted, the second half-way in the tail.
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    record = await read_rendition(etcd_kv, keys, TOPIC, "r1")
    assert record is not None and record.dead_letters
    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    assert step is not None and step.rows == PER_HOUR // 2
    await publish(etcd_kv, keys, TOPIC, target)
    below = [o for o in ALL if o < PER_HOUR + PER_HOUR // 2]
    good = _rows(target, identifier(TOPIC))
    bad = _rows(target, dead_letters_identifier(TOPIC))
    assert [r["offset"] for r in good] == [o for o in below if not _bad(o)]
    assert [r["offset"] for r in bad] == [o for o in below if _bad(o)]
    assert all(r["decode_error"] is None and r["name"] == f"n{r['offset']}" for r in good)
    assert all(r["decode_error"] and r["payload"].endswith(b"not avro") for r in bad)
    assert "name" not in bad[0] and "id" not in bad[0]
    dead_files = sorted((objects / ROOT).rglob("*.parquet"))
    letters = [p for p in dead_files if "_dead_letters" in p.parts or "dead_letters" in p.parts]
    assert len(letters) == 2  # the first hour's, the tail piece's
    assert all(
        pq.read_schema(p).names[-1] == "decode_error" and "name" not in pq.read_schema(p).names
        for p in letters
    )
    # The checks count both: every offset of the manifest is in exactly one file.
    assert await check_rows(etcd_kv, keys, store, TOPIC) == []
    assert await check_files(etcd_kv, keys, store, TOPIC) == []
    assert await check_table(etcd_kv, keys, TOPIC, target) == []

    # The hour completes: its files replace the tail's pieces in both tables.
    await _clock(etcd_kv, keys, H0 + 2 * HOUR, 2 * PER_HOUR)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    good = _rows(target, identifier(TOPIC))
    bad = _rows(target, dead_letters_identifier(TOPIC))
    assert [r["offset"] for r in good] == [o for o in ALL if not _bad(o)]
    assert [r["offset"] for r in bad] == [o for o in ALL if _bad(o)]
    dlq = target.catalog().load_table(dead_letters_identifier(TOPIC))
    assert dlq.current_snapshot().summary["danube.frontier-ms"] == str(H0 + 2 * HOUR)
    # read_topic reads the topic's rows only.
    selection = await _select(etcd_kv, keys, TOPIC, "r1", None, None)
    assert sorted(_arrow_offsets(await _arrow(store, selection))) == [o for o in ALL if not _bad(o)]

    # r2, dead letters apart too, replaces r1: collecting r1 keeps the dead letters a
    # snapshot of the __dlq table still holds; maintenance deletes them once none does.
    r2 = await new_rendition(etcd_kv, keys, TOPIC, dead_letters=True)
    await _convert(etcd_kv, keys, store, target, rendition=r2)
    await activate(etcd_kv, keys, TOPIC, r2)
    await publish(etcd_kv, keys, TOPIC, target)
    held = await held_keys(target, TOPIC)
    assert any("_dead_letters/r1/" in k for k in held)
    await collect_rendition(etcd_kv, keys, TOPIC, "r1", store, ROOT, keep=held)
    assert list((objects / ROOT / "_dead_letters" / "r1").rglob("*.parquet"))
    later = int(H0 + 1_000 * HOUR)
    await maintain(
        target, TOPIC, max_snapshot_age_s=0, orphan_grace_s=0, tails=(etcd_kv, keys, ROOT),
        now_ms=later,
    )  # fmt: skip
    assert list((objects / ROOT / "_dead_letters" / "r1").rglob("*.parquet")) == []
    assert list((objects / ROOT / "r1").rglob("*.parquet")) == []
    assert [r["offset"] for r in _rows(target, dead_letters_identifier(TOPIC))] == [
        o for o in ALL if _bad(o)
    ]

    # r3 keeps them in the table (the default): once active, the __dlq table is emptied and
    # the topic's table holds every row; once no snapshot holds r2's dead letters, collecting
    # r2 deletes them.
    r3 = await new_rendition(etcd_kv, keys, TOPIC)
    await _convert(etcd_kv, keys, store, target, rendition=r3)
    await activate(etcd_kv, keys, TOPIC, r3)
    await publish(etcd_kv, keys, TOPIC, target)
    good = _rows(target, identifier(TOPIC))
    assert [r["offset"] for r in good] == list(ALL)
    assert [r["offset"] for r in good if r["decode_error"]] == [o for o in ALL if _bad(o)]
    assert _rows(target, dead_letters_identifier(TOPIC)) == []
    await maintain(target, TOPIC, max_snapshot_age_s=0, orphan_grace_s=0, now_ms=later)
    held = await held_keys(target, TOPIC)
    assert not any("_dead_letters/" in k for k in held)
    await collect_rendition(etcd_kv, keys, TOPIC, r2, store, ROOT, keep=held)
    assert list((objects / ROOT / "_dead_letters").rglob("*.parquet")) == []
    await store.close()


def _arrow_offsets(table: Any) -> list[int]:
    return [int(o) for o in table.column("offset").to_pylist()]


async def test_a_rendition_keeping_rows_creates_no_dlq_table(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    registry = SchemaRegistry(KVSchemaStore(etcd_kv, keys))
    registered = await registry.register("orders-value", "avro", json.dumps(SCHEMA).encode())
    await registry.configure_topic_schema(TOPIC, "orders-value")
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path, "keep")
    await publish_topic(
        etcd_kv, keys, hours=1, objects=store, entry_of=_entry_of(registered.schema_id)
    )
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    rows = _rows(target, identifier(TOPIC))
    assert [r["offset"] for r in rows] == list(range(PER_HOUR))
    assert not target.catalog().table_exists(dead_letters_identifier(TOPIC))
    assert not (tmp_path / "objects" / ROOT / "_dead_letters").exists()
    await store.close()
