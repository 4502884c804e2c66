"""The batch path across a daemon crash (SIGKILL of a child process, then a restart): every
acknowledged batch is there, and an idempotent producer's re-sent batches are stored once and
answered with their first offsets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from crc32c import crc32c

from danube_ingest.client import Consumer, Producer, SubType, new_producer_id
from danube_ingest.proto import ingest_pb2 as ipb
from danube_ingest.proto import ingest_pb2_grpc as ipb_grpc
from danube_ingest.testing import BrokerProcess
from danube_ingest.wal.block import encode_block
from danube_ingest.wal.framing import Entry

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(120)]

TOPIC = "/default/batch-restart"
LEASE_TTL = 4


def batch_request(pid: int, seq: int, n: int = 50) -> Any:
    block, sizes = encode_block([Entry(b"%d-%d" % (seq, i)) for i in range(n)])
    return ipb.PublishRequest(
        topic=TOPIC,
        producer_id=pid,
        sequence=seq,
        count=n,
        entries=block,
        sizes=sizes,
        crc32c=crc32c(block),
        request_id=seq,
    )


async def publish(url: str, requests: list[Any]) -> list[Any]:
    """Send ``requests`` on one stream; their answers, in request order."""
    async with grpc.aio.insecure_channel(url.split("://")[-1]) as channel:
        call = ipb_grpc.IngestServiceStub(channel).Publish()  # type: ignore[no-untyped-call]
        for request in requests:
            await call.write(request)
        answers = {}
        while len(answers) < len(requests):
            answer = await asyncio.wait_for(call.read(), 30)
            answers[answer.request_id] = answer
        await call.done_writing()
    return [answers[r.request_id] for r in requests]


async def test_acked_batches_survive_sigkill_and_resends_are_stored_once(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    pid = new_producer_id()
    try:
        first = await publish(broker.url, [batch_request(pid, seq) for seq in range(10)])
        assert [(a.code, a.base_offset, a.count) for a in first] == [
            (0, 50 * seq, 50) for seq in range(10)
        ]
        # Batches from a producer whose answers are "lost": acked, then the daemon dies.
        other = new_producer_id()
        async with Producer(broker.url, TOPIC, max_batch_messages=100) as producer:
            futures = [await producer.send(b"p%d" % i) for i in range(300)]
            sent = await asyncio.gather(*futures)
        broker.kill()
        await asyncio.to_thread(broker.start)

        # The same batches again (a producer retrying after a timeout): stored once, answered
        # with their first offsets; the next sequence continues after them.
        again = await publish(broker.url, [batch_request(pid, seq) for seq in (8, 9, 10)])
        assert [(a.code, a.base_offset, a.duplicate) for a in again[:2]] == [
            (0, 400, True),
            (0, 450, True),
        ]
        assert (again[2].code, again[2].duplicate) == (0, False)
        assert again[2].base_offset == 500 + 300
        gap = (await publish(broker.url, [batch_request(other, 3)]))[0]
        assert gap.code == 0  # a producer the topic never saw may start anywhere

        async with Consumer(broker.url, TOPIC, "check", start="earliest") as consumer:
            seen: list[Entry] = []
            while len(seen) < 500 + 300 + 50 + 50:
                delivered = await consumer.receive(timeout=30)
                seen.extend(delivered.entries)
                consumer.ack(delivered)
        assert [e.offset for e in seen] == list(range(len(seen)))
        assert [e.payload for e in seen[500:800]] == [b"p%d" % i for i in range(300)]
        assert sent == list(range(500, 800))
        assert seen[400].producer_id == pid and seen[400].request_id == 8
    finally:
        broker.kill()


async def test_a_producer_sending_through_a_crash_stores_every_message_once(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """The client resends unanswered batches with their sequences after the daemon comes back:
    every send resolves, and the topic holds each message exactly once, in send order."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    try:
        async with Producer(
            broker.url, TOPIC, max_batch_messages=200, linger_ms=1, max_in_flight=4
        ) as producer:
            futures = []
            for i in range(3000):
                futures.append(await producer.send(b"%d" % i))
                if i == 1500:
                    broker.kill()  # (some batches answered, some written and not answered)
                    await asyncio.to_thread(broker.start)
            offsets = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert offsets == sorted(offsets) and len(set(offsets)) == 3000
        async with Consumer(broker.url, TOPIC, "check", start="earliest") as consumer:
            seen: list[Entry] = []
            while len(seen) < offsets[-1] + 1:
                batch = await consumer.receive(timeout=30)
                seen.extend(batch.entries)
                consumer.ack(batch)
        payloads = [e.payload for e in seen]
        assert payloads == [b"%d" % i for i in range(3000)]
        assert [seen[o].payload for o in offsets] == payloads
    finally:
        broker.kill()


