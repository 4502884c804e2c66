"""Requests a broker must refuse, with the status danube-client expects, and without leaving
anything behind: malformed topic names, unknown ids, strategy mismatches, what the WAL cannot
hold, all through Danube's raw protocol. The bad input both clients can express (limits,
topic and subscription names, type mismatches) is in test_both_clients.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from danube import SchemaType, SubType
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.server import Broker
from danube_ingest.broker.validation import MAX_KEY_FILTER_BYTES, MAX_KEY_FILTERS
from danube_ingest.testing import BrokerProcess

from .support import (
    Clients,
    consumer_request,
    message,
    metadata,
    offsets,
    producer_request,
    raw_stubs,
    rpc_error,
)

BAD_TOPICS = ["no-slash", "/a", "/a/b/c", "/a/b c", "", "/default/", "//t", "/default/t!"]


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


@pytest.mark.parametrize("topic", BAD_TOPICS)
async def test_malformed_topic_names_are_invalid_and_create_nothing(
    broker: Broker, etcd_server: str, etcd_prefix: str, topic: str
) -> None:
    async with raw_stubs(broker.url) as raw:
        calls = {
            "CreateProducer": raw.producers.CreateProducer(producer_request(topic)),
            "CreateProducer(non-reliable)": raw.producers.CreateProducer(
                producer_request(topic, reliable=False)
            ),
            "Subscribe": raw.consumers.Subscribe(consumer_request(topic)),
            "TopicLookup": raw.discovery.TopicLookup(pb.TopicLookupRequest(topic=topic)),
            "TopicPartitions": raw.discovery.TopicPartitions(pb.TopicLookupRequest(topic=topic)),
        }
        for name, call in calls.items():
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert repr(topic) in (error.details() or ""), name
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.list_topics() == []
        assert await records.list_clients() == []


async def test_unknown_producer_id_is_not_found(broker: Broker) -> None:
    async with raw_stubs(broker.url) as raw:
        error = await rpc_error(raw.producers.SendMessage(message(424242, "/default/t")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "424242" in (error.details() or "")


async def test_unknown_consumer_id_is_not_found(broker: Broker) -> None:
    async with raw_stubs(broker.url) as raw:
        stream = raw.consumers.ReceiveMessages(pb.ReceiveRequest(request_id=1, consumer_id=424242))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in stream:
                pass
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert "424242" in (failed.value.details() or "")


async def test_message_for_another_topic_than_the_producers_is_invalid(broker: Broker) -> None:
    async with raw_stubs(broker.url) as raw:
        created = await raw.producers.CreateProducer(producer_request("/default/mine"))
        error = await rpc_error(
            raw.producers.SendMessage(message(created.producer_id, "/default/other"))
        )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("first_reliable", [False, True])
async def test_producer_with_the_other_dispatch_strategy_is_refused(
    clients: Clients, first_reliable: bool
) -> None:
    topic = "/default/strategy"
    await clients.producer(topic, "p1", reliable=first_reliable)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await clients.producer(topic, "p2", reliable=not first_reliable)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_refused_producer_does_not_bind_the_topic_to_its_schema(clients: Clients) -> None:
    topic = "/default/strategy-schema"
    registry = clients.client.schema()
    await (
        registry.register_schema("orders")
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(json.dumps({"type": "object"}).encode())
        .execute()
    )
    await clients.producer(topic, "p1", reliable=False)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await clients.producer(topic, "p2", reliable=True, schema_subject="orders")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as unconfigured:
        await registry.get_topic_schema_config(topic)
    assert unconfigured.value.code() == grpc.StatusCode.NOT_FOUND


async def test_subscribing_to_a_missing_topic_is_not_found_and_creates_nothing(
    broker: Broker, etcd_server: str, etcd_prefix: str
) -> None:
    """(Through both clients: test_both_clients.py.)"""
    async with raw_stubs(broker.url) as raw:
        error = await rpc_error(raw.consumers.Subscribe(consumer_request("/default/nowhere")))
        assert error.code() == grpc.StatusCode.NOT_FOUND
        lookup = await rpc_error(
            raw.discovery.TopicLookup(pb.TopicLookupRequest(topic="/default/nowhere"))
        )
        assert lookup.code() == grpc.StatusCode.NOT_FOUND
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.get_topic("/default/nowhere") is None
        assert await records.list_clients() == []


@pytest.mark.parametrize("subscription", ["", "a/b", "two words", ".."])
async def test_malformed_subscription_name_is_invalid(
    clients: Clients, broker: Broker, etcd_server: str, etcd_prefix: str, subscription: str
) -> None:
    await clients.producer("/default/t")
    async with raw_stubs(broker.url) as raw:
        error = await rpc_error(
            raw.consumers.Subscribe(consumer_request("/default/t", subscription))
        )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.list_subscriptions("/default/t") == []


async def test_unknown_acks_and_nacks_are_ignored(clients: Clients, broker: Broker) -> None:
    """Well-formed names of a topic or subscription that does not exist, or an offset never
    delivered: answered OK and ignored (see test_malformed_acks_and_nacks_are_invalid)."""
    topic = "/default/acks"
    producer = await clients.producer(topic)
    sub = await clients.consumer(topic, "s", "c1")
    unknown = [
        pb.MsgID(topic_name="/default/never", topic_offset=3),  # no such topic
        pb.MsgID(topic_name=topic, topic_offset=99),  # never delivered
    ]
    async with raw_stubs(broker.url) as raw:
        for i, msg_id in enumerate(unknown):
            ack = await raw.consumers.Ack(
                pb.AckRequest(request_id=10 + i, msg_id=msg_id, subscription_name="s")
            )
            assert ack.request_id == 10 + i
            nack = await raw.consumers.Nack(
                pb.NackRequest(request_id=20 + i, msg_id=msg_id, subscription_name="nope")
            )
            assert nack.request_id == 20 + i

    # The subscription is unharmed: offset 0 is still delivered and acked normally.
    await producer.send(b"m0")
    got = await sub.take(1)
    assert offsets(got) == [0]
    await sub.ack_all(got)


@pytest.mark.parametrize(
    ("topic", "subscription", "says"),
    [
        ("garbage", "s", "invalid topic name 'garbage'"),
        ("", "s", "invalid topic name ''"),
        ("/default/acks", "", "names no subscription"),
        ("/default/acks", "a/b", "subscription name 'a/b'"),
        ("/default/acks", "two words", "subscription name 'two words'"),
        ("/default/acks", "s\x00", "control character U+0000"),
        ("/default/acks", "s" * 300, "at most 255 bytes"),
    ],
    ids=["garbage-topic", "no-topic", "no-sub", "slash", "space", "nul", "long"],
)
async def test_malformed_acks_and_nacks_are_invalid(
    clients: Clients, broker: Broker, topic: str, subscription: str, says: str
) -> None:
    """An Ack or Nack naming a topic or subscription that cannot exist is INVALID_ARGUMENT,
    saying which name is wrong, like every other bad field; the subscription is unharmed."""
    good = "/default/acks"
    producer = await clients.producer(good)
    sub = await clients.consumer(good, "s", "c1")
    await producer.send(b"m0")
    got = await sub.take(1)
    msg_id = pb.MsgID(topic_name=topic, topic_offset=0)
    async with raw_stubs(broker.url) as raw:
        calls = {
            "Ack": raw.consumers.Ack(
                pb.AckRequest(request_id=1, msg_id=msg_id, subscription_name=subscription)
            ),
            "Nack": raw.consumers.Nack(
                pb.NackRequest(request_id=2, msg_id=msg_id, subscription_name=subscription)
            ),
        }
        for name, call in calls.items():
            error = await asyncio.wait_for(rpc_error(call), ANSWER)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.details())
            details = error.details() or ""
            assert says in details and len(details) < 1000, (name, details)
    await sub.ack_all(got)
    await producer.send(b"m1")
    assert offsets(await sub.take(1)) == [1]


#: Seconds a refused request may take to be answered (it must never hang).
ANSWER = 10.0
TOO_LONG_KEY = "k" * 70_000  # its length does not fit the WAL frame's 16-bit field


@pytest.mark.parametrize(
    "fields",
    [
        {"attributes": {TOO_LONG_KEY: "v"}},
        {"routing_key": "r" * 70_000},
        {"routing_key": "\u20ac" * 21_846},  # 65,538 UTF-8 bytes in 21,846 characters
        {"attributes": {f"k{i}": "v" * 200_000 for i in range(64)}},  # 12.8 MB of attributes
        {"producer_name": "p" * 256},
        {"producer_name": "p\x00x"},
        {"publish_time": 1 << 63},  # stored as a signed 64-bit integer
    ],
    ids=[
        "attribute key",
        "routing key",
        "routing key utf-8",
        "attributes",
        "name",
        "name-nul",
        "time",
    ],
)
async def test_message_the_log_cannot_hold_is_refused_and_takes_no_offset(
    broker: Broker, fields: dict[str, object]
) -> None:
    """The requests that used to poison the WAL: refused at once, nothing stored, the offsets
    of the messages around them contiguous."""
    topic = "/default/poison"
    async with raw_stubs(broker.url) as raw:
        created = await raw.producers.CreateProducer(producer_request(topic))
        pid = created.producer_id
        await raw.producers.SendMessage(message(pid, topic, b"m0"))
        error = await asyncio.wait_for(
            rpc_error(raw.producers.SendMessage(message(pid, topic, b"bad", **fields))), ANSWER
        )
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert len(error.details() or "") < 1000
        await asyncio.wait_for(raw.producers.SendMessage(message(pid, topic, b"m1")), ANSWER)
    info = broker.store.info(topic)
    assert info is not None and info.high_watermark == 2


async def test_unknown_subscription_type_is_invalid_and_creates_nothing(
    clients: Clients, broker: Broker, etcd_server: str, etcd_prefix: str
) -> None:
    await clients.producer("/default/t")
    async with raw_stubs(broker.url) as raw:
        request = consumer_request("/default/t")
        request.subscription_type = 7
        error = await rpc_error(raw.consumers.Subscribe(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "subscription_type 7" in (error.details() or "")
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.list_subscriptions("/default/t") == []


LONG = "n" * 10_000


@pytest.mark.parametrize("field", ["topic", "producer", "subscription", "consumer", "utf-8"])
async def test_overlong_names_are_invalid_with_a_short_error_text(
    clients: Clients, broker: Broker, etcd_server: str, etcd_prefix: str, field: str
) -> None:
    """Names are bounded (255 UTF-8 bytes), and an error never echoes a whole long name: its
    text travels in a gRPC header, which a 10k name overflowed (the client then saw
    RESOURCE_EXHAUSTED and retried for ever)."""
    topic = "/default/t"
    await clients.producer(topic)
    async with raw_stubs(broker.url) as raw:
        if field == "topic":
            call = raw.producers.CreateProducer(producer_request(f"/default/{LONG}"))
        elif field == "producer":
            call = raw.producers.CreateProducer(producer_request(topic, LONG))
        elif field == "utf-8":  # 128 characters, 256 bytes
            call = raw.producers.CreateProducer(producer_request(topic, "\u00e9" * 128))
        elif field == "subscription":
            call = raw.consumers.Subscribe(consumer_request(topic, LONG))
        else:
            call = raw.consumers.Subscribe(consumer_request(topic, "s", LONG))
        error = await asyncio.wait_for(rpc_error(call), ANSWER)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert 0 < len(error.details() or "") < 1000
    async with metadata(etcd_server, etcd_prefix) as records:
        assert [c.name for c in await records.list_clients()] == ["p1"]
        assert await records.list_subscriptions(topic) == []


def wal_verify(data_dir: Path) -> str:
    """``danube-ingest wal verify`` on a broker's data directory; fails unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", "wal", "verify", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
