"""The Spark engine and the Spark job (``danube_ingest.analytics.job``) on a real local[2]
Spark, over the real daemon's objects (``daemon_support``): the Spark engine writes the same
bytes as the local one, and the job run as a child process, SIGKILLed mid-run (driver, JVM and
workers) and run again, ends with exactly the local engine's files and one commit per
partition."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import PipesSubprocessClient, asset, materialize

from danube_ingest.analytics.convert import ConvertError, StoreSpec, convert
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.metadata import EtcdKV
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.store import ObjectStore
from tests.analytics.daemon_support import AVRO, JSON_T, PLAIN, WIDTH_S, Produced, clone

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a job child may take (a JVM start and a few tasks on a loaded 2-core machine).
JOB_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("danube-convert-test")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture
async def kv(produced: Produced) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    yield store
    await store.close()


def tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


async def local_conversion(
    kv: EtcdKV, produced: Produced, topic: str, wh_dir: Path
) -> dict[str, bytes]:
    """The local engine's files for ``topic`` on a fresh copy of the metadata."""
    keys = await clone(kv, produced.prefix)
    objects = ObjectStore("fs", options={"root": str(produced.objects)})
    warehouse = ObjectStore("fs", options={"root": str(wh_dir)})
    await convert(
        kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=topic, width_s=WIDTH_S
    )
    await objects.close()
    await warehouse.close()
    return tree(wh_dir / "warehouse" / "r1")


async def test_spark_engine_writes_the_local_engines_bytes(
    spark: Any, produced: Produced, kv: EtcdKV, tmp_path: Path
) -> None:
    for topic in (PLAIN, AVRO, JSON_T):
        expected = await local_conversion(kv, produced, topic, tmp_path / f"local{topic}")
        keys = await clone(kv, produced.prefix)
        wh_dir = tmp_path / f"spark{topic}"
        objects = ObjectStore("fs", options={"root": str(produced.objects)})
        warehouse = ObjectStore("fs", options={"root": str(wh_dir)})
        result = await convert(
            kv=kv,
            keys=keys,
            objects=objects,
            warehouse=warehouse,
            topic=topic,
            engine="spark",
            spark=spark,
            width_s=WIDTH_S,
            objects_spec=StoreSpec("fs", {"root": str(produced.objects)}),
            warehouse_spec=StoreSpec("fs", {"root": str(wh_dir)}),
        )
        await objects.close()
        await warehouse.close()
        assert {p.outcome for p in result.partitions} == {"committed"}
        assert sum(p.rows for p in result.partitions) == produced.sent[topic]
        assert tree(wh_dir / "warehouse" / "r1") == expected and expected


def _job(produced: Produced, prefix: str, config: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "DANUBE_INGEST_CONFIG": str(config),
        "DANUBE_INGEST_ETCD_ENDPOINTS": produced.endpoint,
        "DANUBE_INGEST_ETCD_PREFIX": prefix,
        "PYSPARK_SUBMIT_ARGS": "--master local[2] --conf spark.ui.enabled=false pyspark-shell",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("PYSPARK_PYTHON", None)  # the job sets it to its own interpreter
    return subprocess.Popen(
        [sys.executable, "-m", "danube_ingest.analytics.job", "--topic", AVRO, "--width-s", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


async def test_job_killed_mid_run_then_rerun_gives_exact_output_and_one_commit(
    produced: Produced, kv: EtcdKV, tmp_path: Path
) -> None:
    expected = await local_conversion(kv, produced, AVRO, tmp_path / "local")
    objects_dir = tmp_path / "objects"
    shutil.copytree(produced.objects, objects_dir)
    config = tmp_path / "broker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "broker": {"data_dir": str(tmp_path / "data")},
                "storage": {"cloud": {"backend": "fs", "root": str(objects_dir)}},
            }
        )
    )
    keys = await clone(kv, produced.prefix)
    staging = objects_dir / "warehouse" / "_staging"

    child = _job(produced, keys.prefix, config)
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        # Kill the whole process group (driver, JVM, Python workers) once a task staged a file.
        while not (staging.exists() and any(staging.rglob("*.parquet"))):
            assert child.poll() is None, f"the job ended before it was killed: {child.stderr}"
            assert time.monotonic() < deadline, "the job staged nothing in time"
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL

    rerun = _job(produced, keys.prefix, config)
    out, err = rerun.communicate(timeout=JOB_TIMEOUT)
    assert rerun.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["topic"] == AVRO and report["rendition"] == "r1"
    assert sum(p["rows"] for p in report["partitions"]) <= produced.sent[AVRO]

    assert tree(objects_dir / "warehouse" / "r1") == expected
    records = [
        PartitionCommit.decode(e.value, e.key)
        for e in await kv.get_prefix(TableKeys(keys, AVRO).parts_prefix("r1"))
    ]
    assert len(records) == len({r.start_ms for r in records}) == len(expected)
    assert all(r.published for r in records)
    assert sum(r.rows for r in records) == produced.sent[AVRO]


