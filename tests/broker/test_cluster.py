"""Two daemons on one etcd: lookup redirects, takeover after a crash or a clean shutdown,
and fencing of a paused owner.

Both brokers run as child processes (``BrokerProcess``) on a real etcd, under one fresh key
prefix; the clients are the real danube-client and raw ``danube.proto`` stubs.
Storage is ``local_only``: a new owner cannot read what the old one stored, so every test
settles (acks, cursor in etcd) what the old owner holds before taking the topic over.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.jumps import read_jumps
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import MemoryKV
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.metadata.progress import ProgressUpdater
from danube_ingest.metadata.session import BrokerSession
from danube_ingest.testing import BrokerProcess

from .conftest import StartProcess
from .pair import (
    TOPIC,
    cursor_of,
    danube_client,
    exclusive_consumer,
    lookup,
    next_messages,
    owner_of,
    reliable_producer,
    reserved_end,
    wait_connect,
    wait_cursor,
)
from .support import LEASE_TTL


def _assert_no_errors(*brokers: BrokerProcess) -> None:
    for broker in brokers:
        text = broker.log_text()
        assert " ERROR " not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.slow
async def test_lookup_redirects_and_a_crashed_owner_is_taken_over(
    start_process: StartProcess, kv: EtcdKV, keys: Keys
) -> None:
    a = await start_process("broker-a")
    b = await start_process("broker-b")

    # The topic is created through A: A owns it (epoch 1).
    via_a = await danube_client(a.url)
    producer_a = await reliable_producer(via_a, "p1")
    assert await owner_of(kv, keys) == {"broker": "broker-a", "url": a.url, "epoch": 1}
    on_a = await lookup(a.url)
    assert on_a.response_type == pb.TopicLookupResponse.Connect
    assert (on_a.connect_url, on_a.broker_url) == (a.url, a.url)
    on_b = await lookup(b.url)
    assert on_b.response_type == pb.TopicLookupResponse.Redirect
    assert (on_b.connect_url, on_b.broker_url) == (a.url, a.url)
    assert on_b.request_id == 7

    # A client that only knows B's URL is redirected to A for producing and consuming.
    via_b = await danube_client(b.url)
    consumer_b, queue = await exclusive_consumer(via_b)
    producer_b = await reliable_producer(via_b, "p2")
    for i in range(4):
        await producer_a.send(f"a{i}".encode())
        await producer_b.send(f"b{i}".encode())
    before = await next_messages(queue, 8)
    assert [m.payload for m in before] == [f"{p}{i}".encode() for i in range(4) for p in "ab"]
    assert {m.msg_id.broker_addr for m in before} == {a.url}  # served by A
    offsets_a = [m.msg_id.topic_offset for m in before]
    assert offsets_a == sorted(set(offsets_a))
    for message in before:
        await consumer_b.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_a[-1] + 1)
    assert await owner_of(kv, keys) == {"broker": "broker-a", "url": a.url, "epoch": 1}
    reserved_a = await reserved_end(kv, keys)
    assert reserved_a > offsets_a[-1]

    # Crash A. Its clients are bound to A's URL (danube-client looks up again only there),
    # so they stop with it; new ones, built on B's URL, take over.
    a.kill(signal.SIGKILL)
    for old in (producer_a, producer_b):
        await old.close()
    await consumer_b.close()
    # Until A's lease expires B still redirects to A; then a lookup makes B the owner.
    response, took, seen = await wait_connect(b.url)
    assert seen and set(seen) == {pb.TopicLookupResponse.Redirect}
    assert took < LEASE_TTL + 3
    assert (response.connect_url, response.broker_url) == (b.url, b.url)
    assert await owner_of(kv, keys) == {"broker": "broker-b", "url": b.url, "epoch": 2}

    fresh = await danube_client(b.url)
    consumer, queue = await exclusive_consumer(fresh)
    producer = await reliable_producer(fresh, "p1")
    for i in range(5):
        await producer.send(f"n{i}".encode())
    after = await next_messages(queue, 5)
    assert [m.payload for m in after] == [f"n{i}".encode() for i in range(5)]
    assert {m.msg_id.broker_addr for m in after} == {b.url}
    # B serves the producer id A issued to "p1" (ids are persisted in etcd).
    assert {m.msg_id.producer_id for m in after} == {before[0].msg_id.producer_id}
    offsets_b = [m.msg_id.topic_offset for m in after]
    assert offsets_b == sorted(set(offsets_b))
    # B continues after A's reserved block: no offset A may have assigned is reused, and B
    # recorded the jump (local_only: B knows of no offset, not even A's in its own WAL).
    assert offsets_b[0] >= reserved_a > max(offsets_a)
    jumps = [(j.start, j.end, j.broker, j.epoch) for j in await read_jumps(kv, keys, TOPIC)]
    assert jumps == [(0, reserved_a, "broker-b", 2)]
    for message in after:
        await consumer.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_b[-1] + 1)
    await producer.close()
    await consumer.close()
    _assert_no_errors(a, b)
    print(f"B took over {took:.1f}s after A's SIGKILL; offsets {offsets_a} then {offsets_b}")


@pytest.mark.slow
async def test_clean_shutdown_releases_topics_at_once(
    start_process: StartProcess, kv: EtcdKV, keys: Keys
) -> None:
    a = await start_process("broker-a")
    b = await start_process("broker-b")
    via_a = await danube_client(a.url)
    producer_a = await reliable_producer(via_a, "p1")
    consumer_a, queue = await exclusive_consumer(via_a)
    for i in range(5):
        await producer_a.send(f"a{i}".encode())
    before = await next_messages(queue, 5)
    offsets_a = [m.msg_id.topic_offset for m in before]
    for message in before:
        await consumer_a.ack(message)
    reserved_a = await reserved_end(kv, keys)

    # SIGTERM right after the acks (the cursor is written debounced, ~1 s): shutdown flushes
    # the cursor and releases the topic, with the clients still connected.
    stopping = time.monotonic()
    await asyncio.to_thread(a.stop)
    stop_took = time.monotonic() - stopping
    assert a.process is not None and a.process.returncode == 0, a.log_text()[-3000:]
    assert stop_took < 10, "shutdown took longer than its 5 s grace period"
    assert await owner_of(kv, keys) is None
    assert await cursor_of(kv, keys, "s1") == offsets_a[-1] + 1
    await producer_a.close()
    await consumer_a.close()

    # B takes the topic on the first lookup: no lease to wait for.
    response = await lookup(b.url)
    assert response.response_type == pb.TopicLookupResponse.Connect
    assert await owner_of(kv, keys) == {"broker": "broker-b", "url": b.url, "epoch": 2}
    via_b = await danube_client(b.url)
    consumer, queue = await exclusive_consumer(via_b)
    producer = await reliable_producer(via_b, "p1")
    for i in range(3):
        await producer.send(f"b{i}".encode())
    after = await next_messages(queue, 3)
    assert [m.payload for m in after] == [b"b0", b"b1", b"b2"]  # nothing acked comes again
    assert after[0].msg_id.topic_offset >= reserved_a > max(offsets_a)
    await producer.close()
    await consumer.close()
    _assert_no_errors(a, b)
    print(f"A's clean shutdown took {stop_took:.2f}s")


class _GatedRefreshKV(MemoryKV):
    """A MemoryKV whose lease refreshes wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.refreshing = asyncio.Event()
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def refresh_lease(self, lease_id: int) -> int:
        self.refreshing.set()
        await self.gate
        return await super().refresh_lease(lease_id)


