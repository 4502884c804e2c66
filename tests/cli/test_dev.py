"""``danube-ingest dev``: the one-command local system, stopped the way a terminal stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.testing import free_port

pytestmark = pytest.mark.etcd


def test_ctrl_c_stops_the_broker_before_etcd(tmp_path: Path) -> None:
    broker_port, etcd_port = free_port(), free_port()
    log_path = tmp_path / "dev.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "danube_ingest.cli",
                "dev",
                "--data-dir",
                str(tmp_path / "data"),
                "--listen",
                f"127.0.0.1:{broker_port}",
                "--etcd-port",
                str(etcd_port),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own, as a terminal's job
        )
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.1)
        # Ctrl-C: SIGINT to every process of the terminal's foreground process group.
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(30) == 0, log_path.read_text(errors="replace")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = log_path.read_text(errors="replace")
    assert "error" not in text.lower(), text
    assert text.index("broker stopped") < text.index("etcd stopped"), text
