"""``convert`` (engine local) on the real daemon's objects: three topics produced through
danube-client (``daemon_support``), converted on a real etcd into an fs warehouse, and the
Parquet rows compared with what the producers sent (not with what a reader returned)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from danube_ingest.analytics.convert import ConvertError, convert, pending_partitions
from danube_ingest.analytics.layout import partition_dir, partition_end
from danube_ingest.analytics.records import TableKeys
from danube_ingest.analytics.renditions import read_table
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.kv import Get
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.store import ObjectStore
from tests.analytics.daemon_support import (
    AVRO,
    JSON_T,
    PAYLOADS,
    PLAIN,
    TOPICS,
    WIDTH_S,
    Produced,
    clock_of,
    clone,
    expected_fields,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture
async def kv(produced: Produced) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    yield store
    await store.close()


@pytest.fixture
async def stores(produced: Produced, tmp_path: Path) -> AsyncIterator[tuple[ObjectStore, Path]]:
    """The daemon's objects (read) and a fresh fs warehouse directory."""
    objects = ObjectStore("fs", options={"root": str(produced.objects)})
    yield objects, tmp_path / "wh"
    await objects.close()


def warehouse_at(path: Path) -> ObjectStore:
    return ObjectStore("fs", options={"root": str(path)})


def files_below(path: Path, prefix: str = "warehouse/r1/") -> dict[str, bytes]:
    base = path / prefix
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()
    }


def check_rows(topic: str, rows: list[dict[str, Any]], expected: range) -> None:
    """Rows equal what the producer sent at these offsets: offset, payload, attributes,
    producer, decoded fields."""
    assert [r["offset"] for r in rows] == list(expected)
    for row in rows:
        i = row["offset"]
        assert row["payload"] == PAYLOADS[topic](i), (topic, i)
        assert dict(row["attributes"]) == {"i": str(i), "t": topic}
        for name, value in expected_fields(topic, i).items():
            assert row[name] == value, (topic, i, name)
        if topic != PLAIN:
            assert (row["decode_error"] is None) == (expected_fields(topic, i)["id"] is not None)


async def test_produced_messages_land_in_their_minute_partitions(
    produced: Produced, kv: EtcdKV, stores: tuple[ObjectStore, Path]
) -> None:
    objects, wh_dir = stores
    keys = await clone(kv, produced.prefix)
    warehouse = warehouse_at(wh_dir)
    for topic in TOPICS:
        pending = await pending_partitions(kv, keys, topic, width_s=WIDTH_S)
        result = await convert(
            kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=topic, width_s=WIDTH_S
        )
        starts = [p.start_ms for p in result.partitions]
        assert starts == pending and starts[0] <= produced.minute_a
        assert starts[-1] == produced.last_minute
        assert starts == list(range(starts[0], starts[-1] + 1, WIDTH_S * 1000))
        assert {p.outcome for p in result.partitions} == {"committed"}
        assert result.rendition == "r1"
        assert result.upper_ms == partition_end(produced.last_minute, WIDTH_S)
        table = await read_table(kv, keys, topic)
        assert table is not None and table.upper_ms == result.upper_ms and table.active == "r1"
        rows: list[dict[str, Any]] = []
        for part in result.partitions:
            directory = partition_dir("r1", topic, part.start_ms, WIDTH_S)
            assert all(f.startswith(f"warehouse/{directory}") for f in part.files)
            part_rows = [row for f in part.files for row in pq.read_table(wh_dir / f).to_pylist()]
            assert part.rows == len(part_rows)
            for row in part_rows:
                ingest_ms = row["ingest_time"].timestamp() * 1000
                assert part.start_ms <= ingest_ms < part.end_ms
            if part_rows:
                assert (part.first_offset, part.last_offset) == (
                    part_rows[0]["offset"],
                    part_rows[-1]["offset"],
                )
            rows += part_rows
        check_rows(topic, rows, range(produced.sent[topic]))
        # Burst B was produced after every A message's minute ended.
        a_rows = [r for r in rows if r["ingest_time"].timestamp() * 1000 < produced.minute_b]
        assert len(a_rows) == 25

    # A rerun commits nothing new and changes no byte.
    before = files_below(wh_dir)
    for topic in TOPICS:
        again = await convert(
            kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=topic, width_s=WIDTH_S
        )
        assert again.partitions == []
    assert files_below(wh_dir) == before

    # An independent conversion (new tables, new warehouse) writes the same bytes.
    other_keys = await clone(kv, produced.prefix)
    other_dir = wh_dir.parent / "wh-other"
    other = warehouse_at(other_dir)
    for topic in TOPICS:
        await convert(
            kv=kv, keys=other_keys, objects=objects, warehouse=other, topic=topic, width_s=WIDTH_S
        )
    assert files_below(other_dir) == before
    await warehouse.close()
    await other.close()


