"""Crash during recovery, 10 times in a row: a daemon with a WAL of many segments is SIGKILLed
at a random moment while it starts (recovering the WAL, taking its topics back), ten times;
the eleventh start must serve every acknowledged message, once, with contiguous offsets."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from danube_ingest.testing import History, assert_history_ok
from tests.broker.test_both_clients import create_topic

from .conftest import BrokerFactory
from .harness import KINDS, Kind, Load, Reader, record

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/recovery"
CRASHES = 10
#: Messages written before the crashes: several 1 MiB segments to recover (batch), fewer
#: through danube-client (one round trip each).
MESSAGES = {"danube": 1500, "batch": 60_000}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(180)
async def test_crash_during_recovery_ten_times(
    brokers: BrokerFactory, history: History, kind: Kind
) -> None:
    broker = brokers()
    await asyncio.to_thread(broker.start)
    await create_topic(broker.url, TOPIC)
    audit = Reader(kind, broker.url, TOPIC, "audit", history, name="audit")
    await audit.start()
    await audit.close()
    load = Load(kind, broker.url, TOPIC, history, "p1")
    await load.start()
    await load.wait_acked(MESSAGES[kind])
    await load.stop()

    rng = random.Random(10)
    before_serving = 0
    history.fault("sigkill", "before the crashes")
    broker.kill()
    # How long a start takes here and now (it varies with the machine's load): the kills
    # land at random moments within it.
    timed = time.monotonic()
    await asyncio.to_thread(broker.start)
    start_seconds = time.monotonic() - timed
    for crash in range(CRASHES):
        history.fault("sigkill-in-recovery", f"crash {crash}")
        broker.kill()
        starting = asyncio.create_task(asyncio.to_thread(broker.start))
        await asyncio.sleep(rng.uniform(0.1, 0.9) * start_seconds)
        broker.kill()
        try:
            await starting
        except RuntimeError:  # killed before it served: a crash during recovery
            before_serving += 1
    started = time.monotonic()
    await asyncio.to_thread(broker.start)
    audit = Reader(kind, broker.url, TOPIC, "audit", history, name="audit")
    await audit.start()
    try:
        await audit.wait_count(MESSAGES[kind], timeout=90)
        recovered = time.monotonic() - started
        await audit.settle(quiet=0.5)
    finally:
        await audit.close()
    report = assert_history_ok(history, subscriptions=[(TOPIC, "audit")])
    assert before_serving >= CRASHES // 2, f"only {before_serving} kills landed during start-up"
    record(
        "crash-during-recovery",
        kind,
        report,
        cycles=CRASHES,
        killed_before_serving=before_serving,
        recover_s_max=round(recovered, 2),
    )
