"""Wall-clock jumps forward and back under load: the daemon runs under libfaketime (only its
CLOCK_REALTIME is faked; monotonic time is real, as on a machine whose NTP steps the clock) in
``wal_cloud`` mode on an fs object store, with age-based WAL retention. Its wall clock jumps
3 days forward, then back to real time, while a producer publishes and a consumer acks.

Nothing acknowledged may be lost (nothing deleted early), no message may be redelivered (no
expiry storm: an ack-timeout or lease decision on wall time would redeliver), and the
manifest of uploaded objects must stay gap-free. The jumps are not logged as faults: the
daemon never fails, so no redelivery window opens.

Found here (fixed): an ``audit`` consumer that subscribed and never read held entries until
they timed out; taken over just then, its successor got the later entries it held before the
timed-out ones (``tests/dispatch/test_subscription_types.py``, the successor test)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from danube_ingest.testing import History, assert_history_ok, manifest_spans
from danube_ingest.testing_history import Delivery

from .conftest import BrokerFactory
from .harness import LIBFAKETIME, Kind, manifest_ranges, read_all, record, start_workload

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/clockjump"
#: Steps of the daemon's wall clock relative to real time (libfaketime offsets).
STEPS = ("+3d", "+0")


@pytest.mark.parametrize("kind", ["danube", "batch"])
@pytest.mark.timeout(120)
async def test_wall_clock_jumps_lose_and_redeliver_nothing(
    brokers: BrokerFactory,
    history: History,
    kind: Kind,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    etcd_server: str,
    etcd_prefix: str,
) -> None:
    assert LIBFAKETIME.exists(), f"{LIBFAKETIME} is missing: apt-get install libfaketime"
    clock = tmp_path / "faketime"
    clock.write_text("+0\n")
    # Inherited by the broker process only (the test starts no other child).
    monkeypatch.setenv("LD_PRELOAD", str(LIBFAKETIME))
    monkeypatch.setenv("FAKETIME_TIMESTAMP_FILE", str(clock))
    monkeypatch.setenv("FAKETIME_NO_CACHE", "1")
    monkeypatch.setenv("DONT_FAKE_MONOTONIC", "1")
    broker = brokers(
        storage={
            "mode": "wal_cloud",
            "cloud": {"backend": "fs", "root": str(tmp_path / "objects")},
            "wal": {
                "segment_seconds": 1,
                "retention": {"check_seconds": 0.2, "max_minutes": 60},
            },
        }
    )
    await asyncio.to_thread(broker.start)
    monkeypatch.delenv("LD_PRELOAD")
    live, load = await start_workload(kind, broker.url, TOPIC, history)
    started = time.monotonic()
    try:
        for step in STEPS:
            await load.wait_acked(load.acked + 100)
            await asyncio.sleep(2.5)  # segments seal and upload on the old clock
            clock.write_text(step + "\n")
            await asyncio.sleep(2.5)  # retention, clock and ack-timeout passes on the new one
        await load.wait_acked(load.acked + 100)
        await load.stop()
        await asyncio.sleep(2.5)  # the last segment sealed and uploaded
        await read_all(kind, broker.url, TOPIC, history, [live])
    finally:
        await live.close()
    ranges = await manifest_ranges(etcd_server, etcd_prefix, TOPIC)
    report = assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
    )
    live_deliveries = [
        e for e in history.events if isinstance(e, Delivery) and e.subscription == "live"
    ]
    redelivered = len(live_deliveries) - len({e.offset for e in live_deliveries})
    assert redelivered == 0, f"{redelivered} messages redelivered after the clock jumps"
    assert ranges, "nothing was uploaded: the manifest check saw nothing"
    # The jump took effect: entries ingested meanwhile carry the daemon's wall time, 3 days on.
    ahead_ms = max(r.last_ingest_ms for r in ranges) - time.time() * 1000
    assert ahead_ms > 2 * 86_400_000, f"the daemon's clock never jumped (ahead {ahead_ms} ms)"
    record(
        "wall-clock-jumps",
        kind,
        report,
        cycles=len(STEPS),
        manifest_ranges=len(ranges),
        seconds=round(time.monotonic() - started, 1),
    )