# Python 3.11's asyncio.wait_for returns the awaited result instead of raising CancelledError
# when the call completed just as the waiting task was cancelled (cpython gh-86296). A
# background loop built on it survived its cancel: a SIGTERMed broker hung in stop() for good
# (its session even registered again after the topics were released). Seen once in
# test_clean_shutdown_releases_topics_at_once; these two reproduce it deterministically.


async def test_session_close_returns_when_a_refresh_completes_as_it_is_cancelled() -> None:
    kv = _GatedRefreshKV()
    session = BrokerSession(kv, Keys("/session-close"), "b1", "http://b1:6650", ttl=3)
    await session.start()
    await asyncio.wait_for(kv.refreshing.wait(), 5)  # the keepalive waits in a refresh
    kv.gate.set_result(None)
    await asyncio.sleep(0)  # the refresh has completed; the keepalive has not resumed yet
    closing = time.monotonic()
    # close() cancels the keepalive right now, in this step. (A timeout around it would not
    # show a hang: close() suppresses the CancelledError and returns.)
    async with asyncio.timeout(5):
        await session.close()
    assert time.monotonic() - closing < 2.5, "close() waited for a keepalive that went on"
    assert not session.alive
    assert await kv.get(Keys("/session-close").broker("b1")) is None


async def test_progress_close_returns_when_woken_as_it_is_cancelled() -> None:
    kv = MemoryKV()
    keys = Keys("/progress-close")
    ownership = Ownership(kv, keys, BrokerSession(kv, keys, "b1", "http://b1:6650"))
    progress = ProgressUpdater(ownership, interval=60, max_pending=2)
    progress.set(TOPIC, "k1", b"1")
    await asyncio.sleep(0.01)  # the updater waits for the interval or for more values
    progress.set(TOPIC, "k2", b"2")  # enough values: it is woken
    await asyncio.sleep(0)  # its wait has completed; it has not resumed yet
    closing = time.monotonic()
    async with asyncio.timeout(5):
        await progress.close()
    assert time.monotonic() - closing < 2.5, "close() waited for an updater that went on"


