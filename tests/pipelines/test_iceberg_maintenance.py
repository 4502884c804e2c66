"""Job ``iceberg_maintenance`` in real Dagster against a real etcd, an fs store and the default
SQLite catalog: a table with a handed-over rendition keeps only its current snapshot once the
op's ``max_snapshot_age`` is zero, its totals are the step's metadata, a malformed duration
fails the run naming the field, and the location schedules the job hourly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dagster import DefaultScheduleStatus

from assets.parquet import iceberg_maintenance
from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.iceberg import IcebergTarget, identifier, publish
from danube_ingest.analytics.lifecycle import new_rendition
from danube_ingest.analytics.renditions import activate
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.pipelines.parquet_support import TOPIC, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.dagster, pytest.mark.timeout(180)]


def _run(resources: dict[str, object], **config: object) -> dict[str, object]:
    run_config = {"ops": {"maintain_iceberg": {"config": config}}}
    result = iceberg_maintenance.execute_in_process(resources=resources, run_config=run_config)
    assert result.success
    [event] = [e for e in result.all_node_events if e.is_successful_output]
    assert event.step_output_data is not None
    return {k: v.value for k, v in event.step_output_data.metadata.items()}


async def test_iceberg_maintenance_expires_old_snapshots(
    etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    resources = {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(tmp_path)),
    }
    target = IcebergTarget.from_config(resources["objects"].broker_config())  # type: ignore[attr-defined]
    assert target is not None
    try:
        await publish_topic(kv, keys, hours=2, extra_ms=1, objects=store)
        await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target)
        r2 = await new_rendition(kv, keys, TOPIC)
        await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, rendition=r2)
        await activate(kv, keys, TOPIC, r2)
        await publish(kv, keys, TOPIC, target)
        table = target.catalog().load_table(identifier(TOPIC))
        rows = table.scan().to_arrow().num_rows
        assert len(table.snapshots()) == 2 and rows > 0

        kept = await asyncio.to_thread(_run, resources)  # defaults: 5 days
        assert (kept["tables"], kept["snapshots_expired"], kept["snapshots_kept"]) == (1, 0, 2)
        done = await asyncio.to_thread(_run, resources, max_snapshot_age="0s")
        assert (done["tables"], done["snapshots_expired"], done["snapshots_kept"]) == (1, 1, 1)
        table = target.catalog().load_table(identifier(TOPIC))
        current = table.current_snapshot()
        assert current is not None and current.summary is not None
        assert [s.snapshot_id for s in table.snapshots()] == [current.snapshot_id]
        assert current.summary["danube.rendition"] == r2
        assert table.scan().to_arrow().num_rows == rows
    finally:
        await store.close()
        await kv.close()


def test_a_malformed_duration_fails_the_run_naming_the_field(tmp_path: Path) -> None:
    resources = {
        "etcd": EtcdResource(endpoints="127.0.0.1:1", prefix="/x"),
        "objects": ObjectStoreResource(data_dir=str(tmp_path)),
    }
    result = iceberg_maintenance.execute_in_process(
        resources=resources,
        run_config={"ops": {"maintain_iceberg": {"config": {"orphan_grace": "soon"}}}},
        raise_on_error=False,
    )
    assert not result.success
    [failure] = [e for e in result.all_node_events if e.is_failure]
    assert "iceberg_maintenance config" in str(failure.step_failure_data.error)


def test_the_location_schedules_iceberg_maintenance_hourly() -> None:
    from pipelines.definitions import defs

    schedule = defs.get_repository_def().get_schedule_def("iceberg_maintenance_schedule")
    assert schedule.job_name == "iceberg_maintenance"
    assert schedule.cron_schedule == "45 * * * *"
    assert schedule.default_status == DefaultScheduleStatus.RUNNING
