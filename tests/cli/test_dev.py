"""``danube-ingest dev``: the one-command local system (etcd, broker, Dagster UI with the code
location loaded), stopped the way a terminal stops it."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from danube_ingest.testing import free_port
from tests.cli.cli_support import graphql

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]


_LOCATIONS = """{ workspaceOrError { ... on Workspace { locationEntries {
  name loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


#: What the location shows: sensors, assets with their partitions and checks, and the
#: resources' configured values (the environment ``dev`` passed to the location).
_REPOSITORY = """{ repositoriesOrError { ... on RepositoryConnection { nodes {
  sensors { name sensorState { status } }
  schedules { name scheduleState { status } }
  assetNodes { assetKey { path } partitionDefinition { dimensionTypes { name type } }
    assetChecksOrError { ... on AssetChecks { checks { name } } } }
  allTopLevelResourceDetails { name configuredValues { key value } } } } } }"""


def _code_locations(url: str) -> list[dict[str, object]] | None:
    """The UI's code locations (GraphQL), ``None`` while the UI is not up yet."""
    data = graphql(url, _LOCATIONS)
    if data is None:
        return None
    entries: list[dict[str, object]] = data["workspaceOrError"]["locationEntries"]
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
                *("--metrics-listen", "127.0.0.1:0"),
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
        # The Parquet asset with its table partitions (dynamic) and its checks, and the sensor;
        # the location got the data directory to find the object store in.
        data = graphql(f"http://127.0.0.1:{dagster_port}", _REPOSITORY)
        assert data is not None
        (repository,) = data["repositoriesOrError"]["nodes"]
        assert {"name": "parquet_topics_sensor", "sensorState": {"status": "RUNNING"}} in (
            repository["sensors"]
        ), repository["sensors"]
        # The object lifecycle (issue 13): rotation's sensor, the schedules of collection,
        # integrity, retention and etcd compaction, all on by default.
        assert {"name": "rotation_sensor", "sensorState": {"status": "RUNNING"}} in (
            repository["sensors"]
        ), repository["sensors"]
        # Fresh Iceberg tables: the tails' sensor, on by default.
        assert {"name": "iceberg_tail_sensor", "sensorState": {"status": "RUNNING"}} in (
            repository["sensors"]
        ), repository["sensors"]
        schedules = {s["name"]: s["scheduleState"]["status"] for s in repository["schedules"]}
        jobs = ("object_gc", "manifest_integrity", "object_retention", "etcd_compaction")
        for job in (*jobs, "iceberg_maintenance", "parquet_collect"):
            assert schedules.get(f"{job}_schedule") == "RUNNING", schedules
        assets = {tuple(a["assetKey"]["path"]): a for a in repository["assetNodes"]}
        manifest = assets[("object_manifest",)]
        assert {c["name"] for c in manifest["assetChecksOrError"]["checks"]} == {
            "objects_intact",
            "ranges_contiguous",
        }, manifest
        parquet = assets[("parquet_partitions",)]
        assert parquet["partitionDefinition"]["dimensionTypes"] == [
            {"name": "default", "type": "DYNAMIC"},
        ], parquet
        assert {c["name"] for c in parquet["assetChecksOrError"]["checks"]} == {
            "rows_match_offsets",
            "frontier_contiguous",
            "files_intact",
            "iceberg_matches",
            "iceberg_fresh",
            "partitions_fresh",
            "converted",
        }, parquet
        assert ("iceberg_tables",) in assets, sorted(assets)
        resources = {
            r["name"]: {v["key"]: json.loads(v["value"]) for v in r["configuredValues"]}
            for r in repository["allTopLevelResourceDetails"]
        }
        data_dir = str((tmp_path / "data").resolve())
        assert resources["objects"]["data_dir"] == data_dir, resources
        assert resources["objects"]["config_path"] == f"{data_dir}/dagster/broker.yaml"
        assert resources["etcd"]["endpoints"] == f"http://127.0.0.1:{etcd_port}", resources
        instance = yaml.safe_load((tmp_path / "data" / "dagster" / "dagster.yaml").read_text())
        assert instance == {"telemetry": {"enabled": False}, "nux": {"enabled": False}}, instance
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


def _dev(
    tmp_path: Path, name: str, data_dir: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """``danube-ingest dev`` in a process group of its own, output to ``{name}.log``."""
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "danube_ingest.cli", "dev", "--data-dir", str(data_dir)),
                *("--metrics-listen", "127.0.0.1:0", *extra),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log_path


def _interrupt(process: subprocess.Popen[bytes]) -> int:
    """Ctrl-C, as a terminal sends it; killed if it does not stop within 60 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            return process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def test_dev_twice_the_second_fails_at_once_naming_the_first(tmp_path: Path) -> None:
    """Issue 11 item 2: the second `dev` used to start, print "etcd started" for an etcd that
    could not bind, and break the first one's WAL. Also: the banner's hints work as printed
    (here with a --listen that is not the default, so they need --service-url)."""
    data_dir = tmp_path / "data"
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--etcd-port", str(free_port())]
    first, first_log = _dev(tmp_path, "first", data_dir, *ports, "--no-dagster")
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in first_log.read_text(errors="replace"):
            assert first.poll() is None, first_log.read_text(errors="replace")
            assert time.monotonic() < deadline, first_log.read_text(errors="replace")
            time.sleep(0.1)
        time.sleep(0.2)  # the banner follows the serving line

        started = time.monotonic()
        second, second_log = _dev(tmp_path, "second", data_dir, *ports, "--no-dagster")
        assert second.wait(30) == 2
        assert time.monotonic() - started < 15  # Python start-up: it waits for nothing
        text = second_log.read_text(errors="replace")
        assert f"in use by pid {first.pid} on" in text, text
        assert "Traceback" not in text and "started" not in text, text

        # The first keeps serving: the banner's produce hint, run exactly as printed.
        banner = first_log.read_text(errors="replace")
        hint = next(line for line in banner.splitlines() if line.strip().startswith("try:"))
        command = shlex.split(hint.split("try:", 1)[1])
        assert "--service-url" in command, hint
        executable = shutil.which(command[0]) or command[0]
        produced = subprocess.run(
            [executable, *command[1:]], capture_output=True, text=True, timeout=60
        )
        assert produced.returncode == 0, (hint, produced.stdout, produced.stderr)
    finally:
        code = _interrupt(first)
    text = first_log.read_text(errors="replace")
    assert code == 0, text
    assert "error" not in text.lower(), text


@pytest.mark.parametrize("taken", ["etcd", "dagster"])
def test_a_port_in_use_is_reported_not_started(tmp_path: Path, taken: str) -> None:
    """Another process on etcd's or Dagster's port: `dev` says so and exits 2, and never
    claims that the server started."""
    etcd_port, dagster_port = free_port(), free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", etcd_port if taken == "etcd" else dagster_port))
        holder.listen()
        process, log_path = _dev(
            tmp_path,
            "dev",
            tmp_path / "data",
            *("--listen", f"127.0.0.1:{free_port()}", "--etcd-port", str(etcd_port)),
            *("--dagster-port", str(dagster_port)),
        )
        try:
            assert process.wait(60) == 2
        finally:
            _interrupt(process)
    text = log_path.read_text(errors="replace")
    port = etcd_port if taken == "etcd" else dagster_port
    assert f"127.0.0.1:{port} is in use by another process" in text, text
    assert f"{taken} started" not in text and "serving on" not in text, text
    assert "Traceback" not in text, text
    if taken == "dagster":
        assert "etcd stopped" in text, text  # what was started is stopped again


def test_make_dev_passes_args_through() -> None:
    root = Path(__file__).resolve().parents[2]
    dry_run = subprocess.run(
        [
            *("make", "-n", "--no-print-directory", "-C", str(root)),
            *("dev", "ARGS=--dagster-port 3001 --no-dagster"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dry_run.returncode == 0, dry_run.stderr
    last = dry_run.stdout.strip().splitlines()[-1]
    assert last.endswith("danube-ingest dev --dagster-port 3001 --no-dagster"), dry_run.stdout


@pytest.mark.kafka
def test_dev_with_the_kafka_wal_runs_kafka_and_stops_it(tmp_path: Path) -> None:
    """``make dev ARGS="--wal kafka"``: a local Kafka under DATA_DIR/kafka holds the WAL; the
    README's produce and consume commands work against it; Ctrl-C stops the broker, then
    Kafka and etcd."""
    broker_port, etcd_port, kafka_port = free_port(), free_port(), free_port()
    process, log_path = _dev(
        tmp_path,
        "dev-kafka",
        tmp_path / "data",
        *("--listen", f"127.0.0.1:{broker_port}", "--etcd-port", str(etcd_port)),
        *("--wal", "kafka", "--kafka-port", str(kafka_port), "--no-dagster"),
    )
    try:
        deadline = time.monotonic() + 150
        while "serving on" not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        cli = [sys.executable, "-m", "danube_ingest.cli"]
        url = ("--service-url", f"http://127.0.0.1:{broker_port}")
        produced = subprocess.run(
            [*cli, "produce", *url, "--topic", "/default/demo", "--count", "10"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert produced.returncode == 0, produced.stderr
        consumed = subprocess.run(
            [
                *cli,
                "consume",
                *url,
                "--topic",
                "/default/demo",
                *("--subscription", "demo"),
                "--count",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert consumed.returncode == 0, consumed.stderr
        assert "received 10/10" in consumed.stdout + consumed.stderr
        text = log_path.read_text(errors="replace")
        assert f"kafka on 127.0.0.1:{kafka_port} (the WAL)" in text
        assert "kafka wal topic created topic=danube-wal.broker-1.r0 " in text
    finally:
        assert _interrupt(process) == 0, log_path.read_text(errors="replace")[-3000:]
    text = log_path.read_text(errors="replace")
    assert text.index("broker stopped") < text.index("kafka stopped") < text.index("etcd stopped")
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", kafka_port)) != 0, "kafka still listens"


def test_the_readmes_kafka_command_is_dev_with_the_kafka_wal() -> None:
    """The README's ``make dev ARGS="--wal kafka"`` runs what the test above runs."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    line = 'make dev ARGS="--wal kafka"'
    assert f"```bash\n  {line}\n  ```" in readme
    dry_run = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(root), *shlex.split(line)[1:]],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dry_run.returncode == 0, dry_run.stderr
    assert dry_run.stdout.strip().splitlines()[-1].endswith("danube-ingest dev --wal kafka")