async def test_incomplete_partition_is_not_committed(
    produced: Produced, kv: EtcdKV, stores: tuple[ObjectStore, Path]
) -> None:
    """Right after burst B its minute was not over (and some of B perhaps not uploaded): only
    A's minutes are converted, and asking for B's minute is refused."""
    objects, wh_dir = stores
    keys = await clone(kv, produced.early)
    warehouse = warehouse_at(wh_dir)
    for topic in TOPICS:
        pending = await pending_partitions(kv, keys, topic, width_s=WIDTH_S)
        assert pending and pending[-1] < produced.minute_b
        result = await convert(
            kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=topic, width_s=WIDTH_S
        )
        assert [p.start_ms for p in result.partitions] == pending
        assert sum(p.rows for p in result.partitions) == 25
        assert result.upper_ms == produced.minute_b
        with pytest.raises(
            ConvertError, match=rf"partition {produced.last_minute} .* not complete"
        ):
            await convert(
                kv=kv,
                keys=keys,
                objects=objects,
                warehouse=warehouse,
                topic=topic,
                starts_ms=[produced.last_minute],
            )
        parts = await kv.get_prefix(TableKeys(keys, topic).parts_prefix("r1"))
        assert len(parts) == len(pending)
    await warehouse.close()


async def test_idle_topic_partition_completes_through_time_markers(
    produced: Produced, kv: EtcdKV, stores: tuple[ObjectStore, Path]
) -> None:
    """No message was produced after burst B: the daemon's clock passed the end of B's last
    minute by time markers alone, so that minute converts."""
    objects, wh_dir = stores
    keys = await clone(kv, produced.prefix)
    warehouse = warehouse_at(wh_dir)
    end = partition_end(produced.last_minute, WIDTH_S)
    for topic in TOPICS:
        clock = await clock_of(kv, keys, topic)
        assert clock is not None and clock.offset == produced.sent[topic] and clock.ingest_ms >= end
        result = await convert(
            kv=kv,
            keys=keys,
            objects=objects,
            warehouse=warehouse,
            topic=topic,
            starts_ms=[produced.last_minute],
            width_s=WIDTH_S,
        )
        [part] = result.partitions
        assert part.outcome == "committed" and part.last_offset == produced.sent[topic] - 1
    await warehouse.close()


async def test_two_concurrent_runs_commit_each_partition_once(
    produced: Produced, kv: EtcdKV, stores: tuple[ObjectStore, Path]
) -> None:
    objects, wh_dir = stores
    keys = await clone(kv, produced.prefix)
    first, second = warehouse_at(wh_dir), warehouse_at(wh_dir)

    async def run(warehouse: ObjectStore) -> Any:
        return await convert(
            kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=AVRO, width_s=WIDTH_S
        )

    results = await asyncio.gather(run(first), run(second))
    committed: dict[int, int] = {}
    for result in results:
        for part in result.partitions:
            committed[part.start_ms] = committed.get(part.start_ms, 0) + (
                part.outcome == "committed"
            )
    assert committed and set(committed.values()) == {1}
    records = await kv.get_prefix(TableKeys(keys, AVRO).parts_prefix("r1"))
    assert len(records) == len(committed)
    assert not list((wh_dir / "warehouse" / "_staging").rglob("*.parquet"))
    rows = [r for p in sorted((wh_dir / "warehouse/r1").rglob("*.parquet"))
            for r in pq.read_table(p).to_pylist()]  # fmt: skip
    check_rows(AVRO, sorted(rows, key=lambda r: r["offset"]), range(produced.sent[AVRO]))
    await first.close()
    await second.close()


async def _ranges(kv: EtcdKV, keys: Keys, topic: str) -> list[ObjectRange]:
    read = await kv.txn([], [Get(keys.storage_objects_prefix(topic), True)])
    return sorted(
        (ObjectRange.decode(e.value, e.key) for e in read.responses[0].kvs),
        key=lambda r: r.start_offset,
    )


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
async def test_a_bad_object_fails_the_run_naming_it_and_commits_nothing_of_it(
    produced: Produced, kv: EtcdKV, tmp_path: Path, damage: str
) -> None:
    copy = tmp_path / "objects"
    shutil.copytree(produced.objects, copy)
    objects = ObjectStore("fs", options={"root": str(copy)})
    wh_dir = tmp_path / "wh"
    warehouse = warehouse_at(wh_dir)
    keys = await clone(kv, produced.prefix)
    first = await convert(
        kv=kv,
        keys=keys,
        objects=objects,
        warehouse=warehouse,
        topic=JSON_T,
        starts_ms=[produced.minute_a],
        width_s=WIDTH_S,
    )
    assert first.partitions[0].outcome == "committed"
    before = files_below(wh_dir)
    # Damage the object holding the last offset (burst B, a later partition).
    bad = (await _ranges(kv, keys, JSON_T))[-1]
    path = copy / bad.object_key
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        position = bad.byte_start + bad.byte_length // 2
        data[position] ^= 0xFF
        path.write_bytes(bytes(data))
        pattern = rf"{bad.object_key}.*(byte|position)"
    else:
        path.unlink()
        pattern = rf"{bad.object_key}"
    with pytest.raises(ConvertError, match=pattern) as failed:
        await convert(kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=JSON_T)
    assert "nothing of it was committed" in str(failed.value)
    tables = TableKeys(keys, JSON_T)
    committed = {e.key for e in await kv.get_prefix(tables.parts_prefix("r1"))}
    assert tables.part("r1", produced.last_minute) not in committed
    # Earlier partitions stay committed and readable, byte for byte.
    after = files_below(wh_dir)
    assert {k: v for k, v in after.items() if k in before} == before
    for name in after:
        pq.read_table(wh_dir / name)
    assert not list((wh_dir / "warehouse" / "_staging").rglob("*.parquet"))
    await objects.close()
    await warehouse.close()
