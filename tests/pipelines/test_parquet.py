"""The Parquet layer in real Dagster against a real etcd: the sensor adds topics and requests
complete hours, the asset converts exactly its partitions with the real program
(danube_ingest.analytics.job) launched through Pipes (``--engine local`` where Spark is not
the point, Spark where marked), a backfill launched through GraphQL as the UI launches it runs
as ONE run, and the asset checks fail on a deleted or truncated Parquet file."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetSelection,
    DagsterInstance,
    DagsterRunStatus,
    PipesSubprocessClient,
    RunsFilter,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    BACKFILL_ID_TAG,
)
from dagster._daemon.backfill import execute_backfill_iteration
from dagster_graphql.client.query import LAUNCH_PARTITION_BACKFILL_MUTATION
from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

from assets.parquet import (
    parquet_checks,
    parquet_partitions,
    parquet_topics_sensor,
    partition_key,
    topics_partitions,
)
from danube_ingest.analytics.checks import check_files, check_rows, committed_parts
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource
from tests.pipelines.parquet_support import H0, HOUR, TOPIC, convert, payload, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_COORDINATOR = {
    "module": "dagster._core.run_coordinator",
    "class": "DefaultRunCoordinator",
}


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        yield instance


def _resources(etcd_server: str, keys: Keys, data_dir: Path) -> dict[str, object]:
    return {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(data_dir)),
        # The real program in this process only (no Spark: fast); Spark in the tests that say so.
        "convert_job": ConvertJobResource(extra_args=["--engine", "local"]),
        "pipes_subprocess_client": PipesSubprocessClient(),
    }


async def test_sensor_adds_topics_and_requests_each_complete_hour_once(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    await publish_topic(etcd_kv, keys, hours=3, extra_ms=HOUR // 2)
    etcd = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)

    def evaluate(cursor: str | None) -> tuple[list[str], list[str], str | None]:
        context = build_sensor_context(instance=instance, cursor=cursor, resources={"etcd": etcd})
        result = parquet_topics_sensor(context)
        added = [k for r in result.dynamic_partitions_requests for k in r.partition_keys]
        for request in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        return added, [str(r.partition_key) for r in result.run_requests], result.cursor

    added, requested, cursor = await asyncio.to_thread(evaluate, None)
    assert added == [TOPIC]
    assert instance.get_dynamic_partitions(topics_partitions.name) == [TOPIC]
    # The three complete hours, not the fourth (its clock is only half-way through it).
    assert requested == [str(partition_key(TOPIC, H0 + i * HOUR)) for i in range(3)]
    # In flight: the next tick requests nothing again and adds no topic again.
    assert await asyncio.to_thread(evaluate, cursor) == ([], [], cursor)
    # The hours committed meanwhile leave the cursor; nothing is pending any more.
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await convert(etcd_kv, keys, store)
    await store.close()
    added, requested, cursor = await asyncio.to_thread(evaluate, cursor)
    assert (added, requested, cursor) == ([], [], "{}")


async def test_materializing_partitions_converts_exactly_them_through_pipes(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=3, objects=objects)
    await objects.close()
    instance.add_dynamic_partitions(topics_partitions.name, [TOPIC])
    resources = _resources(etcd_server, keys, tmp_path)

    def run(hour: int) -> dict[str, object]:
        result = materialize(
            [parquet_partitions],
            instance=instance,
            resources=resources,
            partition_key=str(partition_key(TOPIC, hour)),
        )
        assert result.success
        (materialization,) = result.asset_materializations_for_node("parquet_partitions")
        return {k: v.value for k, v in materialization.metadata.items()}

    metadata = await asyncio.to_thread(run, H0 + HOUR)
    assert {k: metadata[k] for k in ("rows", "first_offset", "last_offset", "files", "hours")} == {
        "rows": 600,
        "first_offset": 600,
        "last_offset": 1199,
        "files": 1,
        "hours": 1,
    }
    assert metadata["pipes_reports"] == 1
    # Only that hour was converted (nothing before it: the frontier waits for the first hour).
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == [H0 + HOUR]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_spark_program_converts_an_hour_through_pipes(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """The real program (danube_ingest.analytics.job, Spark engine) launched by the asset: the
    hour's rows are the objects' entries, read back from the Parquet with pyarrow."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=2, objects=objects)
    instance.add_dynamic_partitions(topics_partitions.name, [TOPIC])
    resources = {**_resources(etcd_server, keys, tmp_path), "convert_job": ConvertJobResource()}

    def run() -> dict[str, object]:
        result = materialize(
            [parquet_partitions],
            instance=instance,
            resources=resources,
            partition_key=str(partition_key(TOPIC, H0 + HOUR)),
        )
        assert result.success
        (materialization,) = result.asset_materializations_for_node("parquet_partitions")
        return {k: v.value for k, v in materialization.metadata.items()}

    metadata = await asyncio.to_thread(run)
    assert {k: metadata[k] for k in ("rows", "first_offset", "last_offset", "files")} == {
        "rows": 600,
        "first_offset": 600,
        "last_offset": 1199,
        "files": 1,
    }
    assert metadata["pipes_reports"] == 1
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == [H0 + HOUR]
    (file,) = commits[0].files
    table = pq.read_table(pa.BufferReader(await objects.get(file.path)))
    assert table.column("offset").to_pylist() == list(range(600, 1200))
    assert table.column("payload").to_pylist() == [payload(o) for o in range(600, 1200)]
    assert await check_files(etcd_kv, keys, objects, TOPIC) == []
    assert await check_rows(etcd_kv, keys, objects, TOPIC) == []
    await objects.close()


