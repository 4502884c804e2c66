"""Fairness between streams: a batch stream may have only ``PUBLISH_IN_FLIGHT_BYTES`` staged
and not durable (``broker.batch``), so another stream's append waits behind that much of it in
the WAL, not behind everything the batch producer has sent.

The batch producer runs in a child process, so that it sends as fast as the broker takes
batches (in this process it would share the event loop with the broker and never get ahead).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from danube_ingest.broker.batch import PUBLISH_IN_FLIGHT_BYTES

from .conftest import BrokerFactory
from .support import Clients

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BATCHES = 48
BATCH = 512
PAYLOAD = 2048  # 1 MiB per batch, 48 MiB in all: far beyond the credit
BULK = "/default/fair-bulk"

_BULK = f"""
import asyncio, sys
from danube_ingest.client import Producer

async def main() -> None:
    async with Producer(sys.argv[1], {BULK!r}, max_batch_messages={BATCH}, max_in_flight=64,
                        max_buffered={BATCH * BATCHES}) as producer:
        payloads = [bytes({PAYLOAD})] * {BATCH}
        futures = [await producer.send_many(payloads) for _ in range({BATCHES})]
        await asyncio.gather(*futures)

asyncio.run(main())
"""


async def test_a_batch_stream_queues_no_more_than_its_credit_ahead_of_a_small_append(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(**{"storage.wal.fsync": "always"})
    store = broker.store
    assert store is not None
    async with Clients(broker.url) as clients:
        small = await clients.producer("/default/fair-small", "small")
        await small.send(b"warm-up")  # (creates the topic)
        child = subprocess.Popen([sys.executable, "-c", _BULK, broker.url])
        try:
            most_queued = 0
            served: list[int] = []
            while child.poll() is None:
                info = store.info(BULK)
                queued = 0 if info is None else info.next_offset - info.high_watermark
                most_queued = max(most_queued, queued)
                if queued and len(served) < 20:
                    # A small append while the backlog is queued: it is served meanwhile.
                    await small.send(b"small")
                    served.append(queued)
                await asyncio.sleep(0.001)
            assert child.returncode == 0
        finally:
            child.kill()
            child.wait()
    info = store.info(BULK)
    assert info is not None and info.high_watermark == BATCHES * BATCH
    assert served, "the bulk stream never had anything queued"
    # Entries of the bulk stream staged and not durable never exceeded its credit (plus the one
    # batch larger than what was left of it is never staged: the bound is the credit).
    assert most_queued * PAYLOAD <= PUBLISH_IN_FLIGHT_BYTES, most_queued
