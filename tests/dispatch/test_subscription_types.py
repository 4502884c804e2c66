"""Who gets what, per subscription type, on reliable subscriptions over a real TopicStore."""

from __future__ import annotations

from collections import defaultdict

import pytest

from danube_ingest.dispatch import (
    ConsumerClosedError,
    DispatchPolicy,
    ManualClock,
    SubscriptionBusyError,
    SubscriptionType,
    SubscriptionTypeMismatchError,
)

from .conftest import FAST, Harness, next_delivery, offsets, quiet, take

EXCLUSIVE = SubscriptionType.EXCLUSIVE
SHARED = SubscriptionType.SHARED
FAILOVER = SubscriptionType.FAILOVER
KEY_SHARED = SubscriptionType.KEY_SHARED

# -- exclusive -------------------------------------------------------------------------------


async def test_each_exclusive_subscription_gets_every_message_in_order(harness: Harness) -> None:
    first = harness.subscribe("first", EXCLUSIVE).attach(1, "a")
    second = harness.subscribe("second", EXCLUSIVE).attach(2, "b")
    await harness.publish(10)
    assert await offsets(first, 10) == list(range(10))
    assert await offsets(second, 10) == list(range(10))


async def test_exclusive_refuses_another_consumer_name(harness: Harness) -> None:
    subscription = harness.subscribe("sub", EXCLUSIVE)
    subscription.attach(1, "a")
    with pytest.raises(SubscriptionBusyError, match="held by consumer 'a'"):
        subscription.attach(2, "b")
    # Another subscription is free, and so is this one once "a" detached.
    harness.subscribe("other", EXCLUSIVE).attach(2, "b")
    assert subscription.detach(1)
    handle = subscription.attach(2, "b")
    await harness.publish(1)
    assert (await next_delivery(handle)).entry.offset == 0


@pytest.mark.parametrize("new_id", [1, 7], ids=["same-id", "new-id"])
async def test_exclusive_takeover_by_the_same_name(harness: Harness, new_id: int) -> None:
    subscription = harness.subscribe("sub", EXCLUSIVE)
    old = subscription.attach(1, "a")
    await harness.publish(4)
    assert await offsets(old, 2) == [0, 1]
    subscription.ack(0)

    new = subscription.attach(new_id, "a")
    with pytest.raises(ConsumerClosedError, match="taken over"):
        await old.next()
    assert subscription.consumers == (new,)
    # What the old handle held (taken or still queued) comes again, not as a failed attempt.
    got = await take(new, 3)
    assert [(d.entry.offset, d.attempt) for d in got] == [(1, 1), (2, 1), (3, 1)]
    await harness.publish(1)
    assert await offsets(new, 1) == [4]
    old.close()  # the old stream's cleanup must not detach the new handle
    assert subscription.consumers == (new,)


@pytest.mark.parametrize("sub_type", [EXCLUSIVE, FAILOVER])
@pytest.mark.parametrize("departure", ["takeover", "detach"])
async def test_a_successor_gets_what_timed_out_in_its_predecessors_hands_in_order(
    harness: Harness, sub_type: SubscriptionType, departure: str
) -> None:
    """Found by the clock-jump fault scenario: a consumer subscribed and never read, so its
    first entries timed out (waiting for their redelivery delay) while later ones were still
    in its window; the consumer taking over got those later ones first."""
    clock = ManualClock()
    subscription = harness.subscribe("sub", sub_type, clock=clock)
    idle = subscription.attach(1, "a")  # subscribed, never takes anything
    await harness.publish(3)
    clock.advance(FAST.ack_timeout_s / 2)
    await harness.publish(3)
    clock.advance(FAST.ack_timeout_s / 2)  # 0-2 timed out: waiting for their delay
    assert subscription.stats.ack_timeouts == 3
    if departure == "takeover":
        new = subscription.attach(1, "a")
    else:
        assert subscription.detach(1)
        new = subscription.attach(2, "a")
    assert idle.closed
    # Before the fix 3-5 came first, and 0-2 only after their delay (this clock stands still).
    first = await take(new, 3)
    assert [(d.entry.offset, d.attempt) for d in first] == [(0, 2), (1, 2), (2, 2)]
    assert await offsets(new, 3) == [3, 4, 5]
    clock.advance(FAST.redelivery_max_s)  # the old delay's timer: nothing comes twice
    await quiet(new)
    assert subscription.ack(0) and subscription.cursor == 1