async def test_an_hour_not_complete_fails_the_run_naming_it(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """The clock is half-way through the second hour: the program refuses it, and the run fails
    naming the topic and hour and where the program's error is, with nothing committed."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=HOUR // 2, objects=objects)
    await objects.close()
    instance.add_dynamic_partitions(topics_partitions.name, [TOPIC])
    key = str(partition_key(TOPIC, H0 + HOUR))

    def run() -> str:
        result = materialize(
            [parquet_partitions],
            instance=instance,
            resources=_resources(etcd_server, keys, tmp_path),
            partition_key=key,
            raise_on_error=False,
        )
        assert not result.success
        assert result.asset_materializations_for_node("parquet_partitions") == []
        (failure,) = [e for e in result.all_events if e.is_step_failure]
        return str(failure.step_failure_data.error)  # type: ignore[union-attr]

    error = await asyncio.to_thread(run)
    assert f"failed for topic {TOPIC}, hours 2026-11-23-11:00" in error, error
    assert "error is in this step's stderr" in error, error
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert commits == []


def _wait_for_runs(instance: DagsterInstance, backfill_id: str, timeout: float) -> list[object]:
    deadline = time.monotonic() + timeout
    while True:
        runs = instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: backfill_id}))
        if runs and all(r.is_finished for r in runs):
            return list(runs)
        assert time.monotonic() < deadline, [(r.run_id, r.status) for r in runs]
        time.sleep(0.5)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_backfill_from_the_ui_runs_as_one_run(
    etcd_kv: EtcdKV,
    etcd_server: str,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """launchPartitionBackfill (the UI's mutation) over three hours of a topic, then the
    backfill daemon's iterations: ONE run (one Spark program: the location's default
    resources), tagged with the range that covers all three, committing all three."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=3, objects=objects)
    await objects.close()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DANUBE_INGEST_ETCD_ENDPOINTS", etcd_server)
    monkeypatch.setenv("DANUBE_INGEST_ETCD_PREFIX", keys.prefix)
    monkeypatch.setenv("DANUBE_INGEST_DATA_DIR", str(tmp_path))
    hours = [str(partition_key(TOPIC, H0 + i * HOUR)) for i in range(3)]

    def backfill() -> tuple[list[object], str]:
        with (
            # Runs launched at once (the UI's instance queues them for the daemon instead).
            instance_for_test(overrides={"run_coordinator": DEFAULT_COORDINATOR}) as instance,
            define_out_of_process_context("workspace.yaml", None, instance) as context,
        ):
            instance.add_dynamic_partitions(topics_partitions.name, [TOPIC])
            launched = execute_dagster_graphql(
                context,
                LAUNCH_PARTITION_BACKFILL_MUTATION,
                variables={
                    "backfillParams": {
                        "partitionNames": hours,
                        "assetSelection": [{"path": ["parquet_partitions"]}],
                    }
                },
            )
            answer = launched.data["launchPartitionBackfill"]
            assert answer["__typename"] == "LaunchBackfillSuccess", answer
            backfill_id = answer["backfillId"]
            deadline = time.monotonic() + 180
            while not instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: backfill_id})):
                list(execute_backfill_iteration(context.process_context, logging.getLogger()))
                assert time.monotonic() < deadline
            runs = _wait_for_runs(instance, backfill_id, 120)
            # Further iterations finish the backfill and launch nothing more.
            for _ in range(3):
                list(execute_backfill_iteration(context.process_context, logging.getLogger()))
            runs = list(instance.get_runs(filters=RunsFilter(tags={BACKFILL_ID_TAG: backfill_id})))
            return runs, backfill_id

    runs, _ = await asyncio.to_thread(backfill)
    assert len(runs) == 1, runs
    (run,) = runs
    assert run.status == DagsterRunStatus.SUCCESS, run  # type: ignore[attr-defined]
    tags = run.tags  # type: ignore[attr-defined]
    assert (tags[ASSET_PARTITION_RANGE_START_TAG], tags[ASSET_PARTITION_RANGE_END_TAG]) == (
        hours[0],
        hours[-1],
    )
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [(c.start_ms, c.rows) for c in commits] == [(H0 + i * HOUR, 600) for i in range(3)]


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
async def test_asset_checks_pass_then_fail_on_a_damaged_file(
    etcd_kv: EtcdKV,
    etcd_server: str,
    keys: Keys,
    instance: DagsterInstance,
    tmp_path: Path,
    damage: str,
) -> None:
    await publish_topic(etcd_kv, keys, hours=2)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    done = await convert(etcd_kv, keys, store)
    resources = _resources(etcd_server, keys, tmp_path)

    def run_checks() -> dict[str, bool]:
        result = materialize(
            [parquet_partitions, *parquet_checks],
            instance=instance,
            resources=resources,
            selection=AssetSelection.checks(*parquet_checks),
            raise_on_error=False,
        )
        return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}

    names = {"rows_match_offsets", "frontier_contiguous", "files_intact"}
    assert await asyncio.to_thread(run_checks) == dict.fromkeys(names, True)
    path = done[1][4][0]
    if damage == "deleted":
        await store.delete(path)
    else:
        await store.put(path, (await store.get(path))[:-100])
    await store.close()
    assert await asyncio.to_thread(run_checks) == {
        "rows_match_offsets": False,
        "frontier_contiguous": True,
        "files_intact": False,
    }


def test_definitions_validate() -> None:
    dagster = str(Path(sys.executable).with_name("dagster"))
    validated = subprocess.run(
        [dagster, "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "All code locations passed validation" in validated.stdout + validated.stderr


def test_the_location_lists_the_parquet_asset_sensor_and_checks() -> None:
    from pipelines.definitions import defs

    repository = defs.get_repository_def()
    assert repository.has_sensor_def("parquet_topics_sensor")
    graph = defs.resolve_asset_graph()
    keys = {(check.asset_key.path[-1], check.name) for check in graph.asset_check_keys}
    parquet = {name for asset, name in keys if asset == "parquet_partitions"}
    assert parquet == {"rows_match_offsets", "frontier_contiguous", "files_intact"}
    # The other checks of the location: the object manifest's (assets/objects.py).
    assert keys - {("parquet_partitions", n) for n in parquet} == {
        ("object_manifest", "objects_intact"),
        ("object_manifest", "ranges_contiguous"),
    }
    assert json.dumps(sorted(str(k) for k in graph.get_all_asset_keys()))
