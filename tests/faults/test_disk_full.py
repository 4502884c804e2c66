"""ENOSPC on a WAL write under load: the daemon's data dir is on a small tmpfs (a disk that
really fills up) with no free-space floor (``retention.min_free_bytes: 0``, so the write itself
fails instead of the floor refusing publishes first: the case of another process taking the
space faster than the daemon's checks), and a ballast file takes the rest of the disk while a
producer publishes and a consumer acks.

Fail-stop is required: once the write failed the daemon acknowledges nothing more (the WAL
region is failed, ``INTERNAL``, even after space is freed: docs in danube_ingest/wal/space.py),
and after the ballast is deleted and the daemon restarted on the same disk, publishing goes on
and the history checker finds nothing acknowledged lost, no duplicate beyond the
unacknowledged window, and contiguous offsets.

EIO on a write, and EIO or ENOSPC from ``fdatasync`` (which tmpfs never fails): an
LD_PRELOAD shim, tests/faults/test_io_errors.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from danube_ingest.testing import (
    BrokerProcess,
    History,
    assert_history_ok,
    fill_filesystem,
    small_filesystem,
)
from tests.broker.support import stop_all

from .harness import KINDS, Kind, read_after_restart, record, stalled, start_workload

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

MiB = 1 << 20
TOPIC = "/default/diskfull"
#: How long the daemon must acknowledge nothing while the disk is full, and after the space
#: is freed before the restart (the region stays failed).
QUIET = 2.0


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "disk", 24 * MiB) as path:
        yield path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(150)
async def test_enospc_on_write_fails_stop_and_recovers_after_restart(
    disk: Path, etcd_server: str, etcd_prefix: str, history: History, kind: Kind
) -> None:
    broker = BrokerProcess(
        disk / "broker-1",
        etcd_server,
        prefix=etcd_prefix,
        lease_ttl=4,
        warm=True,
        storage={"wal": {"segment_bytes": "1MiB", "retention": {"min_free_bytes": 0}}},
    )
    started = time.monotonic()
    try:
        await asyncio.to_thread(broker.start)
        live, load = await start_workload(kind, broker.url, TOPIC, history)
        await load.wait_acked(200)
        ballast = disk / "ballast"
        history.fault("enospc", "ballast fills the disk")
        fill_filesystem(ballast, leave=0)
        acked_full = await stalled(load, QUIET, "a full disk")
        assert "wal failed" in broker.log_text(), "the disk filled but no WAL write failed"
        assert "No space left on device" in broker.log_text()
        ballast.unlink()
        await asyncio.sleep(QUIET)
        assert load.acked == acked_full, "the failed WAL acknowledged again without a restart"
        await live.close()
        history.fault("restart", "after the disk was freed")
        broker.kill()
        restarted = time.monotonic()
        await asyncio.to_thread(broker.start)
        await load.wait_acked(acked_full + 200, timeout=60)
        recovered = time.monotonic() - restarted
        await load.stop()
        await read_after_restart(kind, broker.url, TOPIC, history, live)
    finally:
        await stop_all([broker])
    report = assert_history_ok(history, subscriptions=[(TOPIC, "live"), (TOPIC, "audit")])
    record(
        "enospc-on-write",
        kind,
        report,
        cycles=1,
        acked_before_full=acked_full,
        recover_s_max=round(recovered, 2),
        seconds=round(time.monotonic() - started, 1),
    )
