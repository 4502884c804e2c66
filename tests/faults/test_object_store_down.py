"""The object store goes down under load and comes back with its objects: the daemon runs in
``wal_cloud`` mode on an fs object store whose root directory is moved away and replaced by a
plain file for longer than several uploads take (every store call then fails at once with
``ENOTDIR``/``EEXIST``: a store that refuses, not one that hangs, which test_object_store.py
covers), then put back. Publishing goes on (the WAL acknowledges; uploads fail and retry);
afterwards nothing acknowledged is lost, nothing is redelivered (the daemon never failed),
the manifest is gap-free and overlap-free, uploads resumed after the outage, and every object
the manifest names is in the store at its recorded size.

Why not moto stopped and restarted: moto keeps its objects in memory (it has no persistence
for S3), so a restarted moto is a new, empty store, not an outage that ends. Why not ``chmod
000``: the tests run as root, which permissions do not stop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from danube_ingest.testing import History, assert_history_ok, manifest_spans

from .conftest import BrokerFactory
from .harness import KINDS, Kind, manifest_ranges, read_all, record, start_workload

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/storedown"
#: How long the store is down: several segment seals (1 s each) and upload retries.
OUTAGE = 6.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(150)
async def test_object_store_down_and_back_loses_nothing(
    brokers: BrokerFactory,
    history: History,
    kind: Kind,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
) -> None:
    root = tmp_path / "objects"
    away = tmp_path / "objects.away"
    root.mkdir()
    broker = brokers(
        storage={
            "mode": "wal_cloud",
            "cloud": {"backend": "fs", "root": str(root)},
            "wal": {"segment_seconds": 1},
        }
    )
    await asyncio.to_thread(broker.start)
    live, load = await start_workload(kind, broker.url, TOPIC, history)
    started = time.monotonic()
    try:
        await load.wait_acked(200)
        await asyncio.sleep(1.5)  # a segment sealed and uploaded before the outage
        before = len(await manifest_ranges(etcd_server, etcd_prefix, TOPIC))
        log_before = len(broker.log_text())
        root.rename(away)
        root.write_bytes(b"the object store is down\n")
        try:
            during = load.acked
            await asyncio.sleep(OUTAGE)
            published_during = load.acked - during
            during_ranges = len(await manifest_ranges(etcd_server, etcd_prefix, TOPIC))
        finally:
            root.unlink()
            away.rename(root)
        failures = broker.log_text()[log_before:].count("object store retry op=put")
        restored = time.monotonic()
        await load.wait_acked(load.acked + 200)
        await load.stop()
        # The backlog uploaded: the store's retry delay had grown to several seconds.
        while len(await manifest_ranges(etcd_server, etcd_prefix, TOPIC)) <= during_ranges:
            assert time.monotonic() - restored < 60, "no upload committed after the store came back"
            await asyncio.sleep(0.2)
        uploads_resumed = time.monotonic() - restored
        await read_all(kind, broker.url, TOPIC, history, [live])
    finally:
        await live.close()
        await asyncio.to_thread(broker.stop)
    ranges = await manifest_ranges(etcd_server, etcd_prefix, TOPIC)
    report = assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
    )
    assert published_during > 0, "publishing stopped while the object store was down"
    assert failures > 0, "no PUT failed while the store was down: the outage was not real"
    assert during_ranges == before, "the manifest grew while the store was down"
    assert len(ranges) > before, "no upload was committed after the store came back"
    for entry in ranges:
        stored = root / entry.object_key
        assert stored.is_file(), f"manifest names {entry} but the store has no {stored}"
        assert stored.stat().st_size == entry.object_size
    record(
        "object-store-down",
        kind,
        report,
        cycles=1,
        published_during_outage=published_during,
        upload_failures=failures,
        uploads_resumed_s=round(uploads_resumed, 2),
        manifest_ranges=len(ranges),
        seconds=round(time.monotonic() - started, 1),
    )
