"""The daemon crashes in the middle of an upload, under load, and is restarted: the history
checker then requires nothing acknowledged lost, no duplicate beyond the unacknowledged
window, contiguous offsets, and a gap-free, overlap-free manifest.

* ``after_put``: the segment object is stored, its ranges are not committed. etcd is paused
  (SIGSTOP) so that the manifest commit cannot happen; the kill comes once an object the
  manifest did not reference before the pause is in the fs store (its size unchanged for a
  moment: the PUT is done), then etcd resumes. The
  restarted daemon must find the stored object (``segment object already stored``) and commit
  it once.
* ``after_commit``: the kill comes as soon as the manifest holds a new range (polled every
  20 ms), before the segment's uploaded mark is persisted and the segment cleaned (the
  ``audit`` subscription holds every segment until the end, so none is cleaned before). The
  restarted daemon uploads again what it did not know was committed, and must not commit it
  twice.

A private etcd (as tests/faults/test_etcd_restart.py): pausing it stops nothing else."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.testing import (
    BrokerProcess,
    History,
    LocalEtcd,
    assert_history_ok,
    manifest_spans,
)
from tests.broker.support import stop_all

from .harness import FEW_KILLS_KINDS, Kind, read_all, record, start_workload, summary

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/uploadcrash"
PREFIX = "/uploadcrash"
#: Crashes per mode: each one a different segment.
CRASHES = 3


def _objects(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in root.rglob("*.bin") if p.is_file()}


async def _ranges(kv: EtcdKV) -> list[ObjectRange]:
    return list(await Manifest(kv, Keys(PREFIX)).ranges(TOPIC))


async def _unreferenced_object(root: Path, referenced: set[str], timeout: float = 20.0) -> Path:
    """A ``.bin`` object whose key is not in ``referenced`` and whose size stayed the same for
    0.3 s (its PUT is done)."""
    deadline = time.monotonic() + timeout
    sizes: dict[Path, int] = {}
    while time.monotonic() < deadline:
        now = {
            p: s
            for p, s in _objects(root).items()
            if s > 0 and p.relative_to(root).as_posix() not in referenced
        }
        for path, size in now.items():
            if sizes.get(path) == size:
                return path
        sizes = now
        await asyncio.sleep(0.3)
    raise AssertionError(f"no object outside the manifest stored under {root} in {timeout}s")


async def _crash_after_put(
    etcd: LocalEtcd, broker: BrokerProcess, root: Path, history: History, kv: EtcdKV
) -> bool:
    """Kill the daemon, etcd paused, once an object the manifest did not reference before the
    pause is stored; whether that object's ranges were still uncommitted once etcd resumed (a
    commit sent just before the pause may still be applied: then this crash did not land
    between PUT and commit)."""
    pid = etcd.server.pid
    assert pid is not None
    # Paused right after a commit: the uploader is then between segments, not waiting on etcd
    # in the middle of a commit (which would keep it from storing the next object). The next
    # object may be stored already: the uploader PUTs a few segments ahead of its commits, and
    # then waits on the paused etcd without storing another one.
    await _committed(kv)
    referenced = {r.object_key for r in await _ranges(kv)}
    os.kill(pid, signal.SIGSTOP)
    try:
        stored = await _unreferenced_object(root, referenced)
        # Logged at the kill: what was delivered and acked during the pause (the ack not
        # persisted: etcd is paused) may come again.
        history.fault("sigkill", "between put and commit")
        broker.kill()
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(0.2)  # a request the dead daemon had sent is applied by now
    key = stored.relative_to(root).as_posix()
    return key not in {r.object_key for r in await _ranges(kv)}


async def _committed(kv: EtcdKV, timeout: float = 20.0) -> None:
    """Wait until the manifest holds a range more than now (polled every 20 ms)."""
    committed = len(await _ranges(kv))
    deadline = time.monotonic() + timeout
    while len(await _ranges(kv)) == committed:
        assert time.monotonic() < deadline, f"no range committed in {timeout}s"
        await asyncio.sleep(0.02)


async def _crash_after_commit(broker: BrokerProcess, history: History, kv: EtcdKV) -> None:
    await _committed(kv)
    history.fault("sigkill", "between commit and cleaning")
    broker.kill()


@pytest.mark.parametrize("mode", ["after_put", "after_commit"])
@pytest.mark.parametrize("kind", FEW_KILLS_KINDS)
@pytest.mark.timeout(180)
async def test_crash_during_upload_loses_nothing(
    tmp_path: Path, history: History, kind: Kind, mode: str
) -> None:
    root = tmp_path / "objects"
    root.mkdir()
    async with LocalEtcd() as etcd:
        kv = await EtcdKV.connect([etcd.endpoint], timeout=5.0)
        broker = BrokerProcess(
            tmp_path / "b1",
            etcd.endpoint,
            prefix=PREFIX,
            lease_ttl=4,
            warm=True,
            storage={
                "mode": "wal_cloud",
                "cloud": {"backend": "fs", "root": str(root)},
                "wal": {"segment_seconds": 1},
            },
        )
        started = time.monotonic()
        recoveries: list[float] = []
        uncommitted = 0
        try:
            await asyncio.to_thread(broker.start)
            live, load = await start_workload(kind, broker.url, TOPIC, history)
            try:
                for _ in range(CRASHES):
                    await load.wait_acked(load.acked + 100)
                    if mode == "after_put":
                        uncommitted += await _crash_after_put(etcd, broker, root, history, kv)
                    else:
                        await _crash_after_commit(broker, history, kv)
                    killed = time.monotonic()
                    await asyncio.to_thread(broker.start)
                    await load.wait_acked(load.acked + 1, timeout=60)
                    recoveries.append(time.monotonic() - killed)
                await load.wait_acked(load.acked + 100)
                await load.stop()
                await read_all(kind, broker.url, TOPIC, history, [live])
            finally:
                await live.close()
        finally:
            await stop_all([broker])
        ranges = await _ranges(kv)
        await kv.close()
    report = assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
    )
    log = broker.log_text()
    found_stored = log.count("segment object already stored")
    if mode == "after_put":
        assert uncommitted > 0, "no crash landed between a PUT and its commit"
        assert found_stored >= uncommitted, (
            f"{found_stored} of {uncommitted} objects stored before a crash were found again"
        )
    record(
        f"upload-crash-{mode}",
        kind,
        report,
        cycles=CRASHES,
        manifest_ranges=len(ranges),
        found_stored=found_stored,
        **({"uncommitted_at_crash": uncommitted} if mode == "after_put" else {}),
        seconds=round(time.monotonic() - started, 1),
        **summary(recoveries),
    )
