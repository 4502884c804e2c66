"""The behaviour both publish/consume paths promise, one test run against each client:
danube-client (Danube's protocol) and ``danube_ingest.client`` (the batch protocol), through
``clients.py``. Ordering, visibility across the two, dispatch per subscription type, bad input
refused with the same status before an offset is used, and durability across SIGKILL.

What only one path has stays in its own file: danube-client's message fields, ids and stream
takeovers (test_subscriptions.py, test_bad_input.py), the batch protocol's CRC, block layout
and sequence rules (test_batch.py), idempotent resends across a crash (test_batch_restart.py).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.testing import BrokerProcess

from .clients import ClientSide, Message, Received, Refused, Subscription, side
from .conftest import BrokerFactory
from .support import RECEIVE_TIMEOUT, metadata, producer_request, raw_stubs

pytestmark = pytest.mark.etcd

OpenSide = Callable[..., Awaitable[ClientSide]]


@pytest.fixture(params=["danube", "batch"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_side(kind: str) -> AsyncIterator[OpenSide]:
    """Open a client on a broker URL (``kind`` unless another is named); all closed after."""
    opened: list[ClientSide] = []

    async def open_(url: str, name: str = kind) -> ClientSide:
        client = side(name, url)
        await client.open()
        opened.append(client)
        return client

    yield open_
    for client in reversed(opened):
        await client.close()


@pytest.fixture
async def via(broker: Broker, open_side: OpenSide) -> ClientSide:
    """The client under test on the default broker."""
    return await open_side(broker.url)


async def create_topic(url: str, topic: str) -> None:
    """Create ``topic`` with nothing in it (the batch protocol creates a topic by publishing
    only): a producer is created and left unused."""
    async with raw_stubs(url) as raw:
        await raw.producers.CreateProducer(producer_request(topic))


def offsets(messages: list[Received]) -> list[int]:
    return [m.offset for m in messages]


def payloads(messages: list[Received]) -> list[bytes]:
    return [m.payload for m in messages]


def numbered(n: int, start: int = 0, **fields: object) -> list[Message]:
    return [Message(f"m{i}".encode(), **fields) for i in range(start, start + n)]  # type: ignore[arg-type]


async def take_spread(subs: list[Subscription], total: int) -> list[list[Received]]:
    """The next ``total`` messages over several consumers, per consumer in arrival order."""
    got: list[list[Received]] = [[] for _ in subs]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECEIVE_TIMEOUT
    while sum(map(len, got)) < total:
        if loop.time() > deadline:
            raise AssertionError(
                f"expected {total} messages, got {[offsets(g) for g in got]} per consumer"
            )
        for sub, bucket in zip(subs, got, strict=True):
            bucket.extend(sub.available())
        await asyncio.sleep(0.01)
    return got


# -- ordering and visibility -------------------------------------------------------------------


async def test_published_messages_arrive_in_order_with_contiguous_offsets(
    broker: Broker, via: ClientSide, kind: str
) -> None:
    topic = "/default/order"
    await create_topic(broker.url, topic)
    sub = await via.subscribe(topic, "s1", "c1")
    sent = [Message(f"m{i}".encode(), f"k{i % 3}", {"i": str(i)}) for i in range(30)]
    acked = await via.publish(topic, sent)
    # (danube-client's answer names no offset; the batch client's names each one.)
    assert acked == (None if kind == "danube" else list(range(30)))
    got = await sub.take(30)
    assert offsets(got) == list(range(30))
    assert [(m.payload, m.routing_key, m.attributes) for m in got] == [
        (m.payload, m.routing_key, m.attributes) for m in sent
    ]
    await sub.ack(got)


async def test_two_producers_each_keep_their_order(broker: Broker, via: ClientSide) -> None:
    topic = "/default/two-producers"
    await create_topic(broker.url, topic)
    sub = await via.subscribe(topic, "s1", "c1")
    await asyncio.gather(
        via.publish(topic, [Message(b"a%d" % i) for i in range(20)], producer="pa"),
        via.publish(topic, [Message(b"b%d" % i) for i in range(20)], producer="pb"),
    )
    got = await sub.take(40)
    assert offsets(got) == list(range(40))
    assert [m.payload for m in got if m.payload[:1] == b"a"] == [b"a%d" % i for i in range(20)]
    assert [m.payload for m in got if m.payload[:1] == b"b"] == [b"b%d" % i for i in range(20)]
    await sub.ack(got)


async def test_messages_published_by_one_client_reach_the_other(
    broker: Broker, kind: str, open_side: OpenSide
) -> None:
    topic = "/default/cross"
    other = "batch" if kind == "danube" else "danube"
    publisher = await open_side(broker.url)
    consumer = await open_side(broker.url, other)
    await create_topic(broker.url, topic)
    own = await publisher.subscribe(topic, "own", "c1")
    theirs = await consumer.subscribe(topic, "theirs", "c1")
    await publisher.publish(topic, [Message(b"x%d" % i, "k", {"i": str(i)}) for i in range(3)])
    await consumer.publish(topic, [Message(b"back")])
    for sub in (own, theirs):
        got = await sub.take(4)
        assert offsets(got) == [0, 1, 2, 3]
        assert payloads(got) == [b"x0", b"x1", b"x2", b"back"]
        assert [m.attributes for m in got] == [{"i": "0"}, {"i": "1"}, {"i": "2"}, {}]
        assert [m.routing_key for m in got] == ["k", "k", "k", None]
        await sub.ack(got)


# -- dispatch per subscription type ----------------------------------------------------------


async def test_each_exclusive_subscription_gets_every_message(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/two-subs"
    await create_topic(broker.url, topic)
    first = await via.subscribe(topic, "s1", "c1")
    second = await via.subscribe(topic, "s2", "c2")
    await via.publish(topic, numbered(10))
    for sub in (first, second):
        got = await sub.take(10)
        assert offsets(got) == list(range(10))
        assert payloads(got) == [f"m{i}".encode() for i in range(10)]
        await sub.ack(got)


async def test_exclusive_refuses_a_second_consumer_name(broker: Broker, via: ClientSide) -> None:
    topic = "/default/exclusive"
    await create_topic(broker.url, topic)
    holder = await via.subscribe(topic, "s", "c1")
    with pytest.raises(Refused) as refused:
        await via.subscribe(topic, "s", "c2")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "c1" in refused.value.details

    # The refusal does not disturb the holder.
    await via.publish(topic, [Message(b"still mine")])
    got = await holder.take(1)
    assert payloads(got) == [b"still mine"]
    await holder.ack(got)


async def test_exclusive_is_free_again_once_its_consumer_left(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/exclusive-released"
    await create_topic(broker.url, topic)
    holder = await via.subscribe(topic, "s", "c1")
    await via.publish(topic, [Message(b"m0")])
    await holder.ack(await holder.take(1))
    await via.publish(topic, [Message(b"m1")])  # delivered to c1, never acked
    assert payloads(await holder.take(1)) == [b"m1"]
    await holder.close()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECEIVE_TIMEOUT
    while True:
        try:
            successor = await via.subscribe(topic, "s", "c2")
            break
        except Refused as exc:
            # c1's stream ends asynchronously after its close; until then it holds the
            # subscription.
            assert exc.code == grpc.StatusCode.PERMISSION_DENIED
            assert loop.time() < deadline, "c1 still holds the subscription"
            await asyncio.sleep(0.05)
    got = await successor.take(1)
    assert (offsets(got), payloads(got)) == ([1], [b"m1"])


async def test_shared_gives_each_message_to_exactly_one_consumer_round_robin(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/shared"
    await create_topic(broker.url, topic)
    subs = [await via.subscribe(topic, "s", f"c{i}", "shared") for i in range(3)]
    await via.publish(topic, numbered(30))

    got = await take_spread(subs, 30)
    every = sorted(o for bucket in got for o in offsets(bucket))
    assert every == list(range(30))  # each message once, to one consumer
    assert [len(bucket) for bucket in got] == [10, 10, 10]  # round robin
    for sub, bucket in zip(subs, got, strict=True):
        await sub.ack(bucket)
    await asyncio.sleep(0.3)
    assert [sub.available() for sub in subs] == [[], [], []]  # acked: never redelivered


async def test_shared_consumer_leaving_hands_its_unacked_to_the_others(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/shared-leave"
    await create_topic(broker.url, topic)
    leaving, staying = [await via.subscribe(topic, "s", f"c{i}", "shared") for i in range(2)]
    await via.publish(topic, numbered(4))
    left_with, kept = await take_spread([leaving, staying], 4)
    assert len(left_with) == len(kept) == 2
    await staying.ack(kept)
    await leaving.close()  # nothing acked

    handed_over = await staying.take(2)
    assert offsets(handed_over) == offsets(left_with)
    await staying.ack(handed_over)


async def test_failover_standby_takes_over_without_losing_or_repeating_acked(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/failover"
    await create_topic(broker.url, topic)
    active = await via.subscribe(topic, "s", "c1", "failover")
    standby = await via.subscribe(topic, "s", "c2", "failover")
    await via.publish(topic, numbered(5))

    first = await active.take(5)
    assert offsets(first) == [0, 1, 2, 3, 4]
    assert standby.queue.empty()
    await active.ack(first[:3])  # 3 and 4 stay unacknowledged
    await active.close()

    redelivered = await standby.take(2)
    assert offsets(redelivered) == [3, 4]
    assert payloads(redelivered) == [b"m3", b"m4"]
    await via.publish(topic, numbered(3, start=5))
    later = await standby.take(3)
    assert offsets(later) == [5, 6, 7]
    await standby.ack(redelivered + later)


async def test_key_shared_keeps_each_key_on_one_consumer_in_order(
    broker: Broker, via: ClientSide
) -> None:
    topic = "/default/key-shared"
    await create_topic(broker.url, topic)
    subs = [await via.subscribe(topic, "s", f"c{i}", "key_shared") for i in range(2)]
    keys = [f"key-{k}" for k in range(20)]
    await via.publish(
        topic, [Message(f"{key}/{round_}".encode(), key) for round_ in range(3) for key in keys]
    )

    got = await take_spread(subs, 60)
    owner: dict[str, set[int]] = defaultdict(set)
    per_key: dict[str, list[int]] = defaultdict(list)
    for index, bucket in enumerate(got):
        for m in bucket:
            assert m.routing_key == m.payload.decode().split("/")[0]
            owner[m.routing_key].add(index)
            per_key[m.routing_key].append(m.offset)
    assert set(owner) == set(keys)
    assert all(len(consumers) == 1 for consumers in owner.values()), dict(owner)
    assert all(seq == sorted(seq) and len(seq) == 3 for seq in per_key.values())
    assert all(bucket for bucket in got), "20 keys all hashed to one consumer"
    for sub, bucket in zip(subs, got, strict=True):
        await sub.ack(bucket)


async def test_key_shared_honours_key_filters(broker: Broker, via: ClientSide) -> None:
    topic = "/default/key-filters"
    await create_topic(broker.url, topic)
    europe = await via.subscribe(topic, "s", "eu", "key_shared", ["eu-*"])
    america = await via.subscribe(topic, "s", "us", "key_shared", ["us-*", "ca-?"])
    keys = ["eu-west", "us-east", "eu-north", "ca-1", "us-west", "eu-south"]
    await via.publish(
        topic, [Message(f"{key}/{round_}".encode(), key) for round_ in range(3) for key in keys]
    )

    got_eu, got_us = await take_spread([europe, america], 18)
    assert sorted({m.routing_key for m in got_eu}) == ["eu-north", "eu-south", "eu-west"]
    assert sorted({m.routing_key for m in got_us}) == ["ca-1", "us-east", "us-west"]
    assert len(got_eu) == len(got_us) == 9
    await europe.ack(got_eu)
    await america.ack(got_us)


# -- bad input ---------------------------------------------------------------------------------

#: Longer than the WAL frame's 16-bit length fields hold.
TOO_LONG_KEY = "k" * 70_000
#: (An empty name is refused by danube-client itself, before any request: test_bad_input.py.)
BAD_TOPICS = ["no-slash", "/a", "/a/b/c", "/a/b c", "/default/", "//t", "/default/t!"]
BAD_MESSAGES = {
    "oversize": (Message(b"b" * 1001), "max_payload_bytes"),
    # Payload, attributes (6 bytes) and producer name "p1" (2) together: one byte over 1000.
    "over in all": (Message(b"b" * 993, None, {"k1": "v", "k2": "v"}), "max_payload_bytes"),
    "attributes": (Message(b"c", None, {"k1": "v", "k2": "v", "k3": "v"}), "max_attributes"),
    "attribute key": (Message(b"d", None, {TOO_LONG_KEY: "v"}), "attribute key"),
    "routing key": (Message(b"e", "r" * 70_000), "routing key"),
    "routing key utf-8": (Message(b"f", "\u20ac" * 21_846), "routing key"),  # 65,538 bytes
    # Far over the limit (beyond it plus gRPC's framing allowance): still read and refused as
    # INVALID_ARGUMENT, not RESOURCE_EXHAUSTED (which the clients retry for ever).
    "huge": (Message(b"g" * (2 * 1024 * 1024)), "max_payload_bytes"),
}


async def test_bad_messages_are_refused_before_an_offset_is_used(
    make_broker: BrokerFactory, open_side: OpenSide
) -> None:
    broker = await make_broker(**{"limits.max_payload_bytes": 1000, "limits.max_attributes": 2})
    via = await open_side(broker.url)
    topic = "/default/limits"
    await create_topic(broker.url, topic)
    sub = await via.subscribe(topic, "s", "c1")
    # Exactly at both limits: the payload, attributes (6 bytes) and producer name (2) together
    # make 1000 bytes.
    await via.publish(topic, [Message(b"a" * 992, None, {"k1": "v", "k2": "v"})])
    assert payloads(await sub.take(1)) == [b"a" * 992]
    wal_bytes = broker.store.wal_bytes()
    for name, (bad, needle) in BAD_MESSAGES.items():
        with pytest.raises(Refused) as refused:
            await asyncio.wait_for(via.publish(topic, [bad]), RECEIVE_TIMEOUT)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert needle in refused.value.details, (name, refused.value.details)
        assert len(refused.value.details) < 1000, name
    assert broker.store.wal_bytes() == wal_bytes  # nothing stored
    # No offset was used: the next message is offset 1.
    await via.publish(topic, [Message(b"next")])
    got = await sub.take(1)
    assert (offsets(got), payloads(got)) == ([1], [b"next"])
    await sub.ack(got)


async def test_malformed_topic_names_are_refused_and_create_nothing(
    broker: Broker, via: ClientSide, etcd_server: str, etcd_prefix: str
) -> None:
    for topic in BAD_TOPICS:
        with pytest.raises(Refused) as refused:
            await via.publish(topic, [Message(b"x")])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, topic
        assert repr(topic) in refused.value.details, (topic, refused.value.details)
        with pytest.raises(Refused) as refused:
            await via.subscribe(topic, "s", "c")
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, topic
        assert repr(topic) in refused.value.details, (topic, refused.value.details)
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.list_topics() == []
        assert await records.list_clients() == []


@pytest.mark.parametrize(
    ("topic", "subscription", "consumer", "code", "needle"),
    [
        ("/default/bad-sub", "a/b", "c", grpc.StatusCode.INVALID_ARGUMENT, "subscription"),
        ("/default/bad-sub", "s", "n" * 256, grpc.StatusCode.INVALID_ARGUMENT, "consumer name"),
        ("/default/nowhere", "s", "c", grpc.StatusCode.NOT_FOUND, "/default/nowhere"),
    ],
    ids=["subscription", "consumer name", "missing topic"],
)
async def test_bad_subscribes_are_refused_and_create_nothing(
    broker: Broker,
    via: ClientSide,
    etcd_server: str,
    etcd_prefix: str,
    topic: str,
    subscription: str,
    consumer: str,
    code: grpc.StatusCode,
    needle: str,
) -> None:
    await create_topic(broker.url, "/default/bad-sub")
    with pytest.raises(Refused) as refused:
        await via.subscribe(topic, subscription, consumer)
    assert refused.value.code == code
    assert needle in refused.value.details, refused.value.details
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.get_topic("/default/nowhere") is None
        assert await records.list_subscriptions("/default/bad-sub") == []


async def test_subscription_type_mismatch_is_refused(broker: Broker, via: ClientSide) -> None:
    topic = "/default/types"
    await create_topic(broker.url, topic)
    await via.subscribe(topic, "s", "c1", "exclusive")
    with pytest.raises(Refused) as refused:
        await via.subscribe(topic, "s", "c2", "shared")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "Exclusive" in refused.value.details


# -- durability --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_acknowledged_messages_survive_sigkill_and_restart(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, open_side: OpenSide
) -> None:
    """Everything acknowledged before the daemon (a child process) is SIGKILLed is delivered,
    in order and once, by the restarted daemon; its offsets go on after them."""
    topic = "/default/durable"
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=4)
    await asyncio.to_thread(broker.start)
    try:
        before = await open_side(broker.url)
        await create_topic(broker.url, topic)
        await (await before.subscribe(topic, "s", "c1")).close()
        await asyncio.gather(
            before.publish(topic, [Message(b"a%d" % i) for i in range(200)], producer="pa"),
            before.publish(topic, [Message(b"b%d" % i) for i in range(200)], producer="pb"),
        )
        await before.close()
        broker.kill()
        await asyncio.to_thread(broker.start)

        after = await open_side(broker.url)
        sub = await after.subscribe(topic, "s", "c1")
        got = await sub.take(400, timeout=30)
        assert offsets(got) == list(range(400))
        assert [m.payload for m in got if m.payload[:1] == b"a"] == [b"a%d" % i for i in range(200)]
        assert [m.payload for m in got if m.payload[:1] == b"b"] == [b"b%d" % i for i in range(200)]
        await after.publish(topic, [Message(b"later")], producer="pa")
        assert offsets(await sub.take(1)) == [400]
        await sub.ack(got)
    finally:
        broker.kill()
