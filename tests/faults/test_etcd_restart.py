"""etcd killed (SIGKILL) and restarted under load, twice: once for less than the daemon's
lease, once for longer (the daemon loses its topics and takes them back). A producer publishes
and a consumer acks throughout; nothing acknowledged may be lost, nothing duplicated beyond
the window, offsets stay contiguous."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from danube_ingest.testing import BrokerProcess, History, LocalEtcd, assert_history_ok
from tests.broker.support import stop_all

from .harness import KINDS, Kind, read_all, record, start_workload, summary

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/etcdkill"
LEASE_TTL = 4
#: etcd down for: within the lease, then past it.
OUTAGES = (1.0, LEASE_TTL + 2.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(150)
async def test_etcd_killed_and_restarted_under_load(
    tmp_path: Path, history: History, kind: Kind
) -> None:
    async with LocalEtcd() as etcd:
        broker = BrokerProcess(
            tmp_path / "b1",
            etcd.endpoint,
            prefix=f"/f{uuid.uuid4().hex[:12]}",
            lease_ttl=LEASE_TTL,
        )
        try:
            await asyncio.to_thread(broker.start)
            live, load = await start_workload(kind, broker.url, TOPIC, history)
            recoveries: list[float] = []
            started = time.monotonic()
            try:
                for outage in OUTAGES:
                    await load.wait_acked(load.acked + 50)
                    history.fault("etcd-sigkill", f"{outage}s")
                    pid = etcd.server.pid
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    await asyncio.to_thread(etcd.server.stop)  # reaps it
                    await asyncio.sleep(outage)
                    await asyncio.to_thread(etcd.server.start)
                    await asyncio.to_thread(etcd.server.wait_healthy)
                    # The outage is a span: acks applied while etcd was away could not be
                    # persisted, and may come again once the daemon reloads its cursor.
                    history.fault("etcd-back", f"{outage}s")
                    back = time.monotonic()
                    await load.wait_acked(load.acked + 1, timeout=60)
                    recoveries.append(time.monotonic() - back)
                await load.stop()
                await read_all(kind, broker.url, TOPIC, history, [live])
            finally:
                await live.close()
        finally:
            await stop_all([broker])
    report = assert_history_ok(history, subscriptions=[(TOPIC, "live"), (TOPIC, "audit")])
    record(
        "etcd-killed-under-load",
        kind,
        report,
        cycles=len(OUTAGES),
        seconds=round(time.monotonic() - started, 1),
        **summary(recoveries),
    )
