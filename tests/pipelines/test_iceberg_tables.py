"""The Iceberg tables in real Dagster against a real etcd, an fs object store and the default
SQLite catalog: materializing ``iceberg_tables`` publishes every topic's table and reports what
the catalog then holds (snapshot, frontier, clock, lag, data files, rows), and again reports
them unchanged; a table whose publish fails fails the run naming it, after the others are
published; with the catalog off the asset materializes with a note; ``iceberg_tail_sensor``
records a runless materialization of ``iceberg_tables`` in the instance's event log when a tail
moved, and none when nothing did; the check ``partitions_fresh`` names complete partitions
still unconverted 15 minutes after their end, and passes once they are converted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import (
    AssetCheckSeverity,
    AssetKey,
    AssetSelection,
    DagsterInstance,
    ExecuteInProcessResult,
    PipesSubprocessClient,
    SkipReason,
    build_sensor_context,
    instance_for_test,
    materialize,
)

from assets.iceberg_tables import ICEBERG_TABLES, iceberg_tables
from assets.parquet import parquet_partitions, partitions_fresh
from assets.tails import iceberg_tail_sensor
from danube_ingest.analytics.checks import committed_parts
from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.iceberg import IcebergTarget, identifier
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource
from tests.pipelines.parquet_support import (
    H0,
    HOUR,
    MINUTE,
    PER_HOUR,
    TOPIC,
    ingest_ms,
    publish_clock,
    publish_topic,
)

pytestmark = [pytest.mark.etcd, pytest.mark.dagster, pytest.mark.timeout(180)]

#: A second topic; its table sorts before TOPIC's, so a failure of it comes first.
AUDIT = "/default/audit"


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        yield instance


async def _audit_topic(kv: EtcdKV, keys: Keys, store: ObjectStore) -> None:
    """AUDIT: one hour of real ``.bin`` objects (offsets 0..599, as TOPIC's first hour), two
    manifest ranges, and a clock at the hour's end."""

    def entry(offset: int) -> Entry:
        return Entry(f"audit-{offset}".encode(), producer_name="p", publish_ms=ingest_ms(offset))

    await publish_topic(kv, keys, hours=1, objects=store, entry_of=entry, topic=AUDIT)


def _resources(etcd_server: str, keys: Keys, data_dir: Path, config: str = "") -> dict[str, Any]:
    return {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(data_dir), config_path=config),
    }


def _target(data_dir: Path) -> IcebergTarget:
    found = IcebergTarget.from_config(ObjectStoreResource(data_dir=str(data_dir)).broker_config())
    assert found is not None
    return found


def _materialize(instance: DagsterInstance, resources: dict[str, Any]) -> ExecuteInProcessResult:
    return materialize(
        [iceberg_tables], instance=instance, resources=resources, raise_on_error=False
    )


def _values(metadata: Any) -> dict[str, Any]:
    return {k: v.value for k, v in metadata.items()}


def _rows(markdown: str) -> dict[str, list[str]]:
    """The markdown table's rows by their first cell (the table's name)."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    return {row[0]: row[1:] for row in cells}


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _catalog_row(target: IcebergTarget, topic: str) -> tuple[str, int, int]:
    """``(current snapshot id, data files, rows)`` as the catalog holds them, counted from the
    table's files and rows, not from the summary the asset reads."""
    table = target.catalog().load_table(identifier(topic))
    snapshot = table.current_snapshot()
    assert snapshot is not None
    files = list(table.scan().plan_files())
    return str(snapshot.snapshot_id), len(files), table.scan().to_arrow().num_rows


