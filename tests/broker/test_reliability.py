"""Reliable dispatch through the real danube-client: acks move the (persisted) cursor, nacks and
ack timeouts redeliver the same offset, poison messages are dropped or dead-lettered; and the
non-reliable fan-out to live subscriptions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from danube_ingest.broker.server import Broker

from .conftest import BrokerFactory
from .support import Clients, metadata, offsets, payloads, take, wait_until

#: Redelivery settings that keep these tests fast: no nack floor, 50 ms first backoff.
FAST_REDELIVERY = {"dispatch.nack_base_delay_ms": 0, "dispatch.redelivery_base_ms": 50}

ClientsFactory = Callable[..., Awaitable[tuple[Broker, Clients]]]


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


@pytest.fixture
async def tuned(make_broker: BrokerFactory) -> AsyncIterator[ClientsFactory]:
    """``await tuned(**overrides)``: a broker with config overrides and a client on it."""
    opened: list[Clients] = []

    async def make(**overrides: Any) -> tuple[Broker, Clients]:
        broker = await make_broker(**overrides)
        clients = Clients(broker.url)
        opened.append(clients)
        return broker, await clients.__aenter__()

    yield make
    for clients in reversed(opened):
        await clients.__aexit__(None, None, None)


@pytest.fixture
def cursor(etcd_server: str, etcd_prefix: str) -> Callable[[str, str, int], Awaitable[None]]:
    """``await cursor(topic, subscription, expected)``: wait until etcd holds that cursor."""

    async def wait(topic: str, subscription: str, expected: int) -> None:
        async with metadata(etcd_server, etcd_prefix) as records:
            await wait_until(
                lambda: records.get_cursor(topic, subscription),
                lambda value: value == expected,
                f"cursor of {topic}/{subscription} == {expected}",
            )

    return wait


async def test_acks_move_the_persisted_cursor_and_are_not_redelivered(
    clients: Clients, cursor: Callable[[str, str, int], Awaitable[None]]
) -> None:
    topic = "/default/acks"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    await cursor(topic, "s", 0)  # a new subscription starts (and is stored) at the end
    for i in range(10):
        await producer.send(f"m{i}".encode())
    got = await sub.take(10)
    await sub.ack_all(got[:5])
    await cursor(topic, "s", 5)

    await sub.consumer.close()
    reopened = await clients.consumer(topic, "s", "c1")
    again = await reopened.take(5)
    assert offsets(again) == [5, 6, 7, 8, 9]  # the unacked ones, not the acked ones
    await reopened.ack_all(again)
    await cursor(topic, "s", 10)


async def test_out_of_order_acks_move_the_cursor_only_past_a_complete_prefix(
    clients: Clients, cursor: Callable[[str, str, int], Awaitable[None]]
) -> None:
    topic = "/default/out-of-order"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    for i in range(4):
        await producer.send(f"m{i}".encode())
    _, m1, m2, _ = await sub.take(4)
    await sub.ack_all([m2, m1])
    await sub.consumer.close()

    # 0 and 3 were never acked: a reopened consumer gets exactly those.
    reopened = await clients.consumer(topic, "s", "c1")
    again = await reopened.take(2)
    assert offsets(again) == [0, 3]
    await reopened.ack_all(again)
    await cursor(topic, "s", 4)


async def test_nack_redelivers_the_same_offset(tuned: ClientsFactory) -> None:
    _, clients = await tuned(**FAST_REDELIVERY)
    topic = "/default/nack"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    await producer.send(b"retry me", {"a": "1"})
    await producer.send(b"fine")
    first, fine = await sub.take(2)
    await sub.consumer.nack(first, None, "try later")
    await sub.ack_all([fine])

    (again,) = await sub.take(1)
    assert again.msg_id.topic_offset == first.msg_id.topic_offset == 0
    assert (again.payload, dict(again.attributes)) == (b"retry me", {"a": "1"})
    await sub.ack_all([again])
    await producer.send(b"next")
    assert offsets(await sub.take(1)) == [2]


async def test_ack_timeout_redelivers_the_same_offset(tuned: ClientsFactory) -> None:
    _, clients = await tuned(**{"dispatch.ack_timeout_seconds": 0.3, **FAST_REDELIVERY})
    topic = "/default/ack-timeout"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    await producer.send(b"slow")
    (first,) = await sub.take(1)
    (again,) = await sub.take(1)  # never acked: it comes back
    assert (again.msg_id.topic_offset, again.payload) == (0, b"slow")
    assert first.msg_id.topic_offset == 0
    await sub.ack_all([again])
    await producer.send(b"next")
    assert offsets(await sub.take(1)) == [1]


async def test_drop_policy_skips_the_poison_message(
    tuned: ClientsFactory, cursor: Callable[[str, str, int], Awaitable[None]]
) -> None:
    _, clients = await tuned(
        **{"dispatch.poison_policy": "drop", "dispatch.max_redeliveries": 1, **FAST_REDELIVERY}
    )
    topic = "/default/drop"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    await producer.send(b"poison")
    await producer.send(b"good-1")
    await producer.send(b"good-2")

    seen: list[tuple[int, bytes]] = []
    while len(seen) < 4:  # poison twice (first delivery + 1 redelivery), good ones once
        (m,) = await sub.take(1)
        seen.append((m.msg_id.topic_offset, m.payload))
        if m.payload == b"poison":
            await sub.consumer.nack(m, None, "cannot parse")
        else:
            await sub.consumer.ack(m)
    assert sorted(seen) == [(0, b"poison"), (0, b"poison"), (1, b"good-1"), (2, b"good-2")]
    await cursor(topic, "s", 3)  # the dropped message counts as settled

    await producer.send(b"later")
    (later,) = await sub.take(1)
    assert (later.msg_id.topic_offset, later.payload) == (3, b"later")
    await sub.ack_all([later])


async def test_dead_letter_policy_republishes_to_the_dlq_topic(tuned: ClientsFactory) -> None:
    _, clients = await tuned(
        **{
            "dispatch.poison_policy": "dead_letter",
            "dispatch.max_redeliveries": 1,
            **FAST_REDELIVERY,
        }
    )
    topic = "/default/payments"
    dlq = f"{topic}-dlq"
    # A subscription starts at the end of its topic: create the DLQ topic and subscribe first.
    await clients.producer(dlq, "dlq-admin")
    dead = await clients.consumer(dlq, "inspect", "ops")
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    await producer.send(b"good-0")
    await producer.send(b"poison", {"order": "7"})
    await producer.send(b"good-2")

    handled = 0
    while handled < 4:  # good ones once, poison twice
        (m,) = await sub.take(1)
        handled += 1
        if m.payload == b"poison":
            await sub.consumer.nack(m, None, "cannot parse")
        else:
            await sub.consumer.ack(m)

    (letter,) = await dead.take(1)
    assert letter.msg_id.topic_name == dlq
    assert letter.msg_id.topic_offset == 0
    assert letter.payload == b"poison"
    assert dict(letter.attributes) == {
        "order": "7",
        "x-original-topic": topic,
        "x-original-subscription": "s",
        "x-original-topic-offset": "1",
        "x-delivery-attempt": "2",
        "x-failure-reason": "cannot parse",
    }
    await dead.ack_all([letter])

    await producer.send(b"later")
    (later,) = await sub.take(1)
    assert (later.msg_id.topic_offset, later.payload) == (3, b"later")
    await sub.ack_all([later])


async def test_unacked_window_limits_what_a_consumer_holds(tuned: ClientsFactory) -> None:
    _, clients = await tuned(**{"limits.max_unacked_messages": 2})
    topic = "/default/window"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    for i in range(5):
        await producer.send(f"m{i}".encode())
    held = await sub.take(2)
    assert offsets(held) == [0, 1]
    await asyncio.sleep(0.3)  # give a misbehaving broker the chance to send more
    assert sub.queue.empty()
    await sub.ack_all(held[:1])
    assert offsets(await sub.take(1)) == [2]
    await sub.ack_all(held[1:])
    assert offsets(await sub.take(1)) == [3]


async def test_non_reliable_topic_fans_out_to_live_subscriptions(clients: Clients) -> None:
    topic = "/default/live"
    producer = await clients.producer(topic, reliable=False)
    first = await clients.consumer(topic, "s1", "c1")
    second = await clients.consumer(topic, "s2", "c2")
    for i in range(5):
        await producer.send(f"m{i}".encode())
    for sub in (first, second):
        got = await sub.take(5)
        assert payloads(got) == [f"m{i}".encode() for i in range(5)]
        assert offsets(got) == list(range(5))
        await sub.ack_all(got)  # accepted, and meaningless

    late = await clients.consumer(topic, "s3", "c3")  # sees only what is published from now
    for i in range(5, 8):
        await producer.send(f"m{i}".encode())
    got_late = await late.take(3)
    assert payloads(got_late) == [b"m5", b"m6", b"m7"]
    assert offsets(got_late) == [5, 6, 7]
    for sub in (first, second):
        assert payloads(await take(sub.queue, 3)) == [b"m5", b"m6", b"m7"]
