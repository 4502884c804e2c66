"""An idle daemon is quiet: sealing, uploading and deleting segments that hold nothing but the
idle topics' time markers logs nothing at INFO (operators read INFO for what happened)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from danube_ingest.broker.server import Broker

from .conftest import BrokerFactory
from .support import Clients, eventually

IDLE = {
    "storage.mode": "wal_cloud",
    "storage.wal.segment_seconds": 1,
    "storage.wal.retention.check_seconds": 0.2,
    "storage.clock_interval_seconds": 0.5,
}


@pytest.mark.slow
async def test_an_idle_broker_logs_nothing_at_info(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    broker: Broker = await make_broker(**IDLE)
    assert broker.uploader is not None
    async with Clients(broker.url) as clients:
        producer = await clients.producer("/default/idle", "p")
        for _ in range(3):
            await producer.send(b"x" * 100)
    # The data's segment is uploaded (an INFO line: something happened), then nothing is sent.
    await eventually(lambda: broker.uploader.stats.ranges >= 1, "the data's upload")
    await asyncio.sleep(1.5)
    uploaded = broker.uploader.stats.segments
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="danube_ingest"):
        await asyncio.sleep(3.5)  # three segment intervals and more
    # The daemon really sealed and uploaded segments meanwhile (time markers), quietly.
    assert broker.uploader.stats.segments > uploaded
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == [], "\n".join(loud)
