"""Spark on a standalone cluster (``spark://``), not ``local[N]``: a real master and worker
started from pyspark's own jars (``spark-class``), executors in processes of their own. The
conversion's tasks run on the worker and write byte for byte the files the local engine
writes, and the Iceberg table is read by name through the same catalog settings. Real etcd,
real ``.bin`` objects, an fs warehouse, the SQLite catalog."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest

from danube_ingest.analytics import catalog_session
from danube_ingest.analytics.convert import StoreSpec, convert
from danube_ingest.analytics.iceberg import IcebergTarget
from danube_ingest.config import load_config
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import free_port
from tests.pipelines.parquet_support import PER_HOUR, ROOT, TOPIC, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(400)]

SPARK_HOME = Path(pyspark.__file__).parent


def _spark_class(*args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_NO_DAEMONIZE": "1",
    }
    return subprocess.Popen(
        [str(SPARK_HOME / "bin" / "spark-class"), *args],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@contextlib.contextmanager
def standalone_cluster(work: Path) -> Iterator[str]:
    """A master and one worker (2 cores, 1 GiB) on loopback; yields the master URL once the
    worker is registered."""
    port, ui, worker_ui = free_port(), free_port(), free_port()
    master = _spark_class(
        "org.apache.spark.deploy.master.Master",
        "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui),
        log=work / "master.log",
    )  # fmt: skip
    url = f"spark://127.0.0.1:{port}"
    worker = _spark_class(
        "org.apache.spark.deploy.worker.Worker", url,
        "--host", "127.0.0.1", "--cores", "2", "--memory", "1g",
        "--webui-port", str(worker_ui), "--work-dir", str(work / "worker"),
        log=work / "worker.log",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as answer:
                    state = json.load(answer)
                if state.get("aliveworkers", 0) >= 1:
                    break
            if time.monotonic() > deadline or master.poll() is not None:
                raise RuntimeError(
                    "the standalone cluster did not start: "
                    + (work / "master.log").read_text(errors="replace")[-2000:]
                    + (work / "worker.log").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.5)
        yield url
    finally:
        for process in (worker, master):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(20)
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "r1").rglob("*.parquet"))
    }


async def test_a_standalone_cluster_converts_and_reads_tables_by_name(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    # The same topic under two prefixes: one converted on the cluster, one locally.
    local_keys = Keys(f"{keys.prefix}-local")
    objects = tmp_path / "objects"
    store = ObjectStore("fs", options={"root": str(objects)})
    local_store = ObjectStore("fs", options={"root": str(tmp_path / "local")})
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await publish_topic(etcd_kv, local_keys, hours=2, objects=local_store)
    config = load_config(
        None, {"broker.data_dir": str(tmp_path), "storage.cloud.root": str(objects)}
    )
    target = IcebergTarget.from_config(config)
    assert target is not None
    await convert(
        kv=etcd_kv, keys=local_keys, objects=local_store, warehouse=local_store, topic=TOPIC
    )

    spec = StoreSpec("fs", {"root": str(objects)})
    with standalone_cluster(tmp_path) as master:
        spark = catalog_session(
            "standalone-test",
            master=master,
            config={
                "spark.ui.enabled": "false",
                "spark.sql.session.timeZone": "UTC",
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.executor.memory": "512m",
                "spark.cores.max": "2",
            },
            broker_config=config,
        )
        try:
            assert spark.sparkContext.master == master
            done = await convert(
                kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC,
                engine="spark", spark=spark, objects_spec=spec, warehouse_spec=spec,
                iceberg=target,
            )  # fmt: skip
            assert len(done.partitions) == 2
            # The tasks ran in the worker's executors, not in this process.
            executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
            assert executors >= 2  # the driver and at least one executor
            by_name = spark.sql(
                "SELECT count(*) AS n, min(offset) AS lo, max(offset) AS hi "
                "FROM danube.default.orders"
            ).first()
            assert (by_name.n, by_name.lo, by_name.hi) == (2 * PER_HOUR, 0, 2 * PER_HOUR - 1)
        finally:
            spark.stop()
    assert _files(objects / ROOT) == _files(tmp_path / "local" / ROOT)
    assert len(_files(objects / ROOT)) == 2
    await store.close()
    await local_store.close()