async def test_materializing_publishes_every_table_and_reports_the_catalogs_snapshots(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await _audit_topic(etcd_kv, keys, store)
    for topic in (TOPIC, AUDIT):  # committed Parquet, not published
        await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=topic)
    await store.close()
    resources = _resources(etcd_server, keys, tmp_path)

    result = await asyncio.to_thread(_materialize, instance, resources)
    assert result.success
    (materialization,) = result.asset_materializations_for_node("iceberg_tables")
    metadata = _values(materialization.metadata)
    orders, audit = _catalog_row(target, TOPIC), _catalog_row(target, AUDIT)
    assert (orders[1:], audit[1:]) == ((2, 2 * PER_HOUR), (1, PER_HOUR))
    assert {k: metadata[k] for k in ("tables", "published", "unchanged", "failed")} == {
        "tables": 2,
        "published": 2,
        "unchanged": 0,
        "failed": 0,
    }
    assert (metadata["data_files"], metadata["rows"], metadata["max_lag_s"]) == (3, 1800, 0)
    rows = _rows(metadata["tables_detail"])
    assert list(rows) == ["danube.default.audit", "danube.default.orders"]
    for name, (snapshot, files, count), frontier in (
        ("danube.default.orders", orders, H0 + 2 * HOUR),
        ("danube.default.audit", audit, H0 + HOUR),
    ):
        # snapshot, frontier, topic clock, lag s, data files, rows, this time
        assert rows[name] == [
            snapshot,
            _iso(frontier),
            _iso(frontier),
            "0",
            str(files),
            str(count),
            f"snapshot {snapshot} (+{files} -0 files)",
        ]

    again = await asyncio.to_thread(_materialize, instance, resources)
    assert again.success
    (materialization,) = again.asset_materializations_for_node("iceberg_tables")
    metadata = _values(materialization.metadata)
    assert (metadata["published"], metadata["unchanged"]) == (0, 2)
    rows = _rows(metadata["tables_detail"])
    assert rows["danube.default.orders"][0] == orders[0]
    assert rows["danube.default.orders"][-1] == "unchanged"
    table = target.catalog().load_table(identifier(TOPIC))
    assert [str(s.snapshot_id) for s in table.snapshots()] == [orders[0]]


async def test_a_table_whose_publish_fails_fails_the_run_naming_it_after_the_others(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """AUDIT's committed file is gone, so its table cannot be published; TOPIC's, after it in
    order, is published all the same, and the run's failure names AUDIT's table only."""
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await _audit_topic(etcd_kv, keys, store)
    for topic in (TOPIC, AUDIT):
        await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=topic)
    _, commits = await committed_parts(etcd_kv, keys, AUDIT)
    await store.delete(commits[0].files[0].path)
    await store.close()

    result = await asyncio.to_thread(
        _materialize, instance, _resources(etcd_server, keys, tmp_path)
    )
    assert not result.success
    assert result.asset_materializations_for_node("iceberg_tables") == []
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    data = failure.step_failure_data
    assert data is not None and data.user_failure_data is not None
    message = data.user_failure_data.description or ""
    assert message.startswith(
        "1 of 2 Iceberg tables could not be published (the others are): danube.default.audit. "
    ), message
    assert "danube.default.orders" not in message
    metadata = _values(data.user_failure_data.metadata)
    assert (metadata["failed"], metadata["published"], metadata["tables"]) == (1, 1, 1)
    assert list(_rows(metadata["failed_tables"])) == ["danube.default.audit"]
    snapshot, files, rows = _catalog_row(target, TOPIC)
    assert (files, rows) == (2, 2 * PER_HOUR)
    assert _rows(metadata["tables_detail"])["danube.default.orders"][0] == snapshot


async def test_with_the_catalog_off_the_asset_materializes_with_a_note(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=1, objects=store)
    await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    await store.close()
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({"iceberg": {"catalog": "off"}}))
    resources = _resources(etcd_server, keys, tmp_path, str(off))
    result = await asyncio.to_thread(_materialize, instance, resources)
    assert result.success
    (materialization,) = result.asset_materializations_for_node("iceberg_tables")
    metadata = _values(materialization.metadata)
    assert metadata["tables"] == 0 and "iceberg.catalog is off" in metadata["note"]
    assert not (tmp_path / "iceberg" / "catalog.db").exists()


