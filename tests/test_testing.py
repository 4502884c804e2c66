"""``danube_ingest.testing.BrokerProcess(warm=True)``: each start after the first runs in the
spare interpreter spawned after the previous start (a fresh process that only imported the
code beforehand), a changed environment is never handed to a stale spare, and ``stop`` ends
the spare; a ``LocalPostgres`` stops its server at once. (The history checker has its own
tests: test_testing_history.py.)"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from danube_ingest.testing import BrokerProcess, LocalPostgres


def test_a_warm_broker_restarts_in_its_spare_and_stop_ends_the_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = BrokerProcess(tmp_path, "memory", warm=True)
    spares: list[subprocess.Popen[bytes]] = []
    try:
        broker.start()
        first = broker.process
        assert first is not None and broker._spare is not None
        spares.append(broker._spare)
        broker.kill()

        broker.start()  # a crash restart: the spare serves, on the same data dir
        assert broker.process is spares[0] and broker.process is not first
        assert broker.process.poll() is None
        assert broker._spare is not None and broker._spare is not spares[0]
        spares.append(broker._spare)
        broker.kill()

        # The environment changed since the spare was spawned (as a test setting LD_PRELOAD
        # does): the spare is ended, and the daemon starts cold with the new environment.
        monkeypatch.setenv("DANUBE_TEST_WARM_CHANGED", "1")
        broker.start()
        assert broker.process not in spares
        assert spares[1].poll() is not None
        assert broker._spare is not None
        spares.append(broker._spare)
    finally:
        broker.stop()
    assert all(spare.poll() is not None for spare in spares)
    assert broker.log_text().count("data directory locked dir=") >= 3


@pytest.mark.postgres
def test_a_local_postgres_stops_its_server_at_once() -> None:
    """``stop`` ends the postmaster itself, within seconds: as root the server runs under
    ``runuser``, which neither passes SIGINT on nor takes its child along when killed."""
    server = LocalPostgres()
    server.start()
    assert server._temp_dir is not None
    pid = int((server._temp_dir / "data" / "postmaster.pid").read_text().split()[0])
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
