"""The Parquet layer in real Dagster against a real etcd: the sensor adds each table's complete
partitions from its since (a minute table made mid-hour included) and requests the uncommitted
ones as one run per range, the asset converts exactly its partitions with the real program
(danube_ingest.analytics.job) launched through Pipes (``--engine local`` where Spark is not
the point, Spark where marked) and skips keys outside the table, a run that cannot convert
fails with its cause as message and as the ``converted`` check's metadata, a backfill over all
partitions launched through GraphQL as the UI launches it runs as ONE run converting exactly
what exists, and the asset checks fail on a deleted or truncated Parquet file."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import (
    AssetKey,
    AssetSelection,
    DagsterInstance,
    DagsterRunStatus,
    ExecuteInProcessResult,
    PipesSubprocessClient,
    RunRequest,
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
    PARTITIONS,
    parquet_checks,
    parquet_partitions,
    parquet_topics_sensor,
    partition_key,
)
from danube_ingest.analytics.checks import check_files, check_rows, committed_parts
from danube_ingest.analytics.iceberg import IcebergTarget, publish
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import free_port
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource
from tests.pipelines.parquet_support import (
    H0,
    HOUR,
    MINUTE,
    SINCE,
    TOPIC,
    convert,
    minute_table,
    payload,
    publish_clock,
    publish_topic,
)

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


def _sensor(
    instance: DagsterInstance, etcd: EtcdResource
) -> Callable[[str | None], tuple[list[str], list[RunRequest], str | None]]:
    """Evaluate the sensor as the daemon does (its added keys applied to the instance):
    ``(added keys, run requests, cursor)``."""

    def evaluate(cursor: str | None) -> tuple[list[str], list[RunRequest], str | None]:
        context = build_sensor_context(instance=instance, cursor=cursor, resources={"etcd": etcd})
        result = parquet_topics_sensor(context)
        added = [k for r in result.dynamic_partitions_requests for k in r.partition_keys]
        for request in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        return added, list(result.run_requests or []), result.cursor

    return evaluate


def _range(request: RunRequest) -> tuple[str, str]:
    tags = request.tags
    return tags[ASSET_PARTITION_RANGE_START_TAG], tags[ASSET_PARTITION_RANGE_END_TAG]


def _materialize(
    instance: DagsterInstance,
    resources: dict[str, object],
    *,
    partition_key: str | None = None,
    tags: Mapping[str, str] | None = None,
) -> ExecuteInProcessResult:
    return materialize(
        [parquet_partitions],
        instance=instance,
        resources=resources,
        partition_key=partition_key,
        tags=tags,
        raise_on_error=False,
    )


def _run_job(
    instance: DagsterInstance, resources: dict[str, object], request: RunRequest
) -> ExecuteInProcessResult:
    """The sensor's job ``parquet`` (as the location defines it) run for ``request``."""
    from pipelines.definitions import defs

    return defs.resolve_job_def("parquet").execute_in_process(
        instance=instance, resources=resources, tags=request.tags, raise_on_error=False
    )


def _metadata(result: ExecuteInProcessResult) -> dict[str, object]:
    assert result.success, _failure(result)
    # One materialization per partition of the run, all with the run's metadata.
    materializations = result.asset_materializations_for_node("parquet_partitions")
    assert len({m.partition for m in materializations}) == len(materializations)
    first = {k: v.value for k, v in materializations[0].metadata.items()}
    assert all({k: v.value for k, v in m.metadata.items()} == first for m in materializations)
    return first


def _failure(result: ExecuteInProcessResult) -> str:
    failures = [e for e in result.all_events if e.is_step_failure]
    return "; ".join(str(e.step_failure_data.error) for e in failures)  # type: ignore[union-attr]


def _converted(result: ExecuteInProcessResult) -> tuple[bool, dict[str, object]]:
    """The ``converted`` check's outcome and metadata."""
    (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "converted"]
    return evaluation.passed, {k: v.value for k, v in evaluation.metadata.items()}