async def test_the_tail_sensor_reports_a_runless_materialization_when_a_tail_moved(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    # The first hour committed and published; the clock 30 min 9 s into the second.
    await publish_clock(etcd_kv, keys, H0 + HOUR + 30 * MINUTE + 9_000)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    await store.close()
    resources = _resources(etcd_server, keys, tmp_path)
    instance = DagsterInstance.ephemeral()

    def tick() -> str:
        context = build_sensor_context(instance=instance, resources=resources)
        result = iceberg_tail_sensor(context)
        assert isinstance(result, SkipReason)
        return result.skip_message or ""

    def recorded() -> list[Any]:
        return list(instance.fetch_materializations(ICEBERG_TABLES, limit=10).records)

    assert (await asyncio.to_thread(tick)).startswith("1 of 1 tables extended")
    (record,) = recorded()
    assert record.run_id == ""  # runless: no run of the asset
    materialization = record.asset_materialization
    assert materialization is not None and materialization.asset_key == AssetKey("iceberg_tables")
    metadata = _values(materialization.metadata)
    snapshot, files, rows = _catalog_row(target, TOPIC)
    assert rows == PER_HOUR + 300  # the first hour, and the second's first 30 minutes
    assert (metadata["tables"], metadata["data_files"], metadata["rows"]) == (1, files, rows)
    assert metadata["max_lag_s"] == 9.0
    assert _rows(metadata["tables_detail"])["danube.default.orders"] == [
        snapshot,
        _iso(H0 + HOUR + 30 * MINUTE),
        _iso(H0 + HOUR + 30 * MINUTE + 9_000),
        "9",
        str(files),
        str(rows),
        "tail +1 -0 pieces (300 rows)",
    ]

    # Nothing new below the next step: the tail does not move, nothing is reported.
    assert (await asyncio.to_thread(tick)).startswith("0 of 1 tables extended")
    assert len(recorded()) == 1

    await publish_clock(etcd_kv, keys, H0 + HOUR + 30 * MINUTE + 21_000)
    assert (await asyncio.to_thread(tick)).startswith("1 of 1 tables extended")
    latest, first = recorded()
    assert first.storage_id == record.storage_id
    assert latest.asset_materialization is not None
    metadata = _values(latest.asset_materialization.metadata)
    snapshot_now, _, rows_now = _catalog_row(target, TOPIC)
    assert snapshot_now != snapshot and rows_now == rows + 4  # ingested at 30:00, :06, :12, :18
    row = _rows(metadata["tables_detail"])["danube.default.orders"]
    assert row[:2] == [snapshot_now, _iso(H0 + HOUR + 30 * MINUTE + 20_000)]


async def test_partitions_fresh_names_late_partitions_and_passes_once_converted(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, starts_ms=[H0]
    )
    resources = _resources(etcd_server, keys, tmp_path)

    def check() -> tuple[bool, AssetCheckSeverity, dict[str, Any]]:
        result = materialize(
            [parquet_partitions, partitions_fresh],
            instance=instance,
            resources={
                **resources,
                "convert_job": ConvertJobResource(),
                "pipes_subprocess_client": PipesSubprocessClient(),
            },
            selection=AssetSelection.checks(partitions_fresh),
            raise_on_error=False,
        )
        (evaluation,) = result.get_asset_check_evaluations()
        assert evaluation.check_name == "partitions_fresh"
        return evaluation.passed, evaluation.severity, _values(evaluation.metadata)

    # 11:00-12:00 is complete, not converted: on time until the clock is 15 min past 12:00.
    await publish_clock(etcd_kv, keys, H0 + 2 * HOUR + 15 * MINUTE)
    passed, severity, metadata = await asyncio.to_thread(check)
    assert passed and (metadata["late"], metadata["topics"]) == (0, 1), metadata

    await publish_clock(etcd_kv, keys, H0 + 3 * HOUR + 16 * MINUTE)  # and 12:00-13:00 too
    passed, severity, metadata = await asyncio.to_thread(check)
    assert not passed and severity == AssetCheckSeverity.WARN
    assert (metadata["late"], metadata["late_tables"]) == (2, 1)
    assert metadata["details"] == (f"- {TOPIC}@2026-11-23T11:00\n- {TOPIC}@2026-11-23T12:00"), (
        metadata["details"]
    )
    assert _rows(metadata["by_table"]) == {TOPIC: ["2", f"{TOPIC}@2026-11-23T11:00", "76"]}

    await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    await store.close()
    passed, _, metadata = await asyncio.to_thread(check)
    assert passed and metadata["late"] == 0, metadata
