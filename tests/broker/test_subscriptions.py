"""Publish/subscribe through the real danube-client and its raw protocol: message fields,
consumer ids and stream takeovers, idle consumers. What each subscription type gives to which
consumer is tested for both clients in test_both_clients.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from danube import SubType
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.server import Broker
from danube_ingest.broker.start import EARLIEST
from danube_ingest.dispatch import SubscriptionType

from .conftest import BrokerFactory
from .support import (
    RECEIVE_TIMEOUT,
    Clients,
    consumer_request,
    message,
    offsets,
    payloads,
    producer_request,
    raw_stubs,
    rpc_error,
)


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


async def test_published_fields_reach_the_consumer(clients: Clients) -> None:
    topic = "/default/basic"
    producer = await clients.producer(topic, "p1")
    sub = await clients.consumer(topic, "s1", "c1")
    before_ms = int(time.time() * 1000)
    for i in range(5):
        await producer.send(f"m{i}".encode(), {"i": str(i), "kind": "test"})
    after_ms = int(time.time() * 1000)
    second = await clients.producer(topic, "p2")
    await second.send(b"from-p2", None)

    got = await sub.take(6)
    assert offsets(got) == list(range(6))
    assert payloads(got) == [b"m0", b"m1", b"m2", b"m3", b"m4", b"from-p2"]
    assert [dict(m.attributes) for m in got[:5]] == [
        {"i": str(i), "kind": "test"} for i in range(5)
    ]
    assert dict(got[5].attributes) == {}
    assert [m.producer_name for m in got] == ["p1"] * 5 + ["p2"]
    assert all(before_ms <= m.publish_time <= after_ms for m in got[:5])
    assert {m.msg_id.topic_name for m in got} == {topic}
    assert {m.subscription_name for m in got} == {"s1"}
    assert len({m.msg_id.producer_id for m in got[:5]}) == 1
    assert got[0].msg_id.producer_id != got[5].msg_id.producer_id
    # The producers' request ids come back unchanged (each producer's CreateProducer was 1).
    assert [m.request_id for m in got] == [2, 3, 4, 5, 6, 2]
    await sub.ack_all(got)


async def test_failover_standby_takes_over_when_the_active_stream_is_cancelled(
    clients: Clients,
) -> None:
    """(Leaving by ``close`` is in test_both_clients.py, for both clients; this departure is
    danube-client's own: its receive task cancelled while the consumer stays subscribed.)"""
    topic = "/default/failover-stream-cancelled"
    producer = await clients.producer(topic)
    active = await clients.consumer(topic, "s", "c1", SubType.FAILOVER)
    standby = await clients.consumer(topic, "s", "c2", SubType.FAILOVER)
    for i in range(5):
        await producer.send(f"m{i}".encode())

    first = await active.take(5)
    assert offsets(first) == [0, 1, 2, 3, 4]
    assert standby.queue.empty()
    await active.ack_all(first[:3])  # 3 and 4 stay unacknowledged

    # The client's receive task owns the ReceiveMessages stream: cancelling it cancels the
    # stream while the consumer stays subscribed (like a stalled process).
    for task in active.consumer._tasks:
        task.cancel()

    redelivered = await standby.take(2)
    assert offsets(redelivered) == [3, 4]
    assert payloads(redelivered) == [b"m3", b"m4"]
    for i in range(5, 8):
        await producer.send(f"m{i}".encode())
    later = await standby.take(3)
    assert offsets(later) == [5, 6, 7]
    await standby.ack_all(redelivered + later)


async def test_same_consumer_name_is_the_same_consumer_and_a_new_stream_takes_over(
    broker: Broker,
) -> None:
    topic = "/default/takeover"
    async with raw_stubs(broker.url) as raw:
        producer = await raw.producers.CreateProducer(producer_request(topic))
        again = await raw.producers.CreateProducer(producer_request(topic))
        assert again.producer_id == producer.producer_id
        first = await raw.consumers.Subscribe(consumer_request(topic, "s", "c1"))
        second = await raw.consumers.Subscribe(consumer_request(topic, "s", "c1"))
        assert second.consumer_id == first.consumer_id
        other = await raw.consumers.Subscribe(consumer_request(topic, "s2", "c1"))
        assert other.consumer_id != first.consumer_id  # another subscription, another consumer

        await raw.producers.SendMessage(message(producer.producer_id, topic, b"m0"))
        receive = pb.ReceiveRequest(request_id=1, consumer_id=first.consumer_id)
        old_stream = raw.consumers.ReceiveMessages(receive)
        delivered = await asyncio.wait_for(old_stream.read(), RECEIVE_TIMEOUT)
        assert (delivered.msg_id.topic_offset, delivered.payload) == (0, b"m0")

        # A second stream for the same consumer (the client reconnecting) takes over: the old
        # stream ends and the unacknowledged message is delivered again on the new one.
        new_stream = raw.consumers.ReceiveMessages(receive)
        redelivered = await asyncio.wait_for(new_stream.read(), RECEIVE_TIMEOUT)
        assert (redelivered.msg_id.topic_offset, redelivered.payload) == (0, b"m0")
        assert await asyncio.wait_for(old_stream.read(), RECEIVE_TIMEOUT) is grpc.aio.EOF
        new_stream.cancel()


async def test_failover_consumer_reopening_its_stream_stays_active(broker: Broker) -> None:
    topic = "/default/failover-reopen"
    async with raw_stubs(broker.url) as raw:
        producer = await raw.producers.CreateProducer(producer_request(topic))
        active = await raw.consumers.Subscribe(consumer_request(topic, "s", "c1", SubType.FAILOVER))
        standby = await raw.consumers.Subscribe(
            consumer_request(topic, "s", "c2", SubType.FAILOVER)
        )

        def stream(consumer_id: int) -> Any:
            return raw.consumers.ReceiveMessages(
                pb.ReceiveRequest(request_id=1, consumer_id=consumer_id)
            )

        standby_stream = stream(standby.consumer_id)
        old_stream = stream(active.consumer_id)
        await raw.producers.SendMessage(message(producer.producer_id, topic, b"m0"))
        first = await asyncio.wait_for(old_stream.read(), RECEIVE_TIMEOUT)
        assert first.msg_id.topic_offset == 0

        # c1 reconnects while its old stream is still open (a half-dead connection): it is
        # still the same consumer, so it keeps its place as the active one.
        new_stream = stream(active.consumer_id)
        again = await asyncio.wait_for(new_stream.read(), RECEIVE_TIMEOUT)
        assert again.msg_id.topic_offset == 0
        await raw.producers.SendMessage(message(producer.producer_id, topic, b"m1", request_id=2))
        later = await asyncio.wait_for(new_stream.read(), RECEIVE_TIMEOUT)
        assert (later.msg_id.topic_offset, later.payload) == (1, b"m1")
        for s in (old_stream, new_stream, standby_stream):
            s.cancel()


async def test_key_shared_consumer_resubscribing_with_new_filters_keeps_them(
    broker: Broker,
) -> None:
    topic = "/default/refilter"

    def subscribe(filters: list[str]) -> Any:
        request = consumer_request(topic, "s", "c1", SubType.KEY_SHARED)
        request.key_filters.extend(filters)
        return raw.consumers.Subscribe(request)

    async with raw_stubs(broker.url) as raw:
        producer = await raw.producers.CreateProducer(producer_request(topic))
        before = await subscribe(["old-*"])
        after = await subscribe(["new-*"])  # the application changed its configuration
        assert after.consumer_id == before.consumer_id
        receive = pb.ReceiveRequest(request_id=1, consumer_id=after.consumer_id)

        for attempt in range(2):  # the second stream is the client reconnecting
            stream = raw.consumers.ReceiveMessages(receive)
            await raw.producers.SendMessage(
                message(producer.producer_id, topic, b"m", routing_key=f"new-{attempt}")
            )
            got = await asyncio.wait_for(stream.read(), RECEIVE_TIMEOUT)
            assert (got.routing_key, got.msg_id.topic_offset) == (f"new-{attempt}", attempt)
            await raw.consumers.Ack(
                pb.AckRequest(request_id=1, msg_id=got.msg_id, subscription_name="s")
            )
            stream.cancel()


async def test_idle_consumer_stops_holding_an_exclusive_subscription(
    make_broker: BrokerFactory,
) -> None:
    # A consumer that subscribed, then vanished without ever streaming or health-checking
    # (its process died), must not hold the subscription until the broker restarts.
    broker = await make_broker(**{"dispatch.consumer_idle_seconds": 0.6})
    topic = "/default/idle"
    async with raw_stubs(broker.url) as raw:
        await raw.producers.CreateProducer(producer_request(topic))
        first = await raw.consumers.Subscribe(consumer_request(topic, "s", "gone"))
        refused = await rpc_error(raw.consumers.Subscribe(consumer_request(topic, "s", "next")))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED

        # A consumer that keeps health-checking stays attached past the idle time.
        for _ in range(4):
            await asyncio.sleep(0.3)
            health = await raw.health.HealthCheck(
                pb.HealthCheckRequest(
                    request_id=1, client=pb.HealthCheckRequest.Consumer, id=first.consumer_id
                )
            )
            assert health.status == pb.HealthCheckResponse.OK
        refused = await rpc_error(raw.consumers.Subscribe(consumer_request(topic, "s", "next")))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED

        # Once it stops, it is detached and the subscription is free.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while True:
            try:
                second = await raw.consumers.Subscribe(consumer_request(topic, "s", "next"))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
                assert loop.time() < deadline, "the idle consumer was never detached"
                await asyncio.sleep(0.1)
        assert second.consumer_id != first.consumer_id


async def test_concurrent_subscribes_create_a_subscription_once(broker: Broker) -> None:
    """Two consumers subscribing at once to a new Shared subscription share one dispatcher
    (each message goes to one of them), and its cursor is the one the winner chose."""
    topic = "/default/concurrent-subscribe"
    manager = broker.manager
    await manager.create_producer(topic, "p", True)
    ids = await asyncio.gather(
        *(
            manager.subscribe(topic, "s", name, SubscriptionType.SHARED, [], EARLIEST)
            for name in ("a", "b", "c")
        )
    )
    runtime = manager._topics[topic]
    subscription = runtime.subscriptions["s"]
    handles = [manager._handles[i] for i in ids]
    assert {id(h._owner) for h in handles} == {id(subscription)}
