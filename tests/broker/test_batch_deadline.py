"""The batch client's delivery deadline (``Producer(delivery_timeout=...)``) against a real
daemon child process that is SIGKILLed: not restarted (every pending send, ``send_many``,
``flush`` and ``close`` ends within the deadline with ``DeliveryTimeoutError``), or restarted in
time (everything stored exactly once), or restarted after batches expired (the producer goes on
under a fresh producer id; nothing is stored twice)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from danube_ingest.client import ClientError, Consumer, DeliveryTimeoutError, Producer
from danube_ingest.testing import BrokerProcess
from danube_ingest.wal.framing import Entry

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(120)]

TOPIC = "/default/batch-deadline"
LEASE_TTL = 4


async def read_all(url: str, count: int) -> list[Entry]:
    """The first ``count`` entries of TOPIC, from the earliest offset."""
    async with Consumer(url, TOPIC, "check", start="earliest") as consumer:
        seen: list[Entry] = []
        while len(seen) < count:
            batch = await consumer.receive(timeout=30)
            seen.extend(batch.entries)
            consumer.ack(batch)
    return seen


async def test_sends_to_a_daemon_that_died_for_good_fail_after_the_delivery_timeout(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    try:
        producer = Producer(broker.url, TOPIC, max_batch_messages=100, delivery_timeout=3)
        await producer.start()
        stored = await asyncio.gather(*[await producer.send(b"a%d" % i) for i in range(200)])
        assert stored == list(range(200))
        broker.kill()
        started = time.monotonic()
        singles = [await producer.send(b"b%d" % i) for i in range(150)]
        many = await producer.send_many([b"c%d" % i for i in range(250)])
        await asyncio.wait_for(producer.flush(), 15)
        await asyncio.wait_for(producer.close(), 15)
        waited = time.monotonic() - started
        assert 2.5 < waited < 10, waited
        for future in [*singles, many]:
            error = future.exception()
            assert isinstance(error, DeliveryTimeoutError)
            assert isinstance(error, ClientError) and error.retriable
            assert error.topic == TOPIC
            assert "delivery_timeout=3s" in str(error) and TOPIC in str(error)
    finally:
        broker.kill()


async def test_a_daemon_restarted_within_the_delivery_timeout_stores_everything_once(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    try:
        async with Producer(
            broker.url, TOPIC, max_batch_messages=100, linger_ms=1, delivery_timeout=60
        ) as producer:
            futures = [await producer.send(b"%d" % i) for i in range(1000)]
            broker.kill()  # (some batches answered, some sent and not answered, some not sent)
            futures += [await producer.send(b"%d" % i) for i in range(1000, 1500)]
            many = await producer.send_many([b"%d" % i for i in range(1500, 2000)])
            await asyncio.to_thread(broker.start)
            offsets = await asyncio.wait_for(asyncio.gather(*futures), 60)
            ranges = await asyncio.wait_for(many, 60)
        offsets += [offset for r in ranges for offset in r]
        assert offsets == list(range(2000))
        seen = await read_all(broker.url, 2000)
        assert [e.payload for e in seen] == [b"%d" % i for i in range(2000)]
    finally:
        broker.kill()


async def test_after_batches_expire_the_producer_goes_on_and_stores_nothing_twice(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """Batches sent to a stopped daemon (SIGSTOP: it never reads them) expire; it is then
    SIGKILLed and restarted, so their sequences are not stored. Later sends are stored exactly
    once, in order, under a new producer id: under the old one the daemon would wait for the
    expired sequences for ever (a gap)."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    try:
        async with Producer(
            broker.url, TOPIC, max_batch_messages=100, linger_ms=1, delivery_timeout=3
        ) as producer:
            first_id = producer.producer_id
            first = [await producer.send(b"a%d" % i) for i in range(500)]
            assert await asyncio.gather(*first) == list(range(500))
            broker.kill(signal.SIGSTOP)
            late = [await producer.send(b"b%d" % i) for i in range(300)]
            await asyncio.wait_for(producer.flush(), 15)
            errors = [f.exception() for f in late]
            assert all(isinstance(e, DeliveryTimeoutError) for e in errors)
            assert isinstance(errors[0], DeliveryTimeoutError) and errors[0].sent
            broker.kill()
            await asyncio.to_thread(broker.start)
            after = await producer.send_many([b"c%d" % i for i in range(500)])
            ranges = await asyncio.wait_for(after, 60)
            assert producer.producer_id != first_id
        assert [o for r in ranges for o in r] == list(range(500, 1000))
        seen = await read_all(broker.url, 1000)
        assert [e.payload for e in seen] == [b"a%d" % i for i in range(500)] + [
            b"c%d" % i for i in range(500)
        ]
    finally:
        broker.kill()
