"""The control plane's ``wal_prune_marks`` asset (real Dagster ``materialize``) against a real
broker with two WAL regions: the marks land in the region that really holds each topic, at
min(manifest end, lowest cursor), and the broker's cleaner frees the WAL up to them and no
further."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from dagster import DagsterInstance, materialize

from assets.wal_marks import wal_prune_marks
from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.records import Records
from pipelines.resources import EtcdResource

from .conftest import BrokerFactory
from .support import Clients, eventually
from .test_cold_path import COLD, take_acking

pytestmark = pytest.mark.dagster

CONSUMED = "/default/consumed"
UNSUBSCRIBED = "/default/unsubscribed"


async def _until(check: Any, what: str, timeout: float = 30.0) -> None:
    """Poll an async ``check()`` (etcd reads) until it holds."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.1)


async def test_asset_marks_follow_cursors_and_uploads_and_the_cleaner_obeys(
    make_broker: BrokerFactory, etcd_server: str, etcd_prefix: str
) -> None:
    broker: Broker = await make_broker(**COLD, **{"storage.wal.regions": 2})
    assert broker.store is not None and broker.cleaner is not None
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    keys = Keys(etcd_prefix)
    manifest, records = Manifest(kv, keys), Records(kv, keys)
    try:
        async with Clients(broker.url) as clients:
            consumed = await clients.producer(CONSUMED, "p1")
            unsubscribed = await clients.producer(UNSUBSCRIBED, "p2")
            sub = await clients.consumer(CONSUMED, "s1", "c1")
            for i in range(300):
                await consumed.send(f"c{i:04}".encode().ljust(500, b"."))
                await unsubscribed.send(f"u{i:04}".encode().ljust(500, b"."))
            await take_acking(sub, 150)
            await sub.consumer.close()  # the cursor stays at 150

            async def uploaded() -> bool:
                ends = [await manifest.end_offset(t) for t in (CONSUMED, UNSUBSCRIBED)]
                return min(ends) >= 300

            async def cursor_flushed() -> bool:
                return await records.get_cursor(CONSUMED, "s1") == 150

            await _until(uploaded, "both topics uploaded")
            await _until(cursor_flushed, "the cursor in etcd")

            resource = EtcdResource(endpoints=etcd_server, prefix=etcd_prefix)
            with DagsterInstance.ephemeral() as instance:
                result = await asyncio.to_thread(
                    materialize, [wal_prune_marks], resources={"etcd": resource}, instance=instance
                )
            assert result.success

            regions = {t: broker.store.info(t).region for t in (CONSUMED, UNSUBSCRIBED)}  # type: ignore[union-attr]
            marks = PruneMarks(kv, keys)
            found: dict[str, int] = {}
            for region in set(regions.values()):
                for topic, mark in (await marks.marks("broker-1", region)).items():
                    assert regions[topic] == region  # the region that holds the topic
                    found[topic] = mark
            assert found == {CONSUMED: 150, UNSUBSCRIBED: 300}

            def cleaned() -> bool:
                info = broker.store.info(CONSUMED)  # type: ignore[union-attr]
                return info is not None and info.first_offset > 0

            await eventually(cleaned, "the cleaner acting on the mark")
            # Nothing the subscription has not acknowledged left the WAL.
            info = broker.store.info(CONSUMED)
            assert info is not None and 0 < info.first_offset <= 150
    finally:
        await kv.close()
