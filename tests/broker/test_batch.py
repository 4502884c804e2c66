"""The batch path (danube_ingest.v1.IngestService) against a real broker over loopback gRPC:
publish and consume with danube_ingest.client, visibility to and from danube-client, each
subscription type, and bad batches refused before any offset is assigned."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from crc32c import crc32c
from danube import SubType

from danube_ingest.broker.server import Broker
from danube_ingest.client import Batch, ConsumeError, Consumer, Producer, new_producer_id
from danube_ingest.client import SubType as BatchSubType
from danube_ingest.proto import ingest_pb2 as ipb
from danube_ingest.proto import ingest_pb2_grpc as ipb_grpc
from danube_ingest.wal.block import encode_block
from danube_ingest.wal.framing import Entry
from tests.broker.support import Clients

from .conftest import BrokerFactory

pytestmark = pytest.mark.etcd

TIMEOUT = 10.0


async def receive(consumer: Consumer, n: int, ack: bool = True) -> list[Entry]:
    got: list[Entry] = []
    while len(got) < n:
        batch = await consumer.receive(timeout=TIMEOUT)
        got.extend(batch.entries)
        if ack:
            consumer.ack(batch)
    return got


async def test_published_batches_are_consumed_in_order_with_their_offsets(broker: Broker) -> None:
    topic = "/default/batch-order"
    async with Producer(broker.url, topic, max_batch_messages=100, linger_ms=1) as producer:
        futures = [await producer.send(f"m{i}".encode(), routing_key="k") for i in range(250)]
        offsets = await asyncio.gather(*futures)
    assert offsets == list(range(250))
    async with Consumer(broker.url, topic, "s", start="earliest", max_batch=64) as consumer:
        got = await receive(consumer, 250)
    assert [e.offset for e in got] == list(range(250))
    assert [e.payload for e in got] == [f"m{i}".encode() for i in range(250)]
    assert got[0].routing_key == "k" and got[0].ingest_ms > 0


async def test_batch_published_messages_reach_danube_client_and_back(broker: Broker) -> None:
    topic = "/default/batch-cross"
    async with Clients(broker.url) as clients:
        danube_producer = await clients.producer(topic)
        sub = await clients.consumer(topic, "danube-sub", "c1")
        async with Producer(broker.url, topic) as producer:
            sent = [
                await producer.send(b"batch-%d" % i, attributes={"i": str(i)}) for i in range(3)
            ]
            await asyncio.gather(*sent)
        await danube_producer.send(b"danube", {})
        got = await sub.take(4)
        assert [m.payload for m in got] == [b"batch-0", b"batch-1", b"batch-2", b"danube"]
        assert [m.msg_id.topic_offset for m in got] == [0, 1, 2, 3]
        assert dict(got[1].attributes) == {"i": "1"}
        await sub.ack_all(got)
    async with Consumer(broker.url, topic, "batch-sub", start="earliest") as consumer:
        entries = await receive(consumer, 4)
    assert [e.payload for e in entries] == [b"batch-0", b"batch-1", b"batch-2", b"danube"]


async def test_shared_consumers_split_and_ack_ranges(broker: Broker) -> None:
    topic = "/default/batch-shared"
    async with Producer(broker.url, topic, max_batch_messages=10) as producer:
        await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(200)])
    a = Consumer(
        broker.url, topic, "s", consumer_name="a", sub_type="shared", start="earliest", max_batch=7
    )
    b = Consumer(broker.url, topic, "s", consumer_name="b", sub_type="shared", max_batch=7)
    async with a, b:
        seen: list[int] = []

        async def drain(consumer: Consumer) -> None:
            try:
                while True:
                    batch = await consumer.receive(timeout=1.0)
                    seen.extend(batch.offsets)
                    consumer.ack(batch)
            except TimeoutError:
                return

        await asyncio.gather(drain(a), drain(b))
    assert sorted(seen) == list(range(200))  # each once: acked ranges are never redelivered


@pytest.mark.parametrize("sub_type", ["exclusive", "failover"])
async def test_a_second_exclusive_or_failover_consumer_gets_nothing(
    broker: Broker, sub_type: BatchSubType
) -> None:
    topic = f"/default/batch-{sub_type}"
    async with Producer(broker.url, topic) as producer:
        await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(20)])
    first = Consumer(broker.url, topic, "s", consumer_name="a", sub_type=sub_type, start="earliest")
    async with first:
        assert [e.offset for e in await receive(first, 20)] == list(range(20))
        second = Consumer(broker.url, topic, "s", consumer_name="b", sub_type=sub_type)
        if sub_type == "exclusive":
            with pytest.raises(ConsumeError, match="PERMISSION_DENIED"):
                await second.start()
            await second.close()
        else:
            async with second:
                with pytest.raises(TimeoutError):
                    await second.receive(timeout=0.5)


async def test_key_shared_consumers_get_their_keys(broker: Broker) -> None:
    topic = "/default/batch-keys"
    async with Producer(broker.url, topic) as producer:
        await (await producer.send(b"creates the topic", routing_key="none"))
    a = Consumer(
        broker.url, topic, "s", consumer_name="a", sub_type="key_shared", key_filters=["red*"]
    )
    b = Consumer(
        broker.url, topic, "s", consumer_name="b", sub_type="key_shared", key_filters=["blue*"]
    )
    async with a, b:
        async with Producer(broker.url, topic, max_batch_messages=5) as producer:
            keys = ["red", "blue"] * 10
            await asyncio.gather(*[await producer.send(b"x", routing_key=k) for k in keys])
        got_a = await receive(a, 10)
        got_b = await receive(b, 10)
    assert {e.routing_key for e in got_a} == {"red"}
    assert {e.routing_key for e in got_b} == {"blue"}


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture
async def stream(make_broker: BrokerFactory) -> AsyncIterator[tuple[Broker, Any]]:
    broker = await make_broker(**{"limits.max_payload_bytes": 1000, "limits.max_attributes": 2})
    async with grpc.aio.insecure_channel(broker.url.split("://")[-1]) as channel:
        yield broker, ipb_grpc.IngestServiceStub(channel).Publish()  # type: ignore[no-untyped-call]


def request(messages: list[Entry], topic: str = "/default/bad", **fields: Any) -> Any:
    block, sizes = encode_block(messages)
    values: dict[str, Any] = {
        "topic": topic,
        "count": len(messages),
        "entries": block,
        "sizes": sizes,
        "crc32c": crc32c(block),
    }
    values.update(fields)
    return ipb.PublishRequest(**values)


def corrupt(entries: list[Entry]) -> Any:
    req = request(entries)
    block = bytearray(req.entries)
    struct.pack_into("<I", block, 51, 5000)  # the first payload length: past its entry
    req.entries, req.crc32c = bytes(block), crc32c(bytes(block))
    return req


BAD = [
    ("oversize", lambda: request([Entry(b"x"), Entry(b"y" * 1001)]), "max_payload_bytes"),
    (
        "over in all",
        # (992 + 6 bytes of attributes + 2 of producer name make 1000: one byte over.)
        lambda: request([Entry(b"y" * 993, attributes={"k1": "v", "k2": "v"}, producer_name="p1")]),
        "bounds all of them",
    ),
    (
        "attributes",
        lambda: request([Entry(b"", attributes={"a": "", "b": "", "c": ""})]),
        "max_attributes",
    ),
    ("topic name", lambda: request([Entry(b"x")], topic="no-namespace"), "topic"),
    ("crc", lambda: request([Entry(b"x")], crc32c=1), "CRC32C"),
    ("corrupt block", lambda: corrupt([Entry(b"x"), Entry(b"y")]), "does not match its header"),
    ("wrong count", lambda: request([Entry(b"x"), Entry(b"y")], count=3), "sizes holds 8 bytes"),
    (
        "no messages",
        lambda: request([Entry(b"x")], count=0, entries=b"", sizes=b"", crc32c=0),
        "at least one message",
    ),
    ("producer id", lambda: request([Entry(b"x")], producer_id=5), "bit 63"),
    ("compression", lambda: request([Entry(b"x")], compression=1), "decompress"),
]


async def test_bad_batches_are_refused_per_batch_before_any_offset(
    stream: tuple[Broker, Any],
) -> None:
    broker, call = stream
    await call.write(request([Entry(b"first")]))
    ok = await call.read()
    assert (ok.code, ok.base_offset, ok.count) == (0, 0, 1)
    store = broker.manager._store
    wal_bytes = store.wal_bytes()
    for i, (name, make, needle) in enumerate(BAD):
        req = make()
        req.request_id = i + 1
        await call.write(req)
        answer = await call.read()
        assert answer.request_id == i + 1, name
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (name, answer.error)
        assert needle in answer.error, (name, answer.error)
    # Nothing was stored, no offset was used: the next batch continues at 1.
    assert store.wal_bytes() == wal_bytes
    await call.write(request([Entry(b"second")], request_id=99))
    ok = await call.read()
    assert (ok.request_id, ok.code, ok.base_offset) == (99, 0, 1)
    await call.done_writing()


async def test_sequence_rules_over_the_wire(stream: tuple[Broker, Any]) -> None:
    _broker, call = stream
    pid = new_producer_id()

    async def send(seq: int) -> Any:
        await call.write(request([Entry(b"s%d" % seq)], producer_id=pid, sequence=seq))
        return await call.read()

    assert (await send(0)).base_offset == 0
    assert (await send(1)).base_offset == 1
    again = await send(0)
    assert (again.code, again.base_offset, again.duplicate) == (0, 0, True)
    gap = await send(5)
    assert gap.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "resend sequence 2" in gap.error
    assert (await send(2)).base_offset == 2
    await call.done_writing()


async def test_danube_client_subscription_types_see_batches(broker: Broker) -> None:
    topic = "/default/batch-to-shared"
    async with Clients(broker.url) as clients:
        await clients.producer(topic)  # creates the topic
        sub = await clients.consumer(topic, "s", "c1", SubType.SHARED)
        async with Producer(broker.url, topic) as producer:
            await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(10)])
        got = await sub.take(10)
        assert sorted(m.msg_id.topic_offset for m in got) == list(range(10))
        await sub.ack_all(got)


@pytest.mark.parametrize(
    ("topic", "subscription", "name", "needle"),
    [
        ("no-namespace", "s", "c", "topic"),
        ("/default/batch-bad-sub", "a/b", "c", "subscription"),
        ("/default/batch-bad-sub", "s", "n" * 256, "consumer name"),
        ("/default/batch-missing", "s", "c", "does not exist"),
    ],
)
async def test_bad_subscribes_are_refused_and_create_nothing(
    broker: Broker, topic: str, subscription: str, name: str, needle: str
) -> None:
    async with Producer(broker.url, "/default/batch-bad-sub") as producer:
        await (await producer.send(b"x"))
    consumer = Consumer(broker.url, topic, subscription, consumer_name=name)
    with pytest.raises(ConsumeError, match=needle) as refused:
        await consumer.start()
    await consumer.close()
    expected = grpc.StatusCode.NOT_FOUND if "missing" in topic else grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.code == expected
    assert "/default/batch-missing" not in broker.manager._topics


async def test_acks_before_close_are_applied_when_the_receiving_task_was_cancelled(
    broker: Broker,
) -> None:
    """An application's receiving task cancelled at shutdown, then ``close``: the acks it made
    are applied (a cancelled read used to cancel the call and drop them: all redelivered), and
    a ``receive`` that timed out did not break the stream."""
    topic = "/default/batch-close-acks"
    async with Producer(broker.url, topic) as producer:
        await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(300)])
    consumer = Consumer(
        broker.url, topic, "s", consumer_name="a", sub_type="shared", start="earliest"
    )
    await consumer.start()
    got = await receive(consumer, 300, ack=False)
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout=0.2)
    waiting = asyncio.ensure_future(consumer.receive())
    await asyncio.sleep(0.05)
    for entry in got:
        consumer.ack(Batch(topic, [entry]))  # one ack per message
    waiting.cancel()
    await consumer.close()
    assert consumer.reconnects == 0
    async with Consumer(
        broker.url, topic, "s", consumer_name="b", sub_type="shared", start="earliest"
    ) as other:
        with pytest.raises(TimeoutError):
            redelivered = await other.receive(timeout=1.0)
            raise AssertionError(f"acked offsets redelivered: {redelivered.offsets}")
