"""The batch ``Producer``'s resends against a real broker: a sequence gap the daemon keeps
answering (FAILED_PRECONDITION) is resent with exponential backoff, not in a tight loop, and
the batch still fails only at its delivery deadline, stored nowhere."""

from __future__ import annotations

import asyncio
import time

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.client import Consumer, DeliveryTimeoutError, Producer

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(60)]

TOPIC = "/default/batch-retries"
DELIVERY_TIMEOUT = 3.0
MAX_BACKOFF_MS = 400.0


async def test_a_persistent_sequence_gap_is_resent_with_backoff(broker: Broker) -> None:
    async with Producer(broker.url, TOPIC) as first:
        assert await (await first.send(b"stored")) == 0  # the daemon now knows its id: seq 0
    producer = Producer(
        broker.url,
        TOPIC,
        linger_ms=1,
        retry_backoff_ms=50,
        max_backoff_ms=MAX_BACKOFF_MS,
        delivery_timeout=DELIVERY_TIMEOUT,
    )
    # A producer whose numbering runs ahead of the daemon's record of its id (an id shared by
    # two producers, or a client bug): the daemon answers every attempt with a gap.
    producer.producer_id = first.producer_id
    producer._next_sequence = 5
    await producer.start()
    try:
        started = time.monotonic()
        future = await producer.send(b"never stored")
        with pytest.raises(DeliveryTimeoutError) as raised:
            await asyncio.wait_for(future, DELIVERY_TIMEOUT + 10)
        took = time.monotonic() - started
    finally:
        await producer.close()
    # Backoff: no pause after the first gap, then 50, 100, 200 and 400 ms pauses: about ten
    # attempts in 3 s. Without it, one attempt per round trip (thousands).
    assert 3 <= raised.value.attempts <= 20, raised.value
    assert DELIVERY_TIMEOUT - 0.5 <= took <= DELIVERY_TIMEOUT + 2
    async with Consumer(broker.url, TOPIC, "check", start="earliest") as consumer:
        batch = await consumer.receive(timeout=10)
        assert batch.offsets == [0]
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout=1)
