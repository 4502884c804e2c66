"""The daemon's process behaviour: stop signals, a stuck shutdown, stacks on demand."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from danube_ingest.runtime import EXIT_FORCED
from danube_ingest.testing import BrokerProcess

#: A daemon whose shutdown never ends (the hang the stack dump and a second signal are for).
_STUCK = textwrap.dedent(
    """
    import asyncio, logging, pathlib, sys
    from danube_ingest import runtime

    logging.basicConfig(level=logging.INFO)
    runtime.SHUTDOWN_STACKS_SECONDS = 0.5

    async def stuck_shutdown():
        await asyncio.sleep(3600)

    async def main():
        stop = asyncio.Event()
        runtime.stop_on_signals(stop, on_force=lambda: pathlib.Path(sys.argv[1]).write_text("x"))
        print("ready", flush=True)
        await stop.wait()
        print("stopping", flush=True)
        await stuck_shutdown()

    runtime.run_daemon(main())
    """
)


def _wait_for(path: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        output = path.read_text(errors="replace")
        if text in output:
            return output
        assert process.poll() is None, output
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not written within {timeout}s:\n{path.read_text()}")


def test_a_stuck_shutdown_writes_its_stacks_and_a_second_signal_exits_at_once(
    tmp_path: Path,
) -> None:
    output, forced = tmp_path / "output", tmp_path / "forced"
    with output.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", _STUCK, str(forced)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_for(output, "ready", process, 30)
        process.send_signal(signal.SIGTERM)
        _wait_for(output, "SIGTERM received: shutting down", process, 10)
        # Past the deadline the stacks show where the shutdown is stuck; it keeps waiting.
        text = _wait_for(output, "in stuck_shutdown", process, 10)
        assert process.poll() is None
        assert not forced.exists()
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == EXIT_FORCED
    finally:
        process.kill()
        process.wait()
    text = output.read_text()
    assert "SIGINT received again: exiting now" in text, text
    assert forced.read_text() == "x"  # on_force ran (dev stops etcd and Dagster there)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_broker_writes_its_stacks_on_sigusr1_and_stops_cleanly_on_a_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    broker = BrokerProcess(tmp_path, "memory")
    broker.start()
    try:
        assert broker.process is not None
        broker.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "Current thread" not in broker.log_text():
            assert time.monotonic() < deadline, broker.log_text()
            time.sleep(0.05)
        assert broker.process.poll() is None  # a diagnostic, not a stop
        broker.kill(sig)
        assert broker.process.returncode == 0, broker.log_text()
    finally:
        broker.kill()
    log = broker.log_text()
    assert f"{sig.name} received: shutting down" in log
    assert "broker stopped" in log
