"""A subscriber killed before acking: a consumer in a child process receives messages, acks
only the first ``ACKED``, and is SIGKILLed. A new consumer of the subscription must receive
every message the dead one did not ack, and none it acked (the daemon did not fail, so its
cursor must hold: the kill is not logged as a fault, which leaves no window for redelivering
acked messages)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.testing import History, assert_history_ok
from tests.broker.test_both_clients import create_topic

from .conftest import BrokerFactory
from .harness import KINDS, Kind, Load, Reader, acked_count, record

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/subkill"
MESSAGES = 300
ACKED = 100
#: Seconds between the child's last ack and the kill: a batch client's ack is queued on its
#: stream, not answered, so it must have had time to reach the daemon (loopback: ~ms).
ACK_SETTLE = 1.0


async def _until(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(120)
async def test_subscriber_killed_before_acking_loses_nothing(
    brokers: BrokerFactory, history: History, kind: Kind, tmp_path: Path
) -> None:
    broker = brokers()
    await asyncio.to_thread(broker.start)
    await create_topic(broker.url, TOPIC)
    child_log = tmp_path / "child.jsonl"
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.faults.subscriber_child",
            kind,
            broker.url,
            TOPIC,
            "s",
            str(child_log),
            str(ACKED),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == b"ready", line + child.stdout.read()
        load = Load(kind, broker.url, TOPIC, history, "p1")
        await load.start()
        await load.wait_acked(MESSAGES)
        await load.stop()

        def child_state() -> tuple[int, int]:
            events = History.load(child_log).events if child_log.exists() else []
            names = [type(e).__name__ for e in events]
            return names.count("Delivery"), names.count("Ack")

        total = acked_count(history, TOPIC)
        await _until(lambda: child_state() == (total, ACKED), "the child's deliveries")
        await asyncio.sleep(ACK_SETTLE)
        child.kill()
        child.wait(10)
        killed = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    history.extend(History.load(child_log).events)
    after = Reader(kind, broker.url, TOPIC, "s", history)
    await after.start()
    try:
        await after.wait_count(total - ACKED)
        recovered = time.monotonic() - killed
        await after.settle(quiet=1.0)
    finally:
        await after.close()
    assert min(after.offsets) == ACKED, "acknowledged messages were delivered again"
    report = assert_history_ok(history, subscriptions=[(TOPIC, "s")])
    record(
        "subscriber-killed-before-acking",
        kind,
        report,
        redelivered=len(after.offsets),
        recover_s_max=round(recovered, 2),
    )