@pytest.mark.parametrize("sub_type", ["exclusive", "shared"])
async def test_a_consumer_resumes_after_its_acks_through_a_crash(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, sub_type: SubType
) -> None:
    """The daemon dies under a consuming ``Consumer`` and comes back: the consumer subscribes
    again by itself and goes on after what it acknowledged. Every message is returned exactly
    once (acks lost with the old stream, or not yet in the restarted daemon's cursor, are
    redelivered by the daemon and recognised by the consumer), and those it did not ack are
    returned again."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    n = 3000
    try:
        async with Producer(broker.url, TOPIC, max_batch_messages=100) as producer:
            await asyncio.gather(*[await producer.send(b"m%d" % i) for i in range(n)])
        consumer = Consumer(
            broker.url, TOPIC, "resume", sub_type=sub_type, start="earliest", max_batch=100
        )
        async with consumer:
            returned: list[int] = []
            unacked: list[int] = []
            while len(set(returned)) < n:
                batch = await consumer.receive(timeout=60)
                returned.extend(batch.offsets)
                if len(returned) >= 1000 and not unacked:
                    # The last batch is not acked; the daemon dies while the stream is open.
                    unacked = batch.offsets
                    broker.kill()
                    await asyncio.to_thread(broker.start)
                    continue
                consumer.ack(batch)
        assert consumer.reconnects >= 1
        assert unacked and all(returned.count(o) == 2 for o in unacked)
        acked = [o for o in returned if o not in unacked]
        assert sorted(acked) == sorted(set(range(n)) - set(unacked))  # each exactly once
        if sub_type == "exclusive":
            assert acked == sorted(acked)
        payloads = {}
        async with Consumer(broker.url, TOPIC, "check", start="earliest") as check:
            while len(payloads) < n:
                got = await check.receive(timeout=30)
                payloads.update((e.offset, e.payload) for e in got.entries)
                check.ack(got)
        assert [payloads[o] for o in range(n)] == [b"m%d" % i for i in range(n)]
    finally:
        broker.kill()


async def test_send_many_through_a_crash_stores_every_message_once(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """``send_many`` batches take the same retry path: calls made before, across and after a
    SIGKILL all resolve, and the topic holds each message exactly once, in call order."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    try:
        async with Producer(broker.url, TOPIC, max_batch_messages=200, max_in_flight=4) as producer:
            futures = []
            for call in range(15):
                futures.append(
                    await producer.send_many([b"%d" % (call * 200 + i) for i in range(200)])
                )
                if call == 7:
                    broker.kill()  # (some batches answered, some written and not answered)
                    await asyncio.to_thread(broker.start)
            ranges = await asyncio.wait_for(asyncio.gather(*futures), 60)
        offsets = [o for call in ranges for r in call for o in r]
        assert offsets == sorted(offsets) and len(set(offsets)) == 3000
        async with Consumer(broker.url, TOPIC, "check", start="earliest") as consumer:
            seen: list[Entry] = []
            while len(seen) < offsets[-1] + 1:
                batch = await consumer.receive(timeout=30)
                seen.extend(batch.entries)
                consumer.ack(batch)
        payloads = [e.payload for e in seen]
        assert payloads == [b"%d" % i for i in range(3000)]
        assert [seen[o].payload for o in offsets] == payloads
    finally:
        broker.kill()