@pytest.mark.slow
async def test_paused_owner_is_fenced_and_its_clients_move_over(
    start_process: StartProcess, kv: EtcdKV, keys: Keys
) -> None:
    a = await start_process("broker-a")
    b = await start_process("broker-b")
    # Clients that know only A; danube-client's default retry options.
    via_a = await danube_client(a.url)
    producer = await reliable_producer(via_a, "p1")
    consumer, queue = await exclusive_consumer(via_a)
    for i in range(3):
        await producer.send(f"a{i}".encode())
    before = await next_messages(queue, 3)
    offsets_a = [m.msg_id.topic_offset for m in before]
    for message in before[:2]:
        await consumer.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_a[2])
    reserved_a = await reserved_end(kv, keys)
    producer_id = before[0].msg_id.producer_id

    # Pause A with one more ack pending in its progress updater (written after ~1 s).
    await consumer.ack(before[2])
    a.kill(signal.SIGSTOP)
    try:
        response, took, _ = await wait_connect(b.url)
        assert took >= 0.5  # B had to wait for A's lease
        assert response.connect_url == b.url
        owner_b = {"broker": "broker-b", "url": b.url, "epoch": 2}
        assert await owner_of(kv, keys) == owner_b
        owner_key = await kv.get(keys.topic_owner(TOPIC))
        assert owner_key is not None
        taken_over = owner_key.mod_revision

        # A publish sent straight to A while it is paused: answered once A runs again.
        channel = grpc.aio.insecure_channel(a.url.removeprefix("http://"))
        stub = pb_grpc.ProducerServiceStub(channel)
        stale_send = asyncio.ensure_future(
            stub.SendMessage(
                pb.StreamMessage(
                    request_id=99,
                    msg_id=pb.MsgID(producer_id=producer_id, topic_name=TOPIC),
                    payload=b"stale",
                    producer_name="p1",
                ),
                timeout=20,
            )
        )
        stale_lookup = asyncio.create_task(lookup(a.url))
        await asyncio.sleep(0.3)
    finally:
        a.kill(signal.SIGCONT)

    # A must not serve the topic as its owner any more.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stale_send
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    lookup_a = await stale_lookup
    assert lookup_a.response_type == pb.TopicLookupResponse.Redirect, lookup_a
    assert (lookup_a.connect_url, lookup_a.broker_url) == (b.url, b.url)
    await channel.close()
    await asyncio.sleep(1.5)  # A's pending cursor write had its chance
    assert await owner_of(kv, keys) == owner_b
    # A's fenced cursor write did not land (nothing to redeliver on B in local_only mode).
    assert await cursor_of(kv, keys, "s1") == offsets_a[2]
    # Since the takeover, A wrote nothing to etcd but its own new registration (B recorded
    # the offsets it jumped over when it loaded the topic: below A's reservation, and, as the
    # owner now, its WAL's durable end of the topic; A's durable end is not written again).
    written = await kv.get_prefix(keys.prefix + "/")
    jump = keys.storage_jump(TOPIC, 0)
    assert {e.key for e in written if e.mod_revision > taken_over} <= {
        keys.broker("broker-a"),
        jump,
        keys.storage_durable_end(TOPIC, "broker-b"),
    }
    assert [(j.start, j.end, j.broker) for j in await read_jumps(kv, keys, TOPIC)] == [
        (0, reserved_a, "broker-b")
    ]
    assert "topic ownership lost topic=" + TOPIC in a.log_text()

    # The same client objects move over to B: the producer after its retries (its new
    # lookup, on A, redirects to B), the consumer after A's health check answers CLOSE.
    moved = time.monotonic()
    for i in range(3):
        await asyncio.wait_for(producer.send(f"b{i}".encode()), 30)
    after = await next_messages(queue, 3)
    consumer_took = time.monotonic() - moved
    assert [m.payload for m in after] == [b"b0", b"b1", b"b2"]
    assert {m.msg_id.broker_addr for m in after} == {b.url}
    offsets_b = [m.msg_id.topic_offset for m in after]
    assert offsets_b == sorted(set(offsets_b))
    assert offsets_b[0] >= reserved_a > max(offsets_a)
    for message in after:
        await consumer.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_b[-1] + 1)
    assert await owner_of(kv, keys) == owner_b
    await producer.close()
    await consumer.close()
    _assert_no_errors(a, b)
    print(f"B took over {took:.1f}s after SIGSTOP; old clients on B within {consumer_took:.1f}s")