@pytest.mark.dagster
def test_job_launched_through_dagster_pipes_reports_rows_and_offsets(
    produced: Produced, tmp_path: Path
) -> None:
    """The job (local engine: no JVM needed for this) under a real Dagster asset through
    ``PipesSubprocessClient``: the materialization carries the rows and offsets, the custom
    messages one entry per partition."""
    keys = asyncio.run(_clone(produced))
    config = tmp_path / "broker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "broker": {"data_dir": str(tmp_path / "data")},
                "storage": {"cloud": {"backend": "fs", "root": str(tmp_path / "o")}},
            }
        )
    )
    shutil.copytree(produced.objects, tmp_path / "o")
    env = {
        "DANUBE_INGEST_CONFIG": str(config),
        "DANUBE_INGEST_ETCD_ENDPOINTS": produced.endpoint,
        "DANUBE_INGEST_ETCD_PREFIX": keys.prefix,
        "PYTHONPATH": str(ROOT),
    }
    messages: list[Any] = []

    @asset
    def converted(context, pipes: PipesSubprocessClient) -> Any:  # type: ignore[no-untyped-def]
        command = [sys.executable, "-m", "danube_ingest.analytics.job", "--topic", JSON_T]
        invocation = pipes.run(
            context=context,
            command=[*command, "--width-s", "60", "--engine", "local"],
            env=env,
        )
        messages.extend(invocation.get_custom_messages())
        return invocation.get_materialize_result()

    result = materialize([converted], resources={"pipes": PipesSubprocessClient()})
    assert result.success
    [event] = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    assert metadata["rows"] == produced.sent[JSON_T]
    assert (metadata["first_offset"], metadata["last_offset"]) == (0, produced.sent[JSON_T] - 1)
    assert metadata["rendition"] == "r1" and metadata["files"]
    assert [m["outcome"] for m in messages] == ["committed"] * len(messages)
    assert sum(m["rows"] for m in messages) == produced.sent[JSON_T]


async def _clone(produced: Produced) -> Any:
    kv = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    try:
        return await clone(kv, produced.prefix)
    finally:
        await kv.close()


async def test_spark_engine_names_a_corrupt_object_and_commits_nothing_of_it(
    spark: Any, produced: Produced, kv: EtcdKV, tmp_path: Path
) -> None:
    copy = tmp_path / "objects"
    shutil.copytree(produced.objects, copy)
    keys = await clone(kv, produced.prefix)
    read = await kv.get_prefix(keys.storage_objects_prefix(PLAIN))
    bad = max((ObjectRange.decode(e.value, e.key) for e in read), key=lambda r: r.start_offset)
    data = bytearray((copy / bad.object_key).read_bytes())
    data[bad.byte_start + bad.byte_length // 2] ^= 0xFF
    (copy / bad.object_key).write_bytes(bytes(data))
    objects = ObjectStore("fs", options={"root": str(copy)})
    wh_dir = tmp_path / "wh"
    warehouse = ObjectStore("fs", options={"root": str(wh_dir)})
    with pytest.raises(ConvertError, match=rf"{bad.object_key}.*byte") as failed:
        await convert(
            kv=kv,
            keys=keys,
            objects=objects,
            warehouse=warehouse,
            topic=PLAIN,
            engine="spark",
            spark=spark,
            width_s=WIDTH_S,
            objects_spec=StoreSpec("fs", {"root": str(copy)}),
            warehouse_spec=StoreSpec("fs", {"root": str(wh_dir)}),
        )
    await objects.close()
    await warehouse.close()
    assert "nothing of it was committed" in str(failed.value)
    committed = [
        PartitionCommit.decode(e.value, e.key)
        for e in await kv.get_prefix(TableKeys(keys, PLAIN).parts_prefix("r1"))
    ]
    # The partitions before the damaged one are committed and readable; none from it on.
    assert all(c.last_offset < bad.start_offset for c in committed)
    assert not list((wh_dir / "warehouse" / "_staging").rglob("*.parquet"))
    for committed_file in (wh_dir / "warehouse" / "r1").rglob("*.parquet"):
        assert committed_file.stat().st_size > 0
