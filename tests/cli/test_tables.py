"""``danube-ingest tables`` and ``tables convert`` as child processes, on the real daemon's
objects (``tests.analytics.daemon_support``) and a real etcd."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from danube_ingest.analytics.layout import partition_end
from danube_ingest.metadata import EtcdKV, Keys
from tests.analytics.daemon_support import (
    JSON_T,
    PAYLOADS,
    PLAIN,
    WIDTH_S,
    Produced,
    clone,
    produce_topics,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def produced(etcd_server: str, tmp_path_factory: pytest.TempPathFactory) -> Produced:
    return produce_topics(etcd_server, tmp_path_factory.mktemp("daemon"))


def _clone(produced: Produced) -> Keys:
    async def run() -> Keys:
        kv = await EtcdKV.connect([produced.endpoint], timeout=5.0)
        try:
            return await clone(kv, produced.prefix)
        finally:
            await kv.close()

    return asyncio.run(run())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_tables_convert_then_list(produced: Produced, tmp_path: Path) -> None:
    keys = _clone(produced)
    config = tmp_path / "broker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "etcd": {"endpoints": [produced.endpoint], "prefix": keys.prefix},
                "storage": {"cloud": {"backend": "fs", "root": str(produced.objects)}},
            }
        )
    )
    upper = partition_end(produced.last_minute, WIDTH_S)

    empty = _cli("tables", "--config", str(config))
    assert empty.returncode == 0, empty.stderr
    assert "no tables" in empty.stdout

    done = _cli("tables", "convert", "--config", str(config), "--topic", JSON_T, "--width-s", "60")
    assert done.returncode == 0, done.stderr
    assert f"topic {JSON_T} rendition r1:" in done.stdout
    assert f"upper {_iso(upper)}" in done.stdout
    assert "committed" in done.stdout

    files = sorted((produced.objects / "warehouse" / "r1").rglob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert sorted(r["offset"] for r in rows) == list(range(produced.sent[JSON_T]))
    assert all(r["payload"] == PAYLOADS[JSON_T](r["offset"]) for r in rows)

    listed = _cli("tables", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    assert f"table {JSON_T}: width 60 s, active r1, since " in listed.stdout
    assert f"upper {_iso(upper)}" in listed.stdout
    assert "rendition r1: active" in listed.stdout
    assert f"last {_iso(produced.last_minute)}" in listed.stdout
    assert PLAIN not in listed.stdout  # no table yet

    alone = _cli("tables", "--config", str(config), "--topic", PLAIN)
    assert alone.stdout.strip() == f"topic {PLAIN}: no table"

    early = _cli(
        "tables", "convert", "--config", str(config), "--topic", JSON_T, "--start-ms", str(upper)
    )
    assert early.returncode == 1
    assert f"partition {upper}" in early.stderr and "not complete" in early.stderr

    # The daemon is stopped: the clock cannot pass the end of the current minute.
    waited = _cli("tables", "convert", "--config", str(config), "--topic", JSON_T, "--wait", "1.5")
    assert waited.returncode == 1
    assert f"{JSON_T} is not complete up to" in waited.stderr and "its clock is at" in waited.stderr
