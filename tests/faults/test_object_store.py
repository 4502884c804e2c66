"""The object store hangs under load: the daemon runs in ``wal_cloud`` mode on a moto S3
server, which is paused (SIGSTOP: every request hangs, as on a stalled network or a store
that stopped answering) for longer than an upload takes, then resumed. Publishing goes on
(the WAL acknowledges; uploads wait and retry); afterwards nothing acknowledged is lost,
nothing is redelivered (the daemon never failed, so the hang is not logged as a fault), and
the manifest of uploaded objects is gap-free and overlap-free."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from danube_ingest.testing import History, MotoServer, assert_history_ok, manifest_spans

from .conftest import BrokerFactory
from .harness import KINDS, Kind, manifest_ranges, read_all, record, start_workload

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd, pytest.mark.s3]

TOPIC = "/default/objects"
#: How long the store hangs: several segment seals (1 s each) and upload attempts.
HANG = 6.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(150)
async def test_object_store_hang_loses_nothing(
    brokers: BrokerFactory,
    history: History,
    kind: Kind,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
) -> None:
    with MotoServer() as moto:
        bucket = moto.create_bucket("faults")
        options = moto.options(bucket)
        broker = brokers(
            storage={
                "mode": "wal_cloud",
                "cloud": {
                    "backend": "s3",
                    "bucket": bucket,
                    "endpoint": options["endpoint"],
                    "region": options["region"],
                    "access_key_id": options["access_key_id"],
                    "secret_access_key": options["secret_access_key"],
                },
                "wal": {"segment_seconds": 1},
            }
        )
        await asyncio.to_thread(broker.start)
        live, load = await start_workload(kind, broker.url, TOPIC, history)
        started = time.monotonic()
        assert moto.process is not None
        try:
            await load.wait_acked(200)
            await asyncio.sleep(1.5)  # a segment sealed and uploaded before the hang
            moto.process.send_signal(signal.SIGSTOP)
            try:
                during = load.acked
                await asyncio.sleep(HANG)
                published_during = load.acked - during
            finally:
                moto.process.send_signal(signal.SIGCONT)
            await load.wait_acked(load.acked + 200)
            await load.stop()
            await read_all(kind, broker.url, TOPIC, history, [live])
            await asyncio.sleep(3.0)  # the backlog uploaded
        finally:
            await live.close()
            await asyncio.to_thread(broker.stop)
        ranges = await manifest_ranges(etcd_server, etcd_prefix, TOPIC)
    report = assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
    )
    assert published_during > 0, "publishing stopped while the object store hung"
    assert ranges, "nothing was uploaded"
    record(
        "object-store-hang",
        kind,
        report,
        cycles=1,
        published_during_hang=published_during,
        manifest_ranges=len(ranges),
        seconds=round(time.monotonic() - started, 1),
    )
