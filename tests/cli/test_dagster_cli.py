"""``danube-ingest dagster``: the Dagster UI and daemon of the code location outside ``dev``
(the cluster's Dagster pod). Refusals come before anything starts; the running UI is checked
in podman by ``tests/containers/test_cluster.py``."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def _dagster(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", "dagster", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_port_in_use_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _dagster("--port", str(port), "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert f"port 127.0.0.1:{port} is in use" in run.stderr
    assert not (tmp_path / "d").exists()


def test_a_bad_config_is_refused_with_its_error(tmp_path: Path) -> None:
    config = tmp_path / "broker.yml"
    config.write_text("storage:\n  cloud:\n    backend: floppy\n")
    run = _dagster("--config", str(config), "--port", "1", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "storage.cloud.backend" in run.stderr, run.stderr
