"""Who receives (``dispatch.membership``): a Shared or KeyShared consumer that subscribed but
never opened its stream gets nothing; the consumers whose stream is open get every message,
promptly. Through a real broker and the real danube-client, and the subscriptions on their
own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from danube import SubType

from danube_ingest.broker.server import Broker
from danube_ingest.dispatch import SubscriptionType
from danube_ingest.dispatch.nonreliable import NonReliableTopic
from danube_ingest.testing import broker_config, running_broker
from danube_ingest.wal import Entry
from tests.broker.support import Clients, offsets

from .conftest import FAST, Harness, settle_loop, take

#: Messages published while one consumer never opens its stream (the defect report's count).
COUNT = 46
#: Seconds the streaming consumer may take to receive all of them: promptly, far below the
#: broker's ack timeout and idle sweep (which would eventually free stuck messages).
PROMPT = 5.0


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    config = broker_config(tmp_path / "b1", etcd_server, prefix=f"/t{uuid.uuid4().hex[:12]}")
    async with running_broker(config) as started:
        yield started


@pytest.mark.etcd
@pytest.mark.parametrize("sub_type", [SubType.SHARED, SubType.KEY_SHARED])
async def test_a_consumer_without_a_stream_gets_none_of_a_shared_subscriptions_messages(
    broker: Broker, sub_type: SubType
) -> None:
    """danube-client: consumer ``idle`` subscribes and never calls ``receive``; consumer
    ``reader`` receives. Every message goes to ``reader`` within PROMPT seconds; once ``idle``
    opens its stream it gets the next messages' share."""
    topic = "/default/members"
    async with Clients(broker.url) as clients:
        producer = await clients.producer(topic)
        idle = (
            clients.client.new_consumer()
            .with_topic(topic)
            .with_consumer_name("idle")
            .with_subscription("s")
            .with_subscription_type(sub_type)
            .build()
        )
        await idle.subscribe()  # (no receive: its stream never opens)
        reader = await clients.consumer(topic, "s", "reader", sub_type)
        for i in range(COUNT):
            await producer.send_with_key(f"m{i}".encode(), None, f"k{i}")
        got = await reader.take(COUNT, timeout=PROMPT)
        assert sorted(offsets(got)) == list(range(COUNT))
        await reader.ack_all(got)

        # Once its stream opens, the idle consumer takes part like any other.
        idle_queue = await idle.receive()
        for i in range(COUNT, 2 * COUNT):
            await producer.send_with_key(f"m{i}".encode(), None, f"k{i}")
        async with asyncio.timeout(PROMPT):
            late: list[int] = []
            while len(late) < COUNT:
                if not reader.queue.empty():
                    message = reader.queue.get_nowait()
                    await reader.consumer.ack(message)
                elif not idle_queue.empty():
                    message = idle_queue.get_nowait()
                    await idle.ack(message)
                else:
                    await asyncio.sleep(0.01)
                    continue
                late.append(message.msg_id.topic_offset)
        assert sorted(late) == list(range(COUNT, 2 * COUNT))
        await idle.close()


@pytest.mark.parametrize("sub_type", [SubscriptionType.SHARED, SubscriptionType.KEY_SHARED])
async def test_reliable_subscription_gives_nothing_to_a_handle_nobody_reads(
    harness: Harness, sub_type: SubscriptionType
) -> None:
    """The rule in the subscription itself: a handle attached with ``receiving=False`` (the
    broker's Subscribe) is given entries only once its stream opens."""
    sub = harness.subscribe("s", sub_type, policy=FAST)
    idle = sub.attach(1, "idle", receiving=False)
    reader = sub.attach(2, "reader", receiving=False)
    await harness.publish(10, keys=[f"k{i}" for i in range(10)])
    got = await take(reader, 10)
    assert sorted(d.entry.offset for d in got) == list(range(10))
    assert (idle.queued, idle.in_flight, idle.receiving) == (0, 0, False)
    idle.open_stream()
    await harness.publish(10, keys=[f"k{i}" for i in range(10, 20)])
    await settle_loop()
    assert idle.queued > 0 and reader.queued > 0
    assert idle.queued + reader.queued == 10


@pytest.mark.parametrize("sub_type", [SubscriptionType.SHARED, SubscriptionType.KEY_SHARED])
async def test_non_reliable_shared_skips_a_handle_nobody_reads(sub_type: SubscriptionType) -> None:
    topic = NonReliableTopic("/default/nr")
    sub = topic.subscription("s", sub_type)
    idle = sub.attach(1, "idle", receiving=False)
    reader = sub.attach(2, "reader", receiving=False)
    waiting = asyncio.ensure_future(reader.next())  # (its stream opens)
    await asyncio.sleep(0)
    for i in range(6):
        topic.publish(Entry(b"x", producer_name="p", routing_key=f"k{i}"))
    assert (await waiting).entry.offset == 0
    assert reader.queued == 5 and idle.queued == 0
    await topic.close()
