"""Many batch producers at once against a small ``limits.max_publish_streams``: streams beyond
it are refused with RESOURCE_EXHAUSTED, the producers back off and resend with the same
sequences, and every message is stored exactly once, in each producer's order."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from danube_ingest.client import Consumer, Producer, target
from danube_ingest.wal.framing import Entry

from .conftest import BrokerFactory

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(180)]

PRODUCERS = 200
SINGLES = 20
BULK = 100


async def produce(producer: Producer, name: str) -> list[int]:
    """SINGLES ``send``s and a ``send_many`` of BULK, then close; their offsets in order."""
    async with producer:
        futures = [await producer.send(b"%s-s%d" % (name.encode(), i)) for i in range(SINGLES)]
        many = await producer.send_many([b"%s-m%d" % (name.encode(), i) for i in range(BULK)])
        offsets = list(await asyncio.gather(*futures))
        offsets += [offset for r in await many for offset in r]
    return offsets


@pytest.mark.parametrize("shared_channel", [False, True], ids=["own-channels", "one-channel"])
async def test_producers_beyond_the_stream_limit_back_off_and_store_everything_once(
    make_broker: BrokerFactory, caplog: pytest.LogCaptureFixture, shared_channel: bool
) -> None:
    caplog.set_level(logging.INFO, logger="danube_ingest.client._producer")
    broker = await make_broker(**{"limits.max_publish_streams": 8})
    topic = "/default/overload"
    channel = grpc.aio.insecure_channel(target(broker.url)) if shared_channel else None
    names = [f"p{i:03}" for i in range(PRODUCERS)]
    producers = [
        Producer(
            broker.url,
            topic,
            producer_name=name,
            max_batch_messages=10,
            linger_ms=1,
            retry_backoff_ms=20,
            max_backoff_ms=500,
            delivery_timeout=120,
            channel=channel,
        )
        for name in names
    ]
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*[produce(p, n) for p, n in zip(producers, names, strict=True)]), 150
        )
    finally:
        if channel is not None:
            await channel.close()
    refused = [r for r in caplog.records if "RESOURCE_EXHAUSTED" in r.getMessage()]
    assert refused, "no Publish stream was refused: the limit was not reached"
    assert "limits.max_publish_streams=8" in refused[0].getMessage()
    total = PRODUCERS * (SINGLES + BULK)
    assert sorted(o for offsets in results for o in offsets) == list(range(total))
    async with Consumer(broker.url, topic, "check", start="earliest", max_batch=1000) as consumer:
        seen: list[Entry] = []
        while len(seen) < total:
            batch = await consumer.receive(timeout=30)
            seen.extend(batch.entries)
            consumer.ack(batch)
    assert [e.offset for e in seen] == list(range(total))
    for name, offsets in zip(names, results, strict=True):
        expected = [b"%s-s%d" % (name.encode(), i) for i in range(SINGLES)]
        expected += [b"%s-m%d" % (name.encode(), i) for i in range(BULK)]
        mine = [e.payload for e in seen if e.producer_name == name]
        assert mine == expected, name  # each once, in send order
        assert [seen[o].payload for o in offsets] == expected
