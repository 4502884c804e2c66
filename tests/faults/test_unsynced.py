"""Loss of unsynced data and torn tails: after each SIGKILL every WAL segment is cut back to
somewhere between the length the daemon last fdatasync'ed (recorded by the WAL's
``DANUBE_TEST_SYNC_LOG`` hook) and its length: what a power cut could leave (unsynced page
cache gone, or partly written, tearing a frame). Nothing acknowledged may be lost (an
acknowledgement must never precede the sync of what it acknowledges) and recovery must cut a
torn frame rather than fail or serve it."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest

from danube_ingest.testing import History, assert_history_ok
from danube_ingest.wal.synclog import ENV

from .conftest import BrokerFactory
from .harness import (
    KILLED_KINDS,
    Kind,
    cut_unsynced,
    kill_cycles,
    read_all,
    record,
    start_workload,
    summary,
)

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/unsynced"
CYCLES = int(os.environ.get("DANUBE_FAULT_UNSYNCED_CYCLES", "8"))


@pytest.mark.parametrize("kind", KILLED_KINDS)
@pytest.mark.timeout(180)
async def test_unsynced_bytes_lost_after_a_kill_lose_nothing_acknowledged(
    brokers: BrokerFactory,
    history: History,
    kind: Kind,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sync_log = tmp_path / "synced.log"
    monkeypatch.setenv(ENV, str(sync_log))  # inherited by the broker process
    broker = brokers()
    await asyncio.to_thread(broker.start)
    live, load = await start_workload(kind, broker.url, TOPIC, history)
    started = time.monotonic()
    cut: list[int] = []
    rng = random.Random(7)
    try:
        recoveries = await kill_cycles(
            broker,
            load,
            history,
            CYCLES,
            what="sigkill+cut-unsynced",
            while_down=lambda: cut.append(cut_unsynced(broker.data_dir / "wal", sync_log, rng)),
        )
        await load.stop()
        await read_all(kind, broker.url, TOPIC, history, [live])
    finally:
        await live.close()
    report = assert_history_ok(history, subscriptions=[(TOPIC, "live"), (TOPIC, "audit")])
    assert sync_log.stat().st_size > 0, "the WAL recorded no sync: the hook is not working"
    record(
        "unsynced-data-lost",
        kind,
        report,
        cycles=CYCLES,
        bytes_cut=sum(cut),
        seconds=round(time.monotonic() - started, 1),
        **summary(recoveries),
    )
