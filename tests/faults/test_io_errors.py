"""EIO and ENOSPC from the WAL's ``write`` and ``fdatasync`` under load, through the failio
LD_PRELOAD shim (tests/faults/failio.c): while a trigger file exists, the daemon's writes or
syncs of files under its WAL directory fail with the chosen errno, nothing else does.

Fail-stop is required: once a write or fdatasync failed the daemon acknowledges nothing more
(the region is failed, ``INTERNAL`` naming the error, even after the fault is gone: after a
failed fdatasync the page cache no longer says what is on disk, so the WAL never syncs again
and cuts the failed group off; docs in danube_ingest/wal/space.py). The fault is then turned
off, the daemon killed, every segment cut back to the length last fdatasync'ed (what a power
cut could leave: ``DANUBE_TEST_SYNC_LOG``; there must be nothing to cut, the failing writer
having cut its segment back already), and the daemon restarted: publishing goes on, and
the history checker finds nothing acknowledged lost, no duplicate beyond the unacknowledged
window, and contiguous offsets.

ENOSPC on ``write`` is tests/faults/test_disk_full.py (a tmpfs really filled).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from pathlib import Path

import pytest
from danube import DispatchStrategy, ProducerOptions

from danube_ingest.client import Producer, PublishError
from danube_ingest.testing import History, assert_history_ok, message_id
from danube_ingest.wal.synclog import ENV

from .conftest import BrokerFactory
from .failio import SYNC, WRITE, FailIO, build_failio
from .harness import (
    KINDS,
    Kind,
    _close_danube,
    _danube_client,
    cut_unsynced,
    read_after_restart,
    record,
    stalled,
    start_workload,
)

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/ioerrors"
#: How long the daemon must acknowledge nothing while the fault is on, and after it is off
#: before the restart (the region stays failed).
QUIET = 2.0

#: (scenario, errno, calls failed, the error's text in answers and logs)
FAULTS = [
    ("eio-on-write", errno.EIO, (WRITE,), "Input/output error"),
    ("eio-on-fdatasync", errno.EIO, (SYNC,), "Input/output error"),
    ("enospc-on-fdatasync", errno.ENOSPC, (SYNC,), "No space left on device"),
]


@pytest.fixture(scope="module")
def failio_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_failio(tmp_path_factory.mktemp("failio"))


async def _refusal(kind: Kind, url: str, history: History) -> str:
    """Publish one message through ``kind``'s client and return how it was refused."""
    history.write(TOPIC, "probe", 0, acked=False)  # never acknowledged, whatever happens
    if kind == "batch":
        producer = Producer(url, TOPIC, producer_name="probe", linger_ms=1)
        await producer.start()
        try:
            future = await producer.send(message_id("probe", 0))
            with pytest.raises(PublishError) as refused:
                await asyncio.wait_for(future, 30)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.close(), 10)
        return f"{refused.value.code.name} {refused.value.details}"
    client = await _danube_client(url)
    try:
        producer = (
            client.new_producer()
            .with_topic(TOPIC)
            .with_name("probe")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .with_options(ProducerOptions(max_retries=1, base_backoff_ms=10, max_backoff_ms=10))
            .build()
        )
        await producer.create()
        with pytest.raises(Exception) as refused:
            await asyncio.wait_for(producer.send(message_id("probe", 0), {}), 30)
        return repr(refused.value)
    finally:
        await _close_danube(client)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("scenario", "code", "ops", "message"), FAULTS, ids=[f[0] for f in FAULTS])
@pytest.mark.timeout(150)
async def test_an_io_error_on_the_wal_fails_stop_and_recovers_after_restart(
    brokers: BrokerFactory,
    history: History,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failio_library: Path,
    kind: Kind,
    scenario: str,
    code: int,
    ops: tuple[str, ...],
    message: str,
) -> None:
    broker = brokers()
    fault = FailIO(failio_library, broker.data_dir / "wal", tmp_path / "fault-on", code, ops)
    sync_log = tmp_path / "synced.log"
    for name, value in {**fault.env, ENV: str(sync_log)}.items():
        monkeypatch.setenv(name, value)  # inherited by the daemon (and its warm spare)
    started = time.monotonic()
    await asyncio.to_thread(broker.start)
    live, load = await start_workload(kind, broker.url, TOPIC, history)
    stopped = False
    try:
        await load.wait_acked(200)
        history.fault(scenario, "failio on")
        fault.on()
        acked_faulty = await stalled(load, QUIET, "the fault")
        refusal = await _refusal(kind, broker.url, history)
        assert message in refusal, f"the refusal does not name the error: {refusal}"
        if kind == "batch":
            assert refusal.startswith("INTERNAL"), refusal
        text = broker.log_text()
        assert "wal failed" in text, "the fault is on but no WAL write failed"
        assert message in text, "the daemon's log does not name the error"
        fault.off()
        await asyncio.sleep(QUIET)
        assert load.acked == acked_faulty, "the failed WAL acknowledged again without a restart"
        await live.close()
        history.fault("restart", "after the fault was turned off, segments cut to synced")
        broker.kill()
        bytes_cut = cut_unsynced(broker.data_dir / "wal", sync_log)
        # The failing writer cut its segment back to what it acknowledged (fsyncgate: a
        # restart must not find the failed group, whose pages may be clean but not on disk).
        assert bytes_cut == 0, f"{bytes_cut} bytes past the last fdatasync left in the WAL"
        restarted = time.monotonic()
        await asyncio.to_thread(broker.start)
        await load.wait_acked(acked_faulty + 200, timeout=60)
        recovered = time.monotonic() - restarted
        stopped = True
        await load.stop()
        await read_after_restart(kind, broker.url, TOPIC, history, live)
    finally:
        if not stopped:  # a failed test: end the load's task too
            with contextlib.suppress(Exception):
                await load.stop(timeout=5)
        await live.close()
    report = assert_history_ok(history, subscriptions=[(TOPIC, "live"), (TOPIC, "audit")])
    record(
        scenario,
        kind,
        report,
        cycles=1,
        acked_before_fault=acked_faulty,
        bytes_cut=bytes_cut,
        recover_s_max=round(recovered, 2),
        seconds=round(time.monotonic() - started, 1),
    )