async def test_poison_request_leaves_a_daemon_that_stops_verifies_and_restarts(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """The issue's scenario with a real daemon: after the request that used to wedge the WAL,
    SIGTERM stops it, ``wal verify`` is clean, and it restarts with its offsets contiguous."""
    topic = "/default/poison"
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix)
    await asyncio.to_thread(broker.start)
    try:
        async with raw_stubs(broker.url) as raw:
            pid = (await raw.producers.CreateProducer(producer_request(topic))).producer_id
            await raw.producers.SendMessage(message(pid, topic, b"m0"))
            poison = message(pid, topic, b"bad", attributes={TOO_LONG_KEY: "v"})
            error = await asyncio.wait_for(rpc_error(raw.producers.SendMessage(poison)), ANSWER)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            await asyncio.wait_for(raw.producers.SendMessage(message(pid, topic, b"m1")), ANSWER)
        await asyncio.to_thread(broker.stop)  # raises if SIGTERM does not stop it in 30 s
        assert f"topic {topic}: offsets 0..1" in wal_verify(broker.data_dir)

        await asyncio.to_thread(broker.start)
        async with raw_stubs(broker.url) as raw:
            await asyncio.wait_for(raw.producers.SendMessage(message(pid, topic, b"m2")), ANSWER)
        await asyncio.to_thread(broker.stop)
        report = wal_verify(broker.data_dir)
        assert f"topic {topic}: offsets 0..2" in report and "gap" not in report
    finally:
        broker.kill()


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("producer", "producer name 'p\\x00' holds the control character U+0000 at index 1"),
        ("consumer", "consumer name 'c\\x01' holds the control character U+0001"),
        ("filters-count", f"{MAX_KEY_FILTERS + 1} key filters; at most {MAX_KEY_FILTERS}"),
        ("filter-size", f"at most {MAX_KEY_FILTER_BYTES} bytes"),
        ("filter-empty", "key filter 1 is empty"),
    ],
)
async def test_control_characters_in_names_and_unbounded_key_filters_are_invalid(
    clients: Clients, broker: Broker, etcd_server: str, etcd_prefix: str, field: str, says: str
) -> None:
    """A producer or consumer name holding NUL (or another control character), and KeyShared
    key filters beyond their bounds (``MAX_KEY_FILTERS`` filters of ``MAX_KEY_FILTER_BYTES``),
    are INVALID_ARGUMENT naming what is wrong, and create nothing."""
    topic = "/default/t"
    await clients.producer(topic)
    filters: list[str] = []
    if field == "filters-count":
        filters = [f"k{i}-*" for i in range(MAX_KEY_FILTERS + 1)]
    elif field == "filter-size":
        filters = ["eu-*", "k" * (MAX_KEY_FILTER_BYTES + 1)]
    elif field == "filter-empty":
        filters = ["eu-*", ""]
    async with raw_stubs(broker.url) as raw:
        if field == "producer":
            call = raw.producers.CreateProducer(producer_request(topic, "p\x00"))
        else:
            request = consumer_request(
                topic, "s", "c\x01" if field == "consumer" else "c", SubType.KEY_SHARED
            )
            request.key_filters.extend(filters)
            call = raw.consumers.Subscribe(request)
        error = await asyncio.wait_for(rpc_error(call), ANSWER)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    details = error.details() or ""
    assert says in details and len(details) < 1000, details
    async with metadata(etcd_server, etcd_prefix) as records:
        assert [c.name for c in await records.list_clients()] == ["p1"]
        assert await records.list_subscriptions(topic) == []


async def test_key_filters_within_the_bounds_are_accepted(broker: Broker) -> None:
    """The most filters of the longest size a KeyShared consumer may give are accepted."""
    topic = "/default/t"
    async with raw_stubs(broker.url) as raw:
        await raw.producers.CreateProducer(producer_request(topic))
        request = consumer_request(topic, "s", "c", SubType.KEY_SHARED)
        request.key_filters.extend(
            [f"{i:02d}-" + "k" * (MAX_KEY_FILTER_BYTES - 4) + "*" for i in range(MAX_KEY_FILTERS)]
        )
        subscribed = await raw.consumers.Subscribe(request)
    assert subscribed.consumer_id
