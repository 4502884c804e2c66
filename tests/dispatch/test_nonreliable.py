"""Non-reliable topics: live fan-out to subscriptions, bounded consumer queues."""

from __future__ import annotations

from collections import defaultdict

import pytest

from danube_ingest.dispatch import (
    ConsumerClosedError,
    NonReliableSubscription,
    NonReliableTopic,
    SubscriptionBusyError,
    SubscriptionType,
    SubscriptionTypeMismatchError,
)
from danube_ingest.wal import Entry

from .conftest import TOPIC, next_delivery, offsets, quiet

EXCLUSIVE = SubscriptionType.EXCLUSIVE
SHARED = SubscriptionType.SHARED
FAILOVER = SubscriptionType.FAILOVER
KEY_SHARED = SubscriptionType.KEY_SHARED


def publish(topic: NonReliableTopic, count: int, key: str | None = None) -> list[int]:
    return [topic.publish(Entry(b"m%d" % i, routing_key=key)) for i in range(count)]


async def test_topic_fans_out_to_every_live_subscription() -> None:
    topic = NonReliableTopic(TOPIC)
    publish(topic, 2)  # nobody listens: gone
    first = topic.subscription("first", EXCLUSIVE).attach(1, "a")
    second = topic.subscription("second", EXCLUSIVE).attach(2, "b")
    assert publish(topic, 5) == [2, 3, 4, 5, 6]
    assert topic.high_watermark == 7
    assert await offsets(first, 5) == [2, 3, 4, 5, 6]
    assert await offsets(second, 5) == [2, 3, 4, 5, 6]
    await topic.close()
    with pytest.raises(ConsumerClosedError):
        await first.next()


async def test_subscription_keeps_its_type() -> None:
    topic = NonReliableTopic(TOPIC)
    subscription = topic.subscription("sub", SHARED)
    assert topic.subscription("sub", SHARED) is subscription
    with pytest.raises(SubscriptionTypeMismatchError):
        topic.subscription("sub", FAILOVER)
    await topic.remove_subscription("sub")
    assert topic.subscription("sub", FAILOVER).sub_type is FAILOVER


async def test_shared_spreads_and_acks_are_no_ops() -> None:
    topic = NonReliableTopic(TOPIC)
    subscription = topic.subscription("sub", SHARED)
    handles = [subscription.attach(i, f"c{i}") for i in range(3)]
    publish(topic, 9)
    got = {h.consumer_id: await offsets(h, 3) for h in handles}
    assert got == {i: list(range(i, 9, 3)) for i in range(3)}
    assert not subscription.ack(0)
    assert not subscription.nack(1, 0, "ignored")
    await quiet(*handles)


async def test_full_queue_drops_for_that_consumer_only() -> None:
    topic = NonReliableTopic(TOPIC, queue_size=2)
    slow = topic.subscription("slow", EXCLUSIVE).attach(1, "slow")
    fast = topic.subscription("fast", EXCLUSIVE).attach(2, "fast")
    for i in range(5):
        topic.publish(Entry(b"m%d" % i))
        assert (await next_delivery(fast)).entry.offset == i
    assert slow.dropped == 3
    assert fast.dropped == 0
    assert topic.subscriptions["slow"].dropped == 3
    assert await offsets(slow, 2) == [0, 1]


async def test_failover_and_exclusive_rules_apply() -> None:
    subscription = NonReliableSubscription("sub", TOPIC, FAILOVER)
    active = subscription.attach(1, "a")
    standby = subscription.attach(2, "b")
    assert subscription.deliver(Entry(b"x", offset=0))
    assert await offsets(active, 1) == [0]
    await quiet(standby)
    active.close()
    assert subscription.deliver(Entry(b"y", offset=1))
    assert await offsets(standby, 1) == [1]

    exclusive = NonReliableSubscription("ex", TOPIC, EXCLUSIVE)
    old = exclusive.attach(1, "a")
    with pytest.raises(SubscriptionBusyError):
        exclusive.attach(2, "b")
    new = exclusive.attach(3, "a")
    with pytest.raises(ConsumerClosedError, match="taken over"):
        await old.next()
    assert exclusive.consumers == (new,)


async def test_key_shared_routes_by_key_and_counts_unrouted() -> None:
    topic = NonReliableTopic(TOPIC)
    subscription = topic.subscription("sub", KEY_SHARED)
    a = subscription.attach(1, "a", ["a-*"])
    other = subscription.attach(2, "other", ["b-*", "c-*"])
    keys = ["a-1", "b-1", "a-2", "c-9", "z-1", "a-1"]
    for i, key in enumerate(keys):
        topic.publish(Entry(b"m%d" % i, routing_key=key))
    routed: dict[int, list[str | None]] = defaultdict(list)
    for handle in (a, other):
        while handle.queued:
            routed[handle.consumer_id].append((await next_delivery(handle)).entry.routing_key)
    assert routed == {1: ["a-1", "a-2", "a-1"], 2: ["b-1", "c-9"]}
    assert subscription.unrouted == 1
