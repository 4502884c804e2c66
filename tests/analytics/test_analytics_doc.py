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
ICEBERG_DOC = ROOT / "docs" / "iceberg.md"


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
    # The job published the table to the default catalog (SQLite in the data directory), and
    # docs/iceberg.md's Python blocks, run as pasted with the same environment, read it by
    # name through Spark SQL and pyiceberg.
    assert result["iceberg_table"] == "danube.default.orders"
    assert result["iceberg_snapshot"] is not None
    assert (tmp_path / "iceberg" / "catalog.db").is_file()
    blocks = _python_blocks(ICEBERG_DOC)
    assert len(blocks) == 2 and "catalog_session()" in blocks[0]
    env = _unactivated_env(etcd_server, keys, tmp_path)
    runs = [
        await asyncio.to_thread(
            subprocess.run,
            [str(ROOT / ".venv" / "bin" / "python"), "-c", block],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for block in blocks
    ]
    for run in runs:
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    total = 2 * PER_HOUR
    spark_lines = [line.strip() for line in runs[0].stdout.splitlines()]
    assert f"|{total}|{total - 1}|" in spark_lines  # count and last offset, by name
    assert spark_lines.count(f"|{total}|") == 1  # the first snapshot holds all of it
    num_rows, frontier = runs[1].stdout.split()
    assert int(num_rows) == total - 10
    assert int(frontier) == result["upper_ms"]


def _python_blocks(doc: Path) -> list[str]:
    """The ```python blocks of ``doc``, in order."""
    blocks, current = [], None
    for line in doc.read_text().splitlines():
        if current is None and line.strip() == "```python":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks
