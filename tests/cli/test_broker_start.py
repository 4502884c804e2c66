"""``danube-ingest broker`` start-up as a user meets it: several brokers on one host with only
their own ``--listen``, ``--data-dir`` and ``--broker-id``, and a data directory started with
another metadata store than the one it was made with."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from danube_ingest.errors import MetadataStoreMismatchError
from danube_ingest.testing import broker_config, free_port, running_broker


def _start(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "danube_ingest.cli", "broker", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_serving(process: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "serving on" in text:
            return text
        if process.poll() is not None:
            raise AssertionError(f"broker exited with {process.returncode}:\n{text}")
        time.sleep(0.1)
    raise AssertionError(f"broker did not serve within {timeout}s:\n{log.read_text()}")


def _port_pair() -> int:
    """A free port whose metrics port (+3000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 3000 <= 65535 and _is_free(port + 3000):
            return port
    raise AssertionError("no free port pair found")


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_two_brokers_on_one_host_need_only_their_own_listen_data_dir_and_id(
    tmp_path: Path,
) -> None:
    ports = [_port_pair(), _port_pair()]
    while ports[1] in (ports[0], ports[0] + 3000) or ports[1] + 3000 == ports[0]:
        ports[1] = _port_pair()
    processes = []
    try:
        for i, port in enumerate(ports):
            log = tmp_path / f"b{i}.log"
            process = _start(
                "--listen",
                f"127.0.0.1:{port}",
                "--data-dir",
                str(tmp_path / f"data{i}"),
                "--broker-id",
                f"b{i}",
                "--etcd",
                "memory",
                log=log,
            )
            processes.append(process)
            text = _wait_serving(process, log)
            metrics = f"http://127.0.0.1:{port + 3000}"
            assert f"metrics on {metrics}" in text, text
        for port in ports:
            url = f"http://127.0.0.1:{port + 3000}/healthz"
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(url, timeout=5) as answer:
                assert answer.status == 200
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            assert process.wait(timeout=30) == 0


async def test_a_data_dir_refuses_another_metadata_store(etcd_server: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    prefix = f"/test-{uuid.uuid4().hex[:12]}"
    config = broker_config(data, etcd_server, prefix=prefix)
    async with running_broker(config):
        pass
    recorded = (data / "METADATA").read_text().strip()
    assert recorded.startswith("etcd cluster ") and recorded.endswith(f" prefix {prefix}")

    # The README's mistake: the same directory with metadata in memory.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "danube_ingest.cli",
            "broker",
            "--etcd",
            "memory",
            "--data-dir",
            str(data),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--metrics-listen",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert recorded in refused.stderr and "'memory'" in refused.stderr, refused.stderr
    assert "--data-dir" in refused.stderr, refused.stderr
    assert (data / "METADATA").read_text().strip() == recorded

    # Another prefix on the same etcd is another cluster too; the right one still starts.
    other = broker_config(data, etcd_server, prefix=prefix + "-other")
    with pytest.raises(MetadataStoreMismatchError, match="belongs to metadata store"):
        async with running_broker(other):
            pass
    async with running_broker(config) as broker:
        assert broker.url
