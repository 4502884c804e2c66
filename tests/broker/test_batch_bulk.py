"""``Producer.send_many`` (the bulk publish path) against a real broker over loopback gRPC:
order and offsets across batch cuts, after messages queued by ``send``, with a buffer smaller
than the call, and a batch refused for good failing the call's future."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.client import Consumer, Producer, PublishError
from danube_ingest.wal.framing import Entry

from .conftest import BrokerFactory

pytestmark = pytest.mark.etcd

TIMEOUT = 10.0


async def receive(consumer: Consumer, n: int) -> list[Entry]:
    got: list[Entry] = []
    while len(got) < n:
        batch = await consumer.receive(timeout=TIMEOUT)
        got.extend(batch.entries)
        consumer.ack(batch)
    return got


async def test_send_many_is_cut_into_batches_in_order_after_earlier_sends(broker: Broker) -> None:
    topic = "/default/bulk-order"
    uniform = [f"u{i:04}".encode() for i in range(2500)]
    varied = [b"v" * (i % 7) for i in range(130)]
    async with Producer(
        broker.url, topic, producer_name="bulk", max_batch_messages=1000, max_buffered=700
    ) as producer:
        first = await producer.send(b"before")
        ranges = await asyncio.wait_for(
            await producer.send_many(uniform, routing_key="k", publish_ms=42), TIMEOUT
        )
        varied_ranges = await asyncio.wait_for(await producer.send_many(varied), TIMEOUT)
        empty = await producer.send_many([])
    assert await first == 0
    # max_buffered (700) < 2,500: the call still goes through, in batches of 1,000.
    assert ranges == [range(1, 1001), range(1001, 2001), range(2001, 2501)]
    assert varied_ranges == [range(2501, 2631)]
    assert empty.result() == []
    async with Consumer(broker.url, topic, "s", start="earliest") as consumer:
        got = await receive(consumer, 2631)
    assert [e.offset for e in got] == list(range(2631))
    assert [e.payload for e in got] == [b"before", *uniform, *varied]
    assert {(e.routing_key, e.publish_ms, e.producer_name) for e in got[1:2501]} == {
        ("k", 42, "bulk")
    }
    assert got[2501].routing_key is None and got[2501].ingest_ms > 0


async def test_send_many_fails_its_future_for_a_refused_batch_and_goes_on(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker(**{"limits.max_payload_bytes": 1000})
    topic = "/default/bulk-refused"
    async with Producer(broker.url, topic, max_batch_messages=10) as producer:
        good = await producer.send_many([b"a"] * 15)
        bad = await producer.send_many([b"b" * 2000] * 3)
        after = await producer.send_many([b"c"] * 5)
        with pytest.raises(PublishError, match="max_payload_bytes"):
            await asyncio.wait_for(bad, TIMEOUT)
        assert await asyncio.wait_for(good, TIMEOUT) == [range(0, 10), range(10, 15)]
        assert await asyncio.wait_for(after, TIMEOUT) == [range(15, 20)]
