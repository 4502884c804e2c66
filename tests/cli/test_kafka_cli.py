"""``danube-ingest kafka``: a real single-node KRaft Kafka from the project's jars, and its
refusals (exit 2, nothing written) when it cannot run."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.cli import main
from danube_ingest.testing import free_port
from tests.kafka.support import Acks, durable_producer, read_all


def _wait_line(process: subprocess.Popen[str], text: str, timeout: float) -> list[str]:
    """The process's stdout lines up to and including the first one containing ``text``."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break  # exited
        lines.append(line)
        if text in line:
            return lines
    process.kill()
    raise AssertionError(f"no {text!r} within {timeout}s:\n{''.join(lines)}")


@pytest.mark.slow
@pytest.mark.kafka
def test_kafka_serves_a_durable_record_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    port, controller_port = free_port(), free_port()
    data_dir = tmp_path / "kafka"
    command = [sys.executable, "-m", "danube_ingest.cli", "kafka", "--data-dir", str(data_dir)]
    command += ["--port", str(port), "--controller-port", str(controller_port), "--heap", "256m"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = _wait_line(process, "kafka serving on", timeout=120)
        assert f"kafka serving on 127.0.0.1:{port}" in lines[-1]
        assert any("kafka started" in line for line in lines)  # logged once it answered

        producer = durable_producer(f"127.0.0.1:{port}")
        acks = Acks()
        producer.produce("cli-check", b"one record", on_delivery=acks)
        assert producer.flush(30) == 0
        assert acks.errors == []
        assert acks.values == [b"one record"]
        assert read_all(f"127.0.0.1:{port}", "cli-check", 1) == [b"one record"]

        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert process.stdout is not None
        rest = process.stdout.read()
        assert "kafka stopped" in rest
        assert "did not stop on SIGTERM" not in rest  # a controlled shutdown, not a kill
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # The JVM is gone with it: both ports are free again.
    for free in (port, controller_port):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", free))
    assert (data_dir / "kafka-data" / "meta.properties").is_file()


@pytest.mark.slow
@pytest.mark.kafka
def test_sigterm_while_starting_stops_the_node_with_exit_0(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "danube_ingest.cli", "kafka", "--data-dir", str(tmp_path)]
    command += ["--port", str(free_port()), "--controller-port", str(free_port())]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        launched = _wait_line(process, "kafka launched", timeout=120)[-1]
        found = re.search(r"pid=(\d+)", launched)
        assert found is not None, launched
        pid = int(found.group(1))
        process.send_signal(signal.SIGTERM)  # before it answers: the probe gives up at once
        assert process.wait(60) == 0
        assert process.stdout is not None
        rest = process.stdout.read()
        assert "kafka serving on" not in rest and "kafka stopped" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the JVM went with it


def test_missing_jars_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jars = tmp_path / "no-jars"
    jars.mkdir()
    data_dir = tmp_path / "kafka"
    port = str(free_port())
    code = main(["kafka", "--data-dir", str(data_dir), "--port", port, "--jars-dir", str(jars)])
    assert code == 2
    error = capsys.readouterr().err
    assert f"no Kafka jars in {jars}" in error
    assert "run `make setup`" in error
    assert not data_dir.exists()  # nothing written


def test_missing_java_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    data_dir = tmp_path / "kafka"
    assert main(["kafka", "--data-dir", str(data_dir), "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert "no java found on PATH nor under $JAVA_HOME" in error
    assert "install Java 17" in error
    assert not data_dir.exists()


def test_a_port_in_use_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "kafka"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["kafka", "--data-dir", str(data_dir), "--port", str(port)])
    assert code == 2
    error = capsys.readouterr().err
    assert f"its client port 127.0.0.1:{port} is in use by another process" in error
    assert "choose another port (`--port`" in error
    assert not data_dir.exists()


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        (["--port", "29500", "--controller-port", "29500"], "ports are both 29500"),
        (["--port", "65535"], "its controller port 65536 is not a TCP port (1-65535)"),
    ],
)
def test_unusable_ports_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ports: list[str], message: str
) -> None:
    data_dir = tmp_path / "kafka"
    assert main(["kafka", "--data-dir", str(data_dir), *ports]) == 2
    error = capsys.readouterr().err
    assert message in error and "`--controller-port`" in error
    assert not data_dir.exists()


def test_a_port_that_is_no_port_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["kafka", "--data-dir", str(tmp_path / "kafka"), "--port", "70000"])
    assert exit_.value.code == 2
    assert "'70000' is not a TCP port (1-65535)" in capsys.readouterr().err
