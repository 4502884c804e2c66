"""The batch client across a daemon's death, against real daemons: a ``Consumer`` whose
stream gRPC itself ends with INTERNAL "Internal error from Core" (an ack written while the
daemon dies) subscribes again like after any other loss, while an INTERNAL error the daemon
reports is a refusal and not retried (``danube_ingest.client.stream_lost``)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import grpc
import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.client import Batch, ConsumeError, Consumer, Producer, stream_lost
from danube_ingest.testing import BrokerProcess

pytestmark = pytest.mark.etcd

TOPIC = "/default/stream-loss"
INTERNAL = grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    ("code", "details", "debug", "lost"),
    [
        # What gRPC makes when the daemon goes away (seen in tests/faults, and below).
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", "", True),
        (INTERNAL, "Internal error from Core", 'Failed "execute_batch": (<op>,)', True),
        (INTERNAL, "Internal error from Core", "", True),
        (INTERNAL, "Received RST_STREAM with error code 2", "", True),
        (grpc.StatusCode.CANCELLED, "Received RST_STREAM with error code 8", "", True),
        # What the daemon sends (its debug string: the received status, ``CODE:details``).
        (INTERNAL, "boom: a bug", "INTERNAL:boom: a bug", False),
        (INTERNAL, "Internal error from Core", "INTERNAL:Internal error from Core", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "topic name", "", False),
        (grpc.StatusCode.NOT_FOUND, "no such topic", "", False),
        (grpc.StatusCode.PERMISSION_DENIED, "consume on /x", "", False),
        (grpc.StatusCode.UNAUTHENTICATED, "token expired", "", False),
        (grpc.StatusCode.FAILED_PRECONDITION, "consumer of another type", "", False),
    ],
)
def test_the_rule_that_tells_a_lost_stream_from_a_refusal(
    code: grpc.StatusCode, details: str, debug: str, lost: bool
) -> None:
    assert stream_lost(code, details, debug) is lost
    if not debug:
        assert ConsumeError(code, details, TOPIC).retriable is lost


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_consumer_acking_while_the_daemon_dies_subscribes_again(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Acks written after the daemon died but before its stream's end is seen fail inside
    gRPC, which then ends the call with INTERNAL "Internal error from Core" (not the transport's
    UNAVAILABLE): the consumer used to give up on it."""
    caplog.set_level(logging.INFO, logger="danube_ingest.client._consumer")
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=4)
    await asyncio.to_thread(broker.start)
    try:
        async with Producer(broker.url, TOPIC, linger_ms=1) as producer:
            await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(100)])
        consumer = Consumer(
            broker.url, TOPIC, "s", start="earliest", max_batch=10, max_backoff_ms=200
        )
        await consumer.start()
        try:
            first = await consumer.receive(timeout=30)
            broker.kill()
            # Keep acking (one ack request each) while gRPC notices the connection is gone.
            for _ in range(2000):
                consumer.ack(Batch(TOPIC, first.entries[:1]))
                await asyncio.sleep(0)
            await asyncio.to_thread(broker.start)
            seen = set(first.offsets)
            deadline = time.monotonic() + 60
            while len(seen) < 100:
                batch = await consumer.receive(timeout=max(deadline - time.monotonic(), 0.01))
                seen.update(batch.offsets)
                consumer.ack(batch)
        finally:
            await consumer.close()
        assert seen == set(range(100))
        assert consumer.reconnects >= 1
        assert "INTERNAL): Internal error from Core" in caplog.text, (
            "the daemon's death did not end the stream with gRPC's own INTERNAL this time: "
            "the scenario was not exercised"
        )
    finally:
        broker.kill()


async def test_an_internal_error_the_daemon_reports_is_not_retried(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon bug (injected: subscribing raises an unexpected exception, which the daemon's
    error path reports as INTERNAL with its text) ends the iteration at once, not after
    ``reconnect_timeout_s`` of retries."""
    async with Producer(broker.url, TOPIC) as producer:
        await (await producer.send(b"x"))
    consumer = Consumer(broker.url, TOPIC, "s", start="earliest", reconnect_timeout_s=60)
    await consumer.start()
    try:
        await consumer.receive(timeout=10)

        async def broken(*args: object, **kwargs: object) -> int:
            raise RuntimeError("subscription table damaged (injected)")

        # A consumer of the same name takes the stream over: the first one subscribes again
        # when it next reads, and the daemon then fails.
        async with Consumer(broker.url, TOPIC, "s"):
            assert broker.manager is not None
            monkeypatch.setattr(broker.manager, "subscribe", broken)
            started = time.monotonic()
            with pytest.raises(ConsumeError) as raised:
                await consumer.receive(timeout=30)
        assert raised.value.code == INTERNAL
        assert "subscription table damaged (injected)" in raised.value.details
        assert not raised.value.retriable
        assert time.monotonic() - started < 10
    finally:
        await consumer.close()
