"""Job ``parquet_collect`` in real Dagster against a real etcd and an fs store: a draining
rendition is collected once its reader is gone, the counts are the step's metadata, and the
location schedules the job hourly at :40, running by default."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dagster import DefaultScheduleStatus

from assets.parquet import parquet_collect
from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.lifecycle import new_rendition
from danube_ingest.analytics.renditions import activate, hold, read_rendition
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.pipelines.parquet_support import ROOT, TOPIC, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.dagster, pytest.mark.timeout(120)]


def _metadata(resources: dict[str, object]) -> dict[str, object]:
    result = parquet_collect.execute_in_process(resources=resources)
    assert result.success
    [event] = [e for e in result.all_node_events if e.is_successful_output]
    assert event.step_output_data is not None
    return {k: v.value for k, v in event.step_output_data.metadata.items()}


async def test_parquet_collect_reports_held_then_collected(
    etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    try:
        await publish_topic(kv, keys, hours=2, extra_ms=1, objects=store)
        await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
        r2 = await new_rendition(kv, keys, TOPIC)
        await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, rendition=r2)
        r1_files = list((tmp_path / "objects" / ROOT / "r1").rglob("*.parquet"))
        resources = {
            "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
            "objects": ObjectStoreResource(data_dir=str(tmp_path)),
        }
        async with hold(kv, keys, TOPIC):
            await activate(kv, keys, TOPIC, r2)
            held = await asyncio.to_thread(_metadata, resources)
        assert held == {
            "staging_runs_collected": 0,
            "renditions_collected": 0,
            "rendition_files_deleted": 0,
            "renditions_held": 1,
            "rendition_files_kept": 0,
            "held": f"{TOPIC} r1",
        }
        assert all(f.exists() for f in r1_files)
        done = await asyncio.to_thread(_metadata, resources)
        assert done == {
            "staging_runs_collected": 0,
            "renditions_collected": 1,
            "rendition_files_deleted": len(r1_files),
            "renditions_held": 0,
            "rendition_files_kept": 0,  # (no Iceberg snapshot ever held r1: never published)
            "held": "none",
        }
        assert r1_files and not any(f.exists() for f in r1_files)
        record = await read_rendition(kv, keys, TOPIC, "r1")
        assert record is not None and record.state == "collected"
    finally:
        await store.close()
        await kv.close()


def test_the_location_schedules_parquet_collect_hourly() -> None:
    from pipelines.definitions import defs

    repository = defs.get_repository_def()
    schedule = repository.get_schedule_def("parquet_collect_schedule")
    assert schedule.job_name == "parquet_collect"
    assert schedule.cron_schedule == "40 * * * *"
    assert schedule.default_status == DefaultScheduleStatus.RUNNING
