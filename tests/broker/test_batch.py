"""What only the batch path (danube_ingest.v1.IngestService) has, against a real broker over
loopback gRPC: messages split over batches and ranges, bad batches (CRC, layout, count,
producer id, compression) refused per batch before any offset is assigned, sequence rules, and
the client Consumer's stream and acks. Ordering, visibility to and from danube-client, dispatch
per subscription type and bad messages are tested for both clients in test_both_clients.py."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from crc32c import crc32c

from danube_ingest.broker.server import Broker
from danube_ingest.client import Batch, Consumer, Producer, new_producer_id
from danube_ingest.proto import ingest_pb2 as ipb
from danube_ingest.proto import ingest_pb2_grpc as ipb_grpc
from danube_ingest.wal.block import encode_block
from danube_ingest.wal.framing import Entry

from .conftest import BrokerFactory
from .support import metadata

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


#: What only a batch can get wrong (the limits of each message, and names: for both clients in
#: test_both_clients.py), plus one limit case: a bad message refuses its whole batch.
BAD = [
    ("oversize", lambda: request([Entry(b"x"), Entry(b"y" * 1001)]), "max_payload_bytes"),
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
            redelivered = await other.receive(timeout=0.5)
            raise AssertionError(f"acked offsets redelivered: {redelivered.offsets}")


async def test_acks_made_right_before_close_are_all_applied(broker: Broker) -> None:
    """``close`` right after the last ``ack``: the stream is half-closed after the acks and
    the daemon ends it only once it applied them, so the next consumer of the subscription
    starts after them (cancelling the call as soon as the acks left the queue lost some)."""
    topic = "/default/batch-close-at-once"
    async with Producer(broker.url, topic) as producer:
        for round_ in range(20):
            await asyncio.gather(*[await producer.send(b"%d" % i) for i in range(10)])
            consumer = Consumer(broker.url, topic, "s", sub_type="exclusive", start="earliest")
            await consumer.start()
            got = await receive(consumer, 10, ack=False)
            assert [e.offset for e in got] == list(range(10 * round_, 10 * round_ + 10))
            for entry in got:
                consumer.ack(Batch(topic, [entry]))
            await consumer.close()


async def test_an_unknown_subscription_type_is_invalid_and_creates_nothing(
    broker: Broker, etcd_server: str, etcd_prefix: str
) -> None:
    """(No client can send it; Danube's protocol has the same case in test_bad_input.py.)"""
    async with Producer(broker.url, "/default/batch-type") as producer:
        await (await producer.send(b"x"))
    async with grpc.aio.insecure_channel(broker.url.split("://")[-1]) as channel:
        subscribe = ipb.Subscribe(topic="/default/batch-type", subscription="s", type=7)
        call = ipb_grpc.IngestServiceStub(channel).Consume(  # type: ignore[no-untyped-call]
            iter([ipb.ConsumeRequest(subscribe=subscribe)])
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "subscription_type 7" in (refused.value.details() or "")
    async with metadata(etcd_server, etcd_prefix) as records:
        assert await records.list_subscriptions("/default/batch-type") == []


async def test_staged_batches_wait_for_their_fdatasync_without_a_task_each(
    stream: tuple[Broker, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches staged while the WAL's fdatasync is held are answered only after it, each with
    its offsets, and waiting for it costs no asyncio task per batch (the handler answers from
    a done callback on the batch's durability future)."""
    broker, call = stream
    await call.write(request([Entry(b"warm-up")]))
    assert (await call.read()).code == 0
    gate = threading.Event()
    real = os.fdatasync

    def held(fd: int) -> None:
        if threading.current_thread().name.startswith("wal-writer"):
            gate.wait(TIMEOUT)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    tasks = len(asyncio.all_tasks())
    store = broker.manager._store
    batches = 40
    for i in range(batches):
        await call.write(request([Entry(b"a%d" % i), Entry(b"b%d" % i)], request_id=i))
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while store.next_offset("/default/bad") < 1 + 2 * batches:
        assert asyncio.get_running_loop().time() < deadline, "the batches were not staged"
        await asyncio.sleep(0.01)
    first = asyncio.ensure_future(call.read())
    await asyncio.sleep(0.2)
    assert not first.done()  # staged, written maybe, not synced: not answered
    assert len(asyncio.all_tasks()) - tasks < 5  # not one per waiting batch
    gate.set()
    answers = [await first] + [await call.read() for _ in range(batches - 1)]
    assert sorted((a.request_id, a.code, a.base_offset, a.count) for a in answers) == [
        (i, 0, 1 + 2 * i, 2) for i in range(batches)
    ]
    await call.done_writing()
