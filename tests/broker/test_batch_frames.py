"""Frame-level delivery over the wire: the batch ``Consumer`` of an Exclusive or Failover
subscription gets runs of stored entries, and what a consumer held comes back from its first
unacknowledged offset when it dies, is taken over, or shares the subscription with a
danube-client consumer (``dispatch/reliable.py``, ``broker/batch.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.broker.topics import CONSUMER_STALL_SECONDS
from danube_ingest.client import Consumer, Producer
from danube_ingest.dispatch import ReliableSubscription

from .clients import BatchSide, DanubeSide, Message
from .support import eventually

pytestmark = pytest.mark.etcd

TIMEOUT = 10.0

#: A batch consumer in a child process: receives ``N`` messages, acks up to ``ACK_UPTO``
#: (cumulatively), says so, and waits to be killed.
CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from danube_ingest.client import Batch, Consumer

    async def main(url, topic, n, ack_upto):
        consumer = Consumer(url, topic, "s", consumer_name="child", sub_type="failover",
                            start="earliest", max_batch=100)
        got = 0
        async with consumer:
            while got < n:
                batch = await consumer.receive(timeout=20)
                got += len(batch.entries)
                upto = [e for e in batch.entries if e.offset <= ack_upto]
                if upto:  # (cumulative: up to the last of them, maybe inside a frame)
                    consumer.ack(Batch(topic, upto[-1:]))
            print("received", got, flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    """
)


def _subscription(broker: Broker, topic: str) -> ReliableSubscription:
    assert broker.manager is not None
    sub = broker.manager._subscription_of(topic, "s")
    assert isinstance(sub, ReliableSubscription)
    return sub


async def _publish(broker: Broker, topic: str, count: int) -> None:
    async with Producer(broker.url, topic, max_batch_messages=250, linger_ms=1) as producer:
        futures = [await producer.send(b"%d" % i) for i in range(count)]
        await asyncio.gather(*futures)


async def _receive(consumer: Consumer, count: int, timeout: float = TIMEOUT) -> list[int]:
    got: list[int] = []
    while len(got) < count:
        batch = await consumer.receive(timeout=timeout)
        got.extend(batch.offsets)
        consumer.ack(batch)
    return got


@pytest.mark.slow
async def test_a_killed_batch_consumers_frames_go_to_the_next_from_its_first_unacked(
    broker: Broker,
) -> None:
    topic = "/default/frames-killed"
    await _publish(broker, topic, 1000)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, broker.url, topic, "1000", "299"],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "received 1000"
        sub = _subscription(broker, topic)
        await eventually(lambda: sub.cursor == 300, "the child's acks up to 299")
        assert sub.consumers[0].in_flight == 700  # held as frames, not one by one
        assert not sub.consumers[0]._window
        standby = Consumer(
            broker.url, topic, "s", consumer_name="standby", sub_type="failover", max_batch=100
        )
        async with standby:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            # (The daemon sees the killed stream as a stalled consumer: CONSUMER_STALL_SECONDS.)
            stall = CONSUMER_STALL_SECONDS + TIMEOUT
            got = await asyncio.wait_for(_receive(standby, 700, stall), 2 * stall)
            assert got == list(range(300, 1000))  # from the first unacked, each once, in order
            await eventually(lambda: sub.cursor == 1000, "the standby's acks")
        assert sub.stats.redelivered == 0  # a consumer leaving is not a failed delivery
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


async def test_takeover_by_a_second_batch_consumer_of_the_same_name(broker: Broker) -> None:
    topic = "/default/frames-takeover"
    await _publish(broker, topic, 500)
    first = Consumer(broker.url, topic, "s", start="earliest", max_batch=100, reconnect=False)
    await first.__aenter__()
    try:
        got = 0
        while got < 500:
            batch = await first.receive(timeout=TIMEOUT)
            got += len(batch.entries)
            if batch.offsets[-1] < 150:
                first.ack(batch)
        sub = _subscription(broker, topic)
        await eventually(lambda: sub.cursor == 100, "the first consumer's acks")
        async with Consumer(broker.url, topic, "s", max_batch=100) as second:
            assert await asyncio.wait_for(_receive(second, 400), 30) == list(range(100, 500))
            await eventually(lambda: sub.cursor == 500, "the second consumer's acks")
    finally:
        await first.close()


async def test_a_mixed_failover_subscription_hands_over_to_a_danube_consumer(
    broker: Broker,
) -> None:
    topic = "/default/frames-mixed"
    batch_side, danube_side = BatchSide(broker.url), DanubeSide(broker.url)
    await batch_side.open()
    await danube_side.open()
    try:
        await batch_side.publish(topic, [Message(b"first")])
        batch = await batch_side.subscribe(topic, "s", "batch", "failover")
        single = await danube_side.subscribe(topic, "s", "single", "failover")
        await batch_side.publish(topic, [Message(b"%d" % i) for i in range(20)])
        first = await batch.take(20)
        assert [m.offset for m in first] == list(range(1, 21))
        await batch.ack(first[:8])
        sub = _subscription(broker, topic)
        await eventually(lambda: sub.cursor == 9, "the batch consumer's acks")
        assert not single.available()
        await batch.close()
        rest = await single.take(12)
        assert [m.offset for m in rest] == list(range(9, 21))
        await single.ack(rest)
        await eventually(lambda: sub.cursor == 21, "the danube consumer's acks")
        await batch_side.publish(topic, [Message(b"x%d" % i) for i in range(5)])
        assert [m.offset for m in await single.take(5)] == list(range(21, 26))
    finally:
        await danube_side.close()
        await batch_side.close()
