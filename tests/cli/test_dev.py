"""``danube-ingest dev``: the one-command local system (etcd, broker, Dagster UI with the code
location loaded), stopped the way a terminal stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from danube_ingest.testing import free_port

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]


_LOCATIONS = """{ workspaceOrError { ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


def _code_locations(url: str) -> list[dict[str, object]] | None:
    """The UI's code locations (GraphQL), ``None`` while the UI is not up yet."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": _LOCATIONS}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with opener.open(request, timeout=2) as response:
            body = json.loads(response.read())
    except OSError:
        return None
    entries: list[dict[str, object]] = body["data"]["workspaceOrError"]["locationEntries"]
    return entries


def test_ctrl_c_stops_broker_then_dagster_then_etcd(tmp_path: Path) -> None:
    broker_port, etcd_port, dagster_port = free_port(), free_port(), free_port()
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
                "--dagster-port",
                str(dagster_port),
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
        # The Dagster UI comes up with the code location of workspace.yaml loaded.
        entries = None
        while not entries or entries[0]["loadStatus"] != "LOADED":
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline + 60, (entries, _dagster_log(tmp_path))
            time.sleep(0.5)
            entries = _code_locations(f"http://127.0.0.1:{dagster_port}")
        assert entries[0]["name"] == "pipelines.definitions:defs", entries  # workspace.yaml
        assert entries[0]["locationOrLoadError"] == {"__typename": "RepositoryLocation"}, entries
        # Ctrl-C: SIGINT to every process of the terminal's foreground process group.
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(30) == 0, log_path.read_text(errors="replace")
    finally:
        if process.poll() is None:
            # A failed check: still stop the way the command cleans up after itself (its etcd
            # and Dagster run in sessions of their own), and only then force it.
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = log_path.read_text(errors="replace")
    assert "error" not in text.lower(), text
    assert text.index("broker stopped") < text.index("dagster stopped"), text
    assert text.index("dagster stopped") < text.index("etcd stopped"), text
    # Nothing of Dagster outlives the command (its UI port is free again).
    assert _code_locations(f"http://127.0.0.1:{dagster_port}") is None


def _dagster_log(tmp_path: Path) -> str:
    path = tmp_path / "data" / "dagster" / "dagster.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no dagster log)"
