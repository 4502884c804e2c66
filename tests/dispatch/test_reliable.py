"""Reliable dispatch: acks and the cursor, redelivery, poison policies, flow control, restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from danube_ingest.dispatch import (
    ConsumerClosedError,
    DispatchPolicy,
    ManualClock,
    PoisonPolicy,
    ReliableSubscription,
    SubscriptionType,
)
from danube_ingest.errors import ConfigError
from danube_ingest.store import TopicStore
from danube_ingest.wal import Entry

from .conftest import FAST, TOPIC, Harness, next_delivery, offsets, quiet, take

EXCLUSIVE = SubscriptionType.EXCLUSIVE
SHARED = SubscriptionType.SHARED

# -- where a subscription starts ---------------------------------------------------------------


async def test_new_subscription_starts_at_the_high_watermark(harness: Harness) -> None:
    await harness.publish(3)
    subscription = harness.subscribe("sub", EXCLUSIVE, start=None)
    assert subscription.cursor == 3
    handle = subscription.attach(1, "a")
    await quiet(handle)
    await harness.publish(2)
    assert await offsets(handle, 2) == [3, 4]


async def test_subscription_of_an_unknown_topic_starts_at_zero(harness: Harness) -> None:
    subscription = harness.subscribe("sub", EXCLUSIVE, start=None, topic="/default/new")
    handle = subscription.attach(1, "a")
    await harness.publish(1, topic="/default/new")
    assert await offsets(handle, 1) == [0]


# -- acks and the cursor -----------------------------------------------------------------------


async def test_out_of_order_acks_advance_the_cursor_past_contiguous_acks(
    harness: Harness,
) -> None:
    subscription = harness.subscribe("sub", SHARED)
    handle = subscription.attach(1, "a")
    await harness.publish(5)
    assert await offsets(handle, 5) == list(range(5))

    assert subscription.ack(2) and subscription.ack(4)
    assert subscription.cursor == 0
    assert subscription.ack(0)
    assert subscription.cursor == 1
    assert subscription.ack(1)
    assert subscription.cursor == 3
    assert subscription.ack(3)
    assert subscription.cursor == 5
    assert harness.cursors["sub"] == [1, 3, 5]
    # Duplicate and unknown acks are ignored.
    assert not subscription.ack(3)
    assert not subscription.ack(99)
    assert subscription.cursor == 5
    assert subscription.stats.acked == 5
    assert handle.in_flight == 0


async def test_a_range_ack_settles_like_single_acks_and_dispatches_once(
    harness: Harness,
) -> None:
    """``ack_many`` (a batch consumer's range ack): the same settled set, cursor and counts as
    acking one by one; unknown and settled offsets ignored; the window refills after it."""
    policy = DispatchPolicy(ack_timeout_s=30, max_unacked=4)
    subscription = harness.subscribe("sub", SHARED, policy=policy)
    handle = subscription.attach(1, "a")
    await harness.publish(10)
    assert await offsets(handle, 4) == [0, 1, 2, 3]
    assert subscription.ack_many([1, 3, 99]) == 2
    assert subscription.cursor == 0 and handle.in_flight == 2
    assert await offsets(handle, 2) == [4, 5]  # the window refilled
    assert subscription.ack_many(range(0, 6)) == 4  # 1 and 3 are settled already
    assert subscription.cursor == 6
    assert harness.cursors["sub"] == [6]  # the cursor moved once, to its final place
    assert subscription.stats.acked == 6
    assert await offsets(handle, 4) == [6, 7, 8, 9]
    assert subscription.ack_many([]) == 0
    await subscription.close()
    assert subscription.ack_many([6, 7]) == 0  # closed: its successor redelivers them


async def test_ack_of_a_queued_delivery_withdraws_it(harness: Harness) -> None:
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a")
    await harness.publish(3)
    assert handle.queued == 3
    subscription.ack(1)
    assert await offsets(handle, 2) == [0, 2]


# -- nack, ack timeout, backoff ----------------------------------------------------------------


async def test_nack_redelivers_the_same_offset_with_the_next_attempt(harness: Harness) -> None:
    clock = ManualClock()
    policy = DispatchPolicy(nack_base_delay_s=0.5, redelivery_base_s=0.1, redelivery_max_s=10)
    subscription = harness.subscribe("sub", EXCLUSIVE, policy=policy, clock=clock)
    handle = subscription.attach(1, "a")
    await harness.publish(2)
    first, _ = await take(handle, 2)
    assert (first.entry.offset, first.attempt) == (0, 1)

    assert subscription.nack(0, delay_ms=0, reason="busy")
    assert not subscription.nack(0)  # no longer delivered: a second nack is ignored
    assert handle.in_flight == 1
    clock.advance(0.49)  # the nack base delay (0.5 s) is the floor
    await quiet(handle)
    clock.advance(0.02)
    again = await next_delivery(handle)
    assert (again.entry.offset, again.attempt, again.entry.payload) == (0, 2, first.entry.payload)

    # A longer requested delay wins; a delay beyond the cap is capped.
    subscription.nack(1, delay_ms=3_000)
    subscription.nack(0, delay_ms=60_000)
    clock.advance(2.99)
    await quiet(handle)
    clock.advance(0.02)
    assert [(d.entry.offset, d.attempt) for d in await take(handle, 1)] == [(1, 2)]
    clock.advance(7)
    assert [(d.entry.offset, d.attempt) for d in await take(handle, 1)] == [(0, 3)]
    assert subscription.stats.nacked == 3
    assert subscription.stats.redelivered == 3


async def test_ack_timeout_redelivers(harness: Harness) -> None:
    policy = DispatchPolicy(ack_timeout_s=0.2, redelivery_base_s=0.02)
    subscription = harness.subscribe("sub", SHARED, policy=policy)
    handle = subscription.attach(1, "a")
    loop = asyncio.get_running_loop()
    published = loop.time()
    await harness.publish(2)
    assert await offsets(handle, 2) == [0, 1]
    subscription.ack(1)
    again = await next_delivery(handle)
    assert (again.entry.offset, again.attempt) == (0, 2)
    assert loop.time() - published >= 0.2 + 0.02
    assert subscription.stats.ack_timeouts == 1
    assert subscription.ack(0)
    assert subscription.cursor == 2


async def test_late_ack_settles_a_message_waiting_for_redelivery(harness: Harness) -> None:
    clock = ManualClock()
    subscription = harness.subscribe("sub", SHARED, clock=clock)
    handle = subscription.attach(1, "a")
    await harness.publish(1)
    await take(handle, 1)
    clock.advance(FAST.ack_timeout_s)  # timed out: waits for its redelivery delay
    assert subscription.stats.ack_timeouts == 1
    assert subscription.ack(0)
    clock.advance(10)
    await quiet(handle)
    assert subscription.cursor == 1


async def test_redelivery_backoff_doubles_up_to_the_cap(harness: Harness) -> None:
    clock = ManualClock()
    policy = DispatchPolicy(
        ack_timeout_s=5,
        nack_base_delay_s=0,
        redelivery_base_s=1,
        redelivery_max_s=8,
        max_redeliveries=10,
    )
    subscription = harness.subscribe("sub", SHARED, policy=policy, clock=clock)
    handle = subscription.attach(1, "a")
    await harness.publish(1)
    await take(handle, 1)
    delays = []
    for attempt in range(1, 7):
        subscription.nack(0)
        waited = 0.0
        while not handle.queued:
            clock.advance(0.25)
            waited += 0.25
            await asyncio.sleep(0)
        delivery = await next_delivery(handle)
        assert delivery.attempt == attempt + 1
        delays.append(waited)
    assert delays == [1, 2, 4, 8, 8, 8]

    # Ack timeouts back off the same way: 5 s timeout, then backoff(7) = 8 s.
    clock.advance(5)
    assert subscription.stats.ack_timeouts == 1
    clock.advance(7.9)
    await quiet(handle)
    clock.advance(0.1)
    assert (await next_delivery(handle)).attempt == 8


# -- poison policies ---------------------------------------------------------------------------


async def fail_until_poisoned(
    subscription: ReliableSubscription, clock: ManualClock, offset: int, deliveries: int
) -> None:
    handle = subscription.consumers[0]
    for attempt in range(1, deliveries + 1):
        while not handle.queued:
            clock.advance(1)
            await asyncio.sleep(0)
        delivery = await next_delivery(handle)
        assert (delivery.entry.offset, delivery.attempt) == (offset, attempt)
        subscription.nack(offset, reason=f"failure {attempt}")


async def test_drop_settles_after_max_redeliveries(harness: Harness) -> None:
    clock = ManualClock()
    policy = DispatchPolicy(max_redeliveries=2, poison=PoisonPolicy.DROP)
    subscription = harness.subscribe("sub", EXCLUSIVE, policy=policy, clock=clock)
    handle = subscription.attach(1, "a")
    await harness.publish(1)
    await fail_until_poisoned(subscription, clock, 0, 3)  # first delivery + 2 redeliveries
    assert subscription.stats.dropped == 1
    assert subscription.cursor == 1
    assert harness.cursors["sub"] == [1]
    clock.advance(100)
    await quiet(handle)


async def test_dead_letter_gets_the_original_attributes(harness: Harness) -> None:
    clock = ManualClock()
    dead: list[tuple[Entry, dict[str, str]]] = []

    async def dead_letter(entry: Entry, attributes: dict[str, str]) -> None:
        await harness.store.append(
            policy.dead_letter_topic_for(TOPIC),
            Entry(entry.payload, producer_name=entry.producer_name, attributes=attributes),
        )
        dead.append((entry, attributes))

    policy = DispatchPolicy(max_redeliveries=1, poison=PoisonPolicy.DEAD_LETTER)
    subscription = harness.subscribe(
        "sub", EXCLUSIVE, policy=policy, clock=clock, dead_letter=dead_letter
    )
    subscription.attach(1, "a")
    await harness.publish(2, attributes={"tenant": "t1"})
    subscription.ack(1)
    await fail_until_poisoned(subscription, clock, 0, 2)
    for _ in range(10):
        await asyncio.sleep(0)

    assert len(dead) == 1
    entry, attributes = dead[0]
    assert entry.offset == 0
    assert attributes == {
        "tenant": "t1",
        "x-original-topic": TOPIC,
        "x-original-subscription": "sub",
        "x-original-topic-offset": "0",
        "x-delivery-attempt": "2",
        "x-failure-reason": "failure 2",
    }
    assert subscription.stats.dead_lettered == 1
    assert subscription.cursor == 2
    dlq = harness.store.info("/default/events-dlq")
    assert dlq is not None and dlq.high_watermark == 1


async def test_dead_letter_failure_is_retried_and_holds_the_cursor(harness: Harness) -> None:
    clock = ManualClock()
    calls: list[int] = []

    async def flaky(entry: Entry, attributes: dict[str, str]) -> None:
        calls.append(entry.offset)
        if len(calls) == 1:
            raise RuntimeError("dead-letter topic unavailable")

    policy = DispatchPolicy(
        max_redeliveries=0, poison=PoisonPolicy.DEAD_LETTER, redelivery_max_s=30
    )
    subscription = harness.subscribe("sub", SHARED, policy=policy, clock=clock, dead_letter=flaky)
    subscription.attach(1, "a")
    await harness.publish(1)
    await fail_until_poisoned(subscription, clock, 0, 1)
    await asyncio.sleep(0.01)
    assert calls == [0]
    assert subscription.cursor == 0
    clock.advance(30)
    await asyncio.sleep(0.01)
    assert calls == [0, 0]
    assert subscription.cursor == 1


def test_dead_letter_policy_needs_a_callback() -> None:
    async def run() -> None:
        store = await TopicStore.open(None)
        try:
            with pytest.raises(ConfigError, match="dead_letter callback"):
                ReliableSubscription(
                    "sub",
                    TOPIC,
                    SHARED,
                    store,
                    0,
                    DispatchPolicy(poison=PoisonPolicy.DEAD_LETTER),
                )
        finally:
            await store.close()

    asyncio.run(run())


async def test_block_stops_reading_until_the_poison_message_is_acked(harness: Harness) -> None:
    clock = ManualClock()
    policy = DispatchPolicy(max_redeliveries=1, redelivery_max_s=60)
    assert policy.poison is PoisonPolicy.BLOCK  # the default
    subscription = harness.subscribe("sub", SHARED, policy=policy, clock=clock)
    handle = subscription.attach(1, "a")
    await harness.publish(1)
    await fail_until_poisoned(subscription, clock, 0, 2)
    assert subscription.blocked == (0,)

    # Nothing new goes out while blocked, and reading stops (after the read under way).
    await harness.publish(10)
    await quiet(handle)
    assert subscription.unacked < 1 + 10
    # ...but the blocked message keeps coming back every redelivery_max_s.
    clock.advance(59)
    await quiet(handle)
    clock.advance(1)
    assert [(d.entry.offset, d.attempt) for d in await take(handle, 1)] == [(0, 3)]
    subscription.nack(0)
    clock.advance(60)
    assert [(d.entry.offset, d.attempt) for d in await take(handle, 1)] == [(0, 4)]
    assert subscription.cursor == 0

    subscription.ack(0)
    assert not subscription.blocked
    assert subscription.cursor == 1
    assert await offsets(handle, 10) == list(range(1, 11))


# -- flow control ------------------------------------------------------------------------------


async def test_no_consumer_holds_more_than_its_window(harness: Harness) -> None:
    policy = DispatchPolicy(max_unacked=3, read_batch=4)
    subscription = harness.subscribe("sub", SHARED, policy=policy)
    handles = [subscription.attach(i, f"c{i}") for i in range(2)]
    await harness.publish(40)
    held = [await offsets(handle, 3) for handle in handles]
    await quiet(*handles)
    assert [h.in_flight for h in handles] == [3, 3]
    # Bounded memory: two windows plus at most one read batch.
    assert subscription.unacked <= 2 * 3 + 4

    seen = [offset for batch in held for offset in batch]
    for offset in seen:
        subscription.ack(offset)
    while len(seen) < 40:
        await asyncio.sleep(0)
        for handle in handles:
            assert handle.in_flight <= 3
            if handle.queued:
                offset = (await next_delivery(handle)).entry.offset
                seen.append(offset)
                subscription.ack(offset)
        assert subscription.unacked <= 2 * 3 + 4
    assert sorted(seen) == list(range(40))
    assert subscription.cursor == 40


async def test_without_consumers_nothing_is_read(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    await harness.publish(10)
    assert subscription.unacked == 0
    handle = subscription.attach(1, "a")
    assert await offsets(handle, 10) == list(range(10))


# -- consumers leaving -------------------------------------------------------------------------


async def test_detached_consumers_messages_go_to_the_others_at_once(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    leaving = subscription.attach(1, "leaving")
    staying = subscription.attach(2, "staying")
    await harness.publish(6)
    assert await offsets(leaving, 3) == [0, 2, 4]
    assert await offsets(staying, 3) == [1, 3, 5]
    subscription.ack(2)

    assert subscription.detach(1)
    assert not subscription.detach(1)
    with pytest.raises(ConsumerClosedError, match="detached"):
        await leaving.next()
    got = await take(staying, 2)
    assert [(d.entry.offset, d.attempt) for d in got] == [(0, 1), (4, 1)]


async def test_messages_of_the_last_consumer_wait_for_the_next_one(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    first = subscription.attach(1, "a")
    await harness.publish(3)
    assert await offsets(first, 3) == [0, 1, 2]
    first.close()
    assert subscription.consumers == ()
    await harness.publish(2)
    later = subscription.attach(2, "b")
    assert await offsets(later, 5) == [0, 1, 2, 3, 4]


async def test_close_ends_every_handle(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    handle = subscription.attach(1, "a")
    waiting = asyncio.ensure_future(handle.next())
    await asyncio.sleep(0)
    await subscription.close()
    with pytest.raises(ConsumerClosedError, match="closed"):
        await waiting
    with pytest.raises(ConsumerClosedError):
        subscription.attach(2, "b")
    assert not subscription.ack(0)
    await subscription.close()


# -- restarts ----------------------------------------------------------------------------------


async def test_restart_from_the_cursor_resumes_after_it(harness: Harness) -> None:
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a")
    await harness.publish(10)
    assert await offsets(handle, 10) == list(range(10))
    for offset in (0, 1, 2, 4, 5):
        subscription.ack(offset)
    assert subscription.cursor == 3
    await subscription.close()

    resumed = harness.subscribe("sub", EXCLUSIVE, start=harness.cursors["sub"][-1])
    again = resumed.attach(1, "a")
    # At least once: 4 and 5 were acked but lie above the cursor, so they come again.
    assert await offsets(again, 7) == list(range(3, 10))


async def test_restart_from_the_cursor_with_a_file_store(wal_dir: Path) -> None:
    cursors: list[int] = []
    store = await TopicStore.open(wal_dir)
    subscription = ReliableSubscription(
        "sub", TOPIC, EXCLUSIVE, store, None, FAST, on_cursor=cursors.append
    )
    handle = subscription.attach(1, "a")
    for i in range(6):
        await store.append(TOPIC, Entry(b"m%d" % i))
    for delivery in await take(handle, 6):
        if delivery.entry.offset < 4:
            subscription.ack(delivery.entry.offset)
    await subscription.close()
    await store.close()
    assert cursors[-1] == 4

    store = await TopicStore.open(wal_dir)
    try:
        resumed = ReliableSubscription("sub", TOPIC, EXCLUSIVE, store, cursors[-1], FAST)
        handle = resumed.attach(1, "a")
        assert [(d.entry.offset, d.entry.payload) for d in await take(handle, 2)] == [
            (4, b"m4"),
            (5, b"m5"),
        ]
        await resumed.close()
    finally:
        await store.close()


async def test_store_closing_ends_reading_but_not_acks(wal_dir: Path) -> None:
    store = await TopicStore.open(wal_dir)
    subscription = ReliableSubscription("sub", TOPIC, SHARED, store, 0, FAST)
    handle = subscription.attach(1, "a")
    await store.append(TOPIC, Entry(b"x"))
    assert await offsets(handle, 1) == [0]
    await store.close()
    await asyncio.sleep(0.01)
    assert subscription.ack(0)
    assert subscription.cursor == 1
    await subscription.close()


async def test_cursor_below_the_retained_log_skips_to_its_start(harness: Harness) -> None:
    await harness.publish(5)
    region = harness.store.regions[0]
    region.rotate()
    await harness.publish(5)
    await region.delete_segment(min(region.sealed))  # retention removed offsets 0..4

    subscription = harness.subscribe("sub", EXCLUSIVE, start=0)
    handle = subscription.attach(1, "a")
    assert await offsets(handle, 5) == [5, 6, 7, 8, 9]
    assert subscription.stats.skipped == 5
    assert harness.cursors["sub"] == [5]


async def test_a_handle_has_one_reader(harness: Harness) -> None:
    subscription = harness.subscribe("sub", SHARED)
    handle = subscription.attach(1, "a")
    first = asyncio.ensure_future(handle.next())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already being awaited"):
        await handle.next()
    first.cancel()
    await harness.publish(1)
    assert await offsets(handle, 1) == [0]  # the cancelled wait lost nothing