async def test_a_nacked_entry_keeps_its_delay_when_its_consumer_is_taken_over(
    harness: Harness,
) -> None:
    clock = ManualClock()
    subscription = harness.subscribe("sub", EXCLUSIVE, clock=clock)
    old = subscription.attach(1, "a")
    await harness.publish(2)
    assert await offsets(old, 2) == [0, 1]
    assert subscription.nack(0, delay_ms=10_000)
    new = subscription.attach(1, "a")
    assert await offsets(new, 1) == [1]
    await quiet(new)
    clock.advance(FAST.redelivery_max_s)  # the nack's delay (capped)
    assert await offsets(new, 1) == [0]


async def test_attaching_with_another_type_is_refused(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    subscription.attach(1, "a", sub_type=SHARED)
    with pytest.raises(SubscriptionTypeMismatchError, match="is SHARED"):
        subscription.attach(2, "b", sub_type=EXCLUSIVE)
    assert len(subscription.consumers) == 1


# -- shared ----------------------------------------------------------------------------------


async def test_shared_round_robin_gives_each_message_to_exactly_one_consumer(
    harness: Harness,
) -> None:
    subscription = harness.subscribe("sub", SHARED)
    handles = [subscription.attach(i, f"c{i}") for i in range(3)]
    await harness.publish(30)
    got = {h.consumer_id: await offsets(h, 10) for h in handles}
    await quiet(*handles)
    every = sorted(o for batch in got.values() for o in batch)
    assert every == list(range(30))
    # Round robin: consumer i gets every third message.
    assert got == {i: list(range(i, 30, 3)) for i in range(3)}


async def test_shared_skips_consumers_without_window_room(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED, policy=DispatchPolicy(max_unacked=2))
    busy = subscription.attach(1, "busy")
    idle = subscription.attach(2, "idle")
    await harness.publish(2)
    assert await offsets(busy, 1) == [0]
    assert await offsets(idle, 1) == [1]
    subscription.ack(1)
    await harness.publish(3)
    # busy holds offset 0 and has room for one more; idle takes the rest.
    got_busy = await offsets(busy, 1)
    got_idle = await offsets(idle, 2)
    assert sorted(got_busy + got_idle) == [2, 3, 4]
    assert busy.in_flight == 2
    await quiet(busy, idle)


# -- failover --------------------------------------------------------------------------------


async def test_failover_standby_takes_over_with_nothing_lost(harness: Harness) -> None:
    subscription = harness.subscribe("sub", FAILOVER)
    active = subscription.attach(1, "a")
    standby = subscription.attach(2, "b")
    await harness.publish(5)
    assert await offsets(active, 5) == list(range(5))
    await quiet(standby)
    for offset in (0, 1, 3):
        subscription.ack(offset)

    subscription.detach(1)
    with pytest.raises(ConsumerClosedError):
        await active.next()
    # The standby gets the unacked ones first, in order, then what comes next.
    assert await offsets(standby, 2) == [2, 4]
    await harness.publish(2)
    assert await offsets(standby, 2) == [5, 6]
    for offset in (2, 4, 5, 6):
        subscription.ack(offset)
    assert subscription.cursor == 7
    assert subscription.unacked == 0


async def test_failover_active_reattaching_stays_active(harness: Harness) -> None:
    subscription = harness.subscribe("sub", FAILOVER)
    subscription.attach(1, "a")
    standby = subscription.attach(2, "b")
    again = subscription.attach(1, "a")  # the active consumer reopened its stream
    await harness.publish(2)
    assert await offsets(again, 2) == [0, 1]
    await quiet(standby)


# -- key shared ------------------------------------------------------------------------------


async def test_key_shared_keeps_each_key_on_one_consumer_in_order(harness: Harness) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    handles = [subscription.attach(i, f"c{i}") for i in range(3)]
    keys = [f"key-{i % 12}" for i in range(120)]
    await harness.publish(120, keys=keys)

    by_key: dict[str, set[int]] = defaultdict(set)
    per_key_offsets: dict[str, list[int]] = defaultdict(list)
    total = 0
    for handle in handles:
        while handle.queued:
            delivery = await next_delivery(handle)
            key = delivery.entry.routing_key
            assert key is not None
            by_key[key].add(handle.consumer_id)
            per_key_offsets[key].append(delivery.entry.offset)
            total += 1
    assert total == 120
    assert all(len(consumers) == 1 for consumers in by_key.values()), by_key
    assert all(offs == sorted(offs) for offs in per_key_offsets.values())
    # 12 keys over 3 consumers: every consumer gets some.
    assert len({c for consumers in by_key.values() for c in consumers}) == 3


async def test_key_shared_falls_back_to_producer_name(harness: Harness) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    handles = [subscription.attach(i, f"c{i}") for i in range(4)]
    for producer in ("p1", "p2", "p3", "p4", "p5"):
        await harness.publish(3, producer=producer)
    seen: dict[str, set[int]] = defaultdict(set)
    for handle in handles:
        while handle.queued:
            entry = (await next_delivery(handle)).entry
            seen[entry.producer_name].add(handle.consumer_id)
    assert set(seen) == {"p1", "p2", "p3", "p4", "p5"}
    assert all(len(consumers) == 1 for consumers in seen.values())


async def test_key_shared_honours_filters(harness: Harness) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    orders = subscription.attach(1, "orders", ["order-*"])
    users = subscription.attach(2, "users", ["user-?", "user-[xyz]*"])
    keys = ["order-1", "user-1", "order-22", "user-x9", "user-10", "misc"]
    await harness.publish(len(keys), keys=keys)
    assert await offsets(orders, 2) == [0, 2]
    assert await offsets(users, 2) == [1, 3]
    await quiet(orders, users)
    # "user-10" and "misc" are accepted by nobody: they wait (unsettled) for a consumer that
    # accepts them, instead of being skipped.
    for offset in range(4):
        subscription.ack(offset)
    assert subscription.cursor == 4
    rest = subscription.attach(3, "rest")
    assert await offsets(rest, 2) == [4, 5]
    subscription.ack(4)
    subscription.ack(5)
    assert subscription.cursor == 6


async def test_key_shared_key_stays_with_its_holder_until_settled(harness: Harness) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    first = subscription.attach(1, "first")
    keys = [f"k{i}" for i in range(40)]
    await harness.publish(40, keys=keys)
    assert len(await take(first, 40)) == 40

    # A new consumer takes over part of the key space, but not keys with unacked entries.
    second = subscription.attach(2, "second")
    await harness.publish(40, keys=keys)
    assert len(await take(first, 40)) == 40
    await quiet(second)

    # Once the old entries are settled, keys move by the ring: the newcomer gets its share.
    for offset in range(80):
        subscription.ack(offset)
    await harness.publish(40, keys=keys)
    moved = {(await next_delivery(second)).entry.routing_key for _ in range(second.queued)}
    stayed = {(await next_delivery(first)).entry.routing_key for _ in range(first.queued)}
    assert moved and stayed
    assert moved.isdisjoint(stayed)
    assert moved | stayed == set(keys)


async def test_key_shared_redelivers_a_departed_consumers_keys_in_order(
    harness: Harness,
) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    leaving = subscription.attach(1, "leaving")
    await harness.publish(6, keys=["a", "b", "a", "b", "a", "b"])
    assert await offsets(leaving, 6) == list(range(6))
    staying = subscription.attach(2, "staying")
    subscription.detach(1)
    got = await take(staying, 6)
    by_key: dict[str | None, list[int]] = defaultdict(list)
    for delivery in got:
        by_key[delivery.entry.routing_key].append(delivery.entry.offset)
        assert delivery.attempt == 1
    assert by_key == {"a": [0, 2, 4], "b": [1, 3, 5]}


async def test_key_shared_full_consumer_does_not_stall_other_keys(harness: Harness) -> None:
    policy = DispatchPolicy(max_unacked=2)
    subscription = harness.subscribe("sub", KEY_SHARED, policy=policy)
    a = subscription.attach(1, "a", ["a*"])
    b = subscription.attach(2, "b", ["b*"])
    await harness.publish(4, keys=["a1", "a2", "a3", "b1"])
    assert await offsets(a, 2) == [0, 1]
    # Offset 2 waits for room on "a"; offset 3, behind it, goes to "b" meanwhile.
    assert await offsets(b, 1) == [3]
    await quiet(a, b)
    subscription.ack(0)
    assert await offsets(a, 1) == [2]


async def test_key_shared_takeover_keeps_the_consumers_keys(harness: Harness) -> None:
    subscription = harness.subscribe("sub", KEY_SHARED)
    subscription.attach(1, "a")
    old = subscription.attach(2, "b")
    keys = [f"k{i}" for i in range(20)]
    await harness.publish(20, keys=keys)
    before = {d.entry.routing_key for d in await take(old, old.queued)}
    assert before

    new = subscription.attach(2, "b")  # the consumer reopened its stream
    with pytest.raises(ConsumerClosedError):
        await old.next()
    again = await take(new, len(before))
    assert {d.entry.routing_key for d in again} == before
    assert all(d.attempt == 1 for d in again)
    await harness.publish(20, keys=keys)
    assert {d.entry.routing_key for d in await take(new, new.queued)} == before
