"""``danube_ingest.testing.BrokerProcess(warm=True)``: each start after the first runs in the
spare interpreter spawned after the previous start (a fresh process that only imported the
code beforehand), a changed environment is never handed to a stale spare, and ``stop`` ends
the spare. (The history checker has its own tests: test_testing_history.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from danube_ingest.testing import BrokerProcess


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