async def test_sensor_shows_an_hourly_tables_complete_hours_and_requests_them_once(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """No table yet: the hourly table a first run makes, from the topic's first ingest hour."""
    await publish_topic(etcd_kv, keys, hours=3, extra_ms=HOUR // 2)
    evaluate = _sensor(instance, EtcdResource(endpoints=etcd_server, prefix=keys.prefix))
    hours = [partition_key(TOPIC, H0 + i * HOUR) for i in range(3)]
    # A key added by hand that names no table partition is ignored, not fatal.
    instance.add_dynamic_partitions(PARTITIONS, ["by-hand"])
    added, requests, cursor = await asyncio.to_thread(evaluate, None)
    # The three complete hours, not the fourth (its clock is only half-way through it).
    assert added == hours == ["/default/orders@2026-11-23T10:00", *hours[1:]]
    assert instance.get_dynamic_partitions(PARTITIONS) == ["by-hand", *hours]
    # One run for the topic's range of consecutive keys.
    assert [_range(r) for r in requests] == [(hours[0], hours[-1])]
    assert requests[0].tags["danube/topic"] == TOPIC
    # In flight: the next tick requests nothing again and adds nothing again.
    assert await asyncio.to_thread(evaluate, cursor) == ([], [], cursor)
    # The hours committed meanwhile leave the cursor; nothing is pending any more.
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await convert(etcd_kv, keys, store)
    await store.close()
    assert await asyncio.to_thread(evaluate, cursor) == ([], [], "{}")


@pytest.mark.slow
async def test_a_minute_table_made_mid_hour_reaches_parquet_minute_by_minute(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """Issue 22: a 60 s table made at 10:37 (as ``tables convert --width-s 60`` makes it) is
        shown from 10:37, not from an hour grid; the sensor's run converts its complete minutes;
        the next minute is requested as soon as the clock passes it (no waiting for the hour). The
    runs are the location's job ``parquet`` executed with the sensor's run requests."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    # Two hours of entries, the clock at 11:05:00.001 (minutes up to 11:04 complete).
    await publish_topic(etcd_kv, keys, hours=2, objects=objects)
    await objects.close()
    await publish_clock(etcd_kv, keys, H0 + HOUR + 5 * MINUTE + 1)
    await minute_table(etcd_kv, keys)
    evaluate = _sensor(instance, EtcdResource(endpoints=etcd_server, prefix=keys.prefix))
    minutes = list(range(SINCE, H0 + HOUR + 5 * MINUTE, MINUTE))
    added, requests, cursor = await asyncio.to_thread(evaluate, None)
    assert added == [partition_key(TOPIC, m) for m in minutes]
    assert added[0] == "/default/orders@2026-11-23T10:37"
    (request,) = requests
    assert _range(request) == (added[0], added[-1])

    resources = _resources(etcd_server, keys, tmp_path)
    result = await asyncio.to_thread(_run_job, instance, resources, request)
    metadata = _metadata(result)
    assert (metadata["partitions"], metadata["skipped"]) == (len(minutes), 0)
    assert metadata["rows"] == 600 + 50 - 370  # offsets 370..649: 10:37 to 11:05
    assert (metadata["first_offset"], metadata["last_offset"]) == (370, 649)
    assert _converted(result)[0] is True
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == minutes

    # A minute later: that minute alone is added and requested at the next tick.
    await publish_clock(etcd_kv, keys, H0 + HOUR + 6 * MINUTE + 1)
    added, requests, cursor = await asyncio.to_thread(evaluate, cursor)
    nxt = partition_key(TOPIC, H0 + HOUR + 5 * MINUTE)
    assert (added, [_range(r) for r in requests]) == ([nxt], [(nxt, nxt)])
    metadata = _metadata(await asyncio.to_thread(_run_job, instance, resources, requests[0]))
    assert (metadata["partitions"], metadata["rows"]) == (1, 10)
    assert await asyncio.to_thread(evaluate, cursor) == ([], [], "{}")


async def test_a_range_reaching_before_since_converts_what_exists(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """The whole hour 10:00-10:59 asked of a minute table made at 10:37 (what Dagster used to
    request): the run succeeds, converts 10:37-10:59 and lists the 37 minutes before since as
    skipped (they are not part of the table)."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=1, objects=objects)
    await objects.close()
    await minute_table(etcd_kv, keys)
    hour = [partition_key(TOPIC, H0 + i * MINUTE) for i in range(60)]
    instance.add_dynamic_partitions(PARTITIONS, hour)
    tags = {ASSET_PARTITION_RANGE_START_TAG: hour[0], ASSET_PARTITION_RANGE_END_TAG: hour[-1]}
    result = await asyncio.to_thread(
        _materialize, instance, _resources(etcd_server, keys, tmp_path), tags=tags
    )
    metadata = _metadata(result)
    assert (metadata["partitions"], metadata["skipped"], metadata["rows"]) == (23, 37, 230)
    assert "before the table's since" in str(metadata["skipped_partitions"])
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == list(range(SINCE, H0 + HOUR, MINUTE))


async def test_materializing_partitions_converts_exactly_them_through_pipes(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=3, objects=objects)
    await objects.close()
    key = partition_key(TOPIC, H0 + HOUR)
    instance.add_dynamic_partitions(PARTITIONS, [key])
    resources = _resources(etcd_server, keys, tmp_path)
    result = await asyncio.to_thread(_materialize, instance, resources, partition_key=key)
    metadata = _metadata(result)
    assert {
        k: metadata[k] for k in ("rows", "first_offset", "last_offset", "files", "partitions")
    } == {
        "rows": 600,
        "first_offset": 600,
        "last_offset": 1199,
        "files": 1,
        "partitions": 1,
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
    instance.add_dynamic_partitions(PARTITIONS, [partition_key(TOPIC, H0 + HOUR)])
    resources = {**_resources(etcd_server, keys, tmp_path), "convert_job": ConvertJobResource()}

    def run() -> dict[str, object]:
        result = materialize(
            [parquet_partitions],
            instance=instance,
            resources=resources,
            partition_key=partition_key(TOPIC, H0 + HOUR),
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


async def test_an_hour_not_complete_fails_before_any_program_starts_naming_it(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """The clock is half-way through the second hour: the run fails with the cause as its
    message and as the ``converted`` check's metadata, before any program (or Spark) starts
    (the program's interpreter does not even exist), with nothing committed."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=HOUR // 2, objects=objects)
    await objects.close()
    key = partition_key(TOPIC, H0 + HOUR)
    instance.add_dynamic_partitions(PARTITIONS, [key])
    resources = {
        **_resources(etcd_server, keys, tmp_path),
        "convert_job": ConvertJobResource(python=str(tmp_path / "no-such-python")),
    }
    result = await asyncio.to_thread(_materialize, instance, resources, partition_key=key)
    assert not result.success
    assert result.asset_materializations_for_node("parquet_partitions") == []
    error = _failure(result)
    assert f"cannot convert {TOPIC}: partition {H0 + HOUR} (2026-11-23T11:00:00Z" in error, error
    assert "is not complete: its clock is at 2026-11-23T11:30:00Z" in error, error
    passed, metadata = _converted(result)
    assert passed is False and metadata["cause"] == "not_complete", metadata
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert commits == []


async def test_the_programs_error_is_the_runs_failure_message(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, instance: DagsterInstance, tmp_path: Path
) -> None:
    """An object damaged inside the second hour's range: the program fails reading it; the
    run's failure message is the program's own one-line error (naming the object and byte),
    reported through Pipes, and the check records its cause."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=2, objects=objects)
    read = await etcd_kv.get_prefix(keys.storage_objects_prefix(TOPIC))
    bad = max((ObjectRange.decode(e.value, e.key) for e in read), key=lambda r: r.start_offset)
    data = bytearray(await objects.get(bad.object_key))
    data[bad.byte_start + bad.byte_length // 2] ^= 0xFF
    await objects.put(bad.object_key, bytes(data))
    await objects.close()
    keys_ = [partition_key(TOPIC, H0), partition_key(TOPIC, H0 + HOUR)]
    instance.add_dynamic_partitions(PARTITIONS, keys_)
    tags = {ASSET_PARTITION_RANGE_START_TAG: keys_[0], ASSET_PARTITION_RANGE_END_TAG: keys_[1]}
    result = await asyncio.to_thread(
        _materialize, instance, _resources(etcd_server, keys, tmp_path), tags=tags
    )
    assert not result.success
    error = _failure(result)
    assert f"the conversion program failed for {TOPIC}: conversion of {TOPIC} partition" in error
    assert bad.object_key in error and "byte" in error, error
    passed, metadata = _converted(result)
    assert passed is False and metadata["cause"] == "read_failed", metadata
    # The first hour, before the damage, is committed.
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == [H0]


async def test_etcd_unreachable_is_the_runs_failure_message(
    instance: DagsterInstance, tmp_path: Path
) -> None:
    key = partition_key(TOPIC, H0)
    instance.add_dynamic_partitions(PARTITIONS, [key])
    port = free_port()
    resources = {
        **_resources(f"http://127.0.0.1:{port}", Keys("/nowhere"), tmp_path),
        "etcd": EtcdResource(
            endpoints=f"http://127.0.0.1:{port}", prefix="/nowhere", connect_timeout_seconds=1.0
        ),
    }
    result = await asyncio.to_thread(_materialize, instance, resources, partition_key=key)
    assert not result.success
    assert f"cannot convert {TOPIC} at http://127.0.0.1:{port}" in _failure(result)
    passed, metadata = _converted(result)
    assert passed is False and metadata["cause"] == "etcd_unreachable", metadata


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
async def test_a_backfill_of_all_partitions_from_the_ui_converts_exactly_what_exists(
    etcd_kv: EtcdKV,
    etcd_server: str,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A minute table made at 10:37, the sensor's keys, then launchPartitionBackfill (the UI's
    mutation) over ALL partitions of the asset and the backfill daemon's iterations: ONE run
    (one Spark program: the location's default resources), tagged with the range of all the
    keys, committing exactly the table's complete minutes from its since."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    # Two hours of entries, the clock at 11:05:00.001 (minutes up to 11:04 complete).
    await publish_topic(etcd_kv, keys, hours=2, objects=objects)
    await objects.close()
    await publish_clock(etcd_kv, keys, H0 + HOUR + 5 * MINUTE + 1)
    await minute_table(etcd_kv, keys)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DANUBE_INGEST_ETCD_ENDPOINTS", etcd_server)
    monkeypatch.setenv("DANUBE_INGEST_ETCD_PREFIX", keys.prefix)
    monkeypatch.setenv("DANUBE_INGEST_DATA_DIR", str(tmp_path))
    minutes = list(range(SINCE, H0 + HOUR + 5 * MINUTE, MINUTE))
    etcd = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)

    def backfill() -> tuple[list[object], list[str]]:
        with (
            # Runs launched at once (the UI's instance queues them for the daemon instead).
            instance_for_test(overrides={"run_coordinator": DEFAULT_COORDINATOR}) as instance,
            define_out_of_process_context("workspace.yaml", None, instance) as context,
        ):
            added, _, _ = _sensor(instance, etcd)(None)
            launched = execute_dagster_graphql(
                context,
                LAUNCH_PARTITION_BACKFILL_MUTATION,
                variables={
                    "backfillParams": {
                        "allPartitions": True,
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
            return runs, added

    runs, added = await asyncio.to_thread(backfill)
    assert added == [partition_key(TOPIC, m) for m in minutes]
    assert len(runs) == 1, runs
    (run,) = runs
    assert run.status == DagsterRunStatus.SUCCESS, run  # type: ignore[attr-defined]
    tags = run.tags  # type: ignore[attr-defined]
    assert (tags[ASSET_PARTITION_RANGE_START_TAG], tags[ASSET_PARTITION_RANGE_END_TAG]) == (
        added[0],
        added[-1],
    )
    _, commits = await committed_parts(etcd_kv, keys, TOPIC)
    assert [c.start_ms for c in commits] == minutes
    assert sum(c.rows for c in commits) == 650 - 370


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

    names = {
        "rows_match_offsets",
        "frontier_contiguous",
        "files_intact",
        "iceberg_matches",
        "iceberg_fresh",
        "partitions_fresh",
    }
    # Committed but not yet in the Iceberg table (the helper converts without publishing).
    assert await asyncio.to_thread(run_checks) == {
        **dict.fromkeys(names, True),
        "iceberg_matches": False,
        "iceberg_fresh": False,  # the table shows nothing of the committed partitions
    }
    target = IcebergTarget.from_config(ObjectStoreResource(data_dir=str(tmp_path)).broker_config())
    assert target is not None
    await publish(etcd_kv, keys, TOPIC, target)
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
        "iceberg_matches": True,  # (the catalog still names the file as committed)
        "iceberg_fresh": True,
        "partitions_fresh": True,
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
    assert parquet == {
        "rows_match_offsets",
        "frontier_contiguous",
        "files_intact",
        "iceberg_matches",
        "iceberg_fresh",
        "partitions_fresh",
        "converted",
    }
    # The graph: the object manifest -> the Parquet tables -> their Iceberg tables.
    upstream = graph.get(AssetKey("parquet_partitions")).parent_keys
    assert upstream == {AssetKey("object_manifest")}
    assert graph.get(AssetKey("iceberg_tables")).parent_keys == {AssetKey("parquet_partitions")}
    # The other checks of the location: the object manifest's (assets/objects.py).
    assert keys - {("parquet_partitions", n) for n in parquet} == {
        ("object_manifest", "objects_intact"),
        ("object_manifest", "ranges_contiguous"),
    }
    assert json.dumps(sorted(str(k) for k in graph.get_all_asset_keys()))
