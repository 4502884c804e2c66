"""docs/analytics.md's ``spark-submit`` line for the Spark job, run as pasted: from the
repository's root, without the venv on ``PATH`` (nothing activated), converting a real topic
(``tests.pipelines.parquet_support``) on a real etcd with Spark ``local[2]``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from tests.pipelines.parquet_support import PER_HOUR, TOPIC, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "analytics.md"


def _spark_submit_line() -> str:
    lines = [
        line
        for line in DOC.read_text().splitlines()
        if "spark-submit " in line and "danube_ingest/analytics/job.py" in line
    ]
    assert len(lines) == 1, lines
    return lines[0]


def _unactivated_env(etcd: str, keys: Keys, data_dir: Path) -> dict[str, str]:
    """This process's environment as a fresh shell would have it: no venv on PATH, no Spark or
    danube-ingest settings; then where etcd and the objects are (the job's documented
    environment variables)."""
    venv_bin = str(ROOT / ".venv" / "bin")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYSPARK_", "SPARK_", "DANUBE_INGEST_")) and k != "VIRTUAL_ENV"
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and p.rstrip("/") != venv_bin
    )
    env["DANUBE_INGEST_ETCD_ENDPOINTS"] = etcd
    env["DANUBE_INGEST_ETCD_PREFIX"] = keys.prefix
    env["DANUBE_INGEST_DATA_DIR"] = str(data_dir)
    return env


async def test_documented_spark_submit_line_converts_without_an_activated_venv(
    etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    line = _spark_submit_line()
    assert f"--topic {TOPIC}" in line
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    try:
        await publish_topic(kv, keys, hours=2, objects=store)
    finally:
        await store.close()
        await kv.close()

    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", line],
        cwd=ROOT,
        env=_unactivated_env(etcd_server, keys, tmp_path),
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    # stdout also carries Spark's own console output: the job's result is its one JSON line.
    [summary] = [x for x in done.stdout.splitlines() if x.startswith('{"topic"')]
    result = json.loads(summary)
    assert result["topic"] == TOPIC
    assert [p["outcome"] for p in result["partitions"]] == ["committed", "committed"]
    assert sum(p["rows"] for p in result["partitions"]) == 2 * PER_HOUR
    files = sorted((tmp_path / "objects" / "warehouse" / "r1").rglob("*.parquet"))
    assert len(files) == 2
