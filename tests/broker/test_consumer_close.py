"""A danube-client consumer that closes leaves its subscription promptly.

``Consumer.close()`` cancels the client's receive loop. When that loop was reading the stream,
the ``ReceiveMessages`` call is cancelled and the broker detaches the consumer at once. When it
was waiting for room in the application's queue (the application stopped reading, 100 messages
buffered), the call stays open: the broker then notices that the consumer holds messages without
acking any or health-checking (``topics.CONSUMER_STALL_SECONDS``), detaches it and ends its
stream. Either way a Shared subscription gives the closed consumer's unacknowledged and all
further messages to the consumers that remain, well before the 30 s ack timeout and idle
timeout would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from danube import SubType

from danube_ingest.broker.server import Broker
from danube_ingest.broker.topics import CONSUMER_STALL_SECONDS

from .support import Clients, Subscribed, eventually

pytestmark = pytest.mark.etcd

TOPIC = "/default/closing"
#: danube-client's receive queue holds 100 messages; its loop then waits for room.
CLIENT_QUEUE = 100


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


def _drain(sub: Subscribed, into: list[bytes]) -> None:
    while not sub.queue.empty():
        into.append(sub.queue.get_nowait().payload)


@pytest.mark.parametrize(
    "sent_before",
    [
        pytest.param(10, id="receive-loop-reading"),
        pytest.param(
            4 * CLIENT_QUEUE, id="receive-loop-waiting-for-queue-room", marks=pytest.mark.slow
        ),
    ],
)
async def test_a_closed_shared_consumer_leaves_its_messages_to_the_others(
    clients: Clients, sent_before: int
) -> None:
    producer = await clients.producer(TOPIC, "p1")
    leaving = await clients.consumer(TOPIC, "s1", "c1", SubType.SHARED)
    staying = await clients.consumer(TOPIC, "s1", "c2", SubType.SHARED)
    for i in range(sent_before):
        await producer.send(f"a{i}".encode())
    # Round robin: each consumer gets its share. The leaving consumer's application reads
    # nothing (with enough messages its queue fills up) and acknowledges nothing.
    kept: list[bytes] = []
    share = min(sent_before // 2, CLIENT_QUEUE)

    def shared_out() -> bool:
        _drain(staying, kept)
        return leaving.queue.qsize() >= share and len(kept) >= sent_before // 2

    await eventually(shared_out, "both consumers' shares", 10)
    await leaving.consumer.close()
    loop = asyncio.get_running_loop()
    closed_at = loop.time()
    for i in range(20):
        await producer.send(f"b{i}".encode())

    # The staying consumer gets everything: what the closed one held, and every new message.
    expected = {f"a{i}".encode() for i in range(sent_before)} | {
        f"b{i}".encode() for i in range(20)
    }
    limit = CONSUMER_STALL_SECONDS + 8  # a health check may have come 5 s before the close
    got = set(kept)
    try:
        async with asyncio.timeout(limit):
            while not expected <= got:
                got.add((await staying.queue.get()).payload)
    except TimeoutError:
        raise AssertionError(
            f"{len(expected - got)} messages still missing at the remaining consumer {limit}s "
            f"after the other closed: {sorted(expected - got)[:10]}..."
        ) from None
    print(f"everything reached the remaining consumer {loop.time() - closed_at:.2f}s after close")
