"""SIGKILL during appends, many times over, through both clients: the daemon (a child process)
is killed at a random moment while a producer publishes and a consumer receives and acks, and
restarted on the same data dir. The history checker then requires: no acknowledged message
lost (on the live subscription and on one read only at the end), no duplicate beyond the
unacknowledged window, contiguous offsets."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from danube_ingest.testing import History, assert_history_ok

from .conftest import BrokerFactory
from .harness import (
    KILLED_KINDS,
    Kind,
    kill_cycles,
    read_all,
    record,
    start_workload,
    summary,
)

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/sigkill"
#: Kill/restart cycles per client kind (``DANUBE_FAULT_CYCLES`` to change): 25 + 25 = 50 in
#: all; a restart takes ~2.5 s on a busy 2-core machine, so 50 per kind would take ~5 min.
CYCLES = int(os.environ.get("DANUBE_FAULT_CYCLES", "25"))


@pytest.mark.parametrize("kind", KILLED_KINDS)
@pytest.mark.timeout(240)
async def test_sigkill_during_appends(brokers: BrokerFactory, history: History, kind: Kind) -> None:
    broker = brokers()
    await asyncio.to_thread(broker.start)
    live, load = await start_workload(kind, broker.url, TOPIC, history)
    started = time.monotonic()
    try:
        recoveries = await kill_cycles(broker, load, history, CYCLES)
        await load.stop()
        await read_all(kind, broker.url, TOPIC, history, [live])
    finally:
        await live.close()
    report = assert_history_ok(history, subscriptions=[(TOPIC, "live"), (TOPIC, "audit")])
    record(
        "sigkill-during-appends",
        kind,
        report,
        cycles=CYCLES,
        seconds=round(time.monotonic() - started, 1),
        **summary(recoveries),
    )
