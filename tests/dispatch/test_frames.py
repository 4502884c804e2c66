"""Frames: Exclusive and Failover dispatch to batch consumers (``frames`` > 0) by runs of
consecutive offsets, with the semantics of per-message dispatch (``dispatch/reliable.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from danube_ingest.dispatch import (
    ConsumerClosedError,
    ConsumerHandle,
    Delivery,
    DispatchPolicy,
    Frame,
    ManualClock,
    SubscriptionType,
)
from danube_ingest.store import TopicReader, TopicStore
from danube_ingest.wal import Entry
from danube_ingest.wal.block import served_block, served_frame
from danube_ingest.wal.stored import StoredEntries

from .conftest import FAST, TOPIC, Harness, offsets, quiet, settle_loop, take

EXCLUSIVE = SubscriptionType.EXCLUSIVE
FAILOVER = SubscriptionType.FAILOVER


async def take_items(
    handle: ConsumerHandle, count: int, limit: int = 1000, timeout: float = 2.0
) -> list[Delivery | Frame]:
    """What ``handle`` gets until it holds ``count`` messages, as given (frames or single)."""
    items: list[Delivery | Frame] = []
    got = 0
    while got < count:
        batch = await asyncio.wait_for(handle.next_batch(limit), timeout)
        items.extend(batch)
        got += sum(1 if isinstance(i, Delivery) else len(i.entries) for i in batch)
    assert got == count
    return items


def messages(items: list[Delivery | Frame]) -> list[tuple[int, bytes]]:
    """The offset and payload of each message in ``items``, in order."""
    out: list[tuple[int, bytes]] = []
    for item in items:
        if isinstance(item, Delivery):
            out.append((item.entry.offset, item.entry.payload))
        else:
            out.extend((entry.offset, entry.payload) for entry in item.entries)
    return out


def offsets_of(items: list[Delivery | Frame]) -> list[int]:
    out: list[int] = []
    for item in items:
        if isinstance(item, Delivery):
            out.append(item.entry.offset)
        else:
            offsets = [e.offset for e in item.entries]
            assert offsets == list(range(item.base_offset, item.base_offset + len(offsets)))
            out.extend(offsets)
    return out


async def test_exclusive_batch_consumer_gets_frames_of_at_most_its_size(harness: Harness) -> None:
    await harness.publish(10)
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a", frames=4)
    items = await take_items(handle, 10)
    assert all(isinstance(i, Frame) for i in items)
    assert [len(i.entries) for i in items if isinstance(i, Frame)] == [4, 4, 2]
    assert offsets_of(items) == list(range(10))
    assert subscription.stats.delivered == 10
    assert handle.in_flight == 10


async def test_next_batch_takes_whole_frames_up_to_its_limit(harness: Harness) -> None:
    await harness.publish(10)
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a", frames=4)
    await asyncio.sleep(0.05)
    first = await handle.next_batch(9)  # 4 + 4 fit, the third frame would not
    assert offsets_of(first) == list(range(8))


async def test_partial_cumulative_acks_inside_a_frame_settle_exactly_up_to_last(
    harness: Harness,
) -> None:
    await harness.publish(10)
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a", frames=100)
    items = await take_items(handle, 10)
    assert len(items) == 1  # one read batch, one frame
    assert subscription.ack_range(handle, 0, 3) == 4
    assert subscription.cursor == 4
    assert harness.cursors["sub"][-1] == 4
    assert (handle.in_flight, subscription.unacked) == (6, 6)
    assert subscription.ack_range(handle, 0, 3) == 0  # settled already
    assert subscription.ack(6)  # one offset inside the frame (a danube-client ack)
    assert subscription.cursor == 4
    assert subscription.ack_range(handle, 0, 9) == 5
    assert (subscription.cursor, handle.in_flight, subscription.unacked) == (10, 0, 0)
    assert subscription.stats.acked == 10


async def test_a_consumer_killed_mid_frame_hands_the_rest_to_the_next_from_the_first_unacked(
    harness: Harness,
) -> None:
    await harness.publish(10)
    subscription = harness.subscribe("sub", FAILOVER)
    active = subscription.attach(1, "active", frames=100)
    standby = subscription.attach(2, "standby", frames=100)
    assert offsets_of(await take_items(active, 10)) == list(range(10))
    await quiet(standby)
    subscription.ack_range(active, 0, 4)
    active.close()
    with pytest.raises(ConsumerClosedError):
        await active.next_batch(10)
    items = await take_items(standby, 5)
    assert all(isinstance(i, Frame) for i in items)  # still a frame: not a failed delivery
    assert offsets_of(items) == [5, 6, 7, 8, 9]
    assert subscription.stats.redelivered == 0
    assert subscription.ack_range(standby, 0, 9) == 5
    assert subscription.cursor == 10


async def test_takeover_by_a_second_batch_consumer_redelivers_what_the_first_held(
    harness: Harness,
) -> None:
    await harness.publish(8)
    subscription = harness.subscribe("sub", EXCLUSIVE)
    first = subscription.attach(1, "a", frames=3)
    assert offsets_of(await take_items(first, 8)) == list(range(8))
    subscription.ack_range(first, 0, 3)  # inside the second frame
    second = subscription.attach(1, "a", frames=3)  # same consumer: a takeover
    with pytest.raises(ConsumerClosedError, match="taken over"):
        await first.next_batch(10)
    assert subscription.ack_range(first, 0, 7) == 0  # the old handle holds nothing now
    items = await take_items(second, 4)
    assert offsets_of(items) == [4, 5, 6, 7]
    await harness.publish(2)
    assert offsets_of(await take_items(second, 2)) == [8, 9]
    assert subscription.ack_range(second, 0, 9) == 6
    assert subscription.cursor == 10


async def test_mixed_failover_batch_consumer_active_then_a_danube_consumer(
    harness: Harness,
) -> None:
    await harness.publish(10)
    subscription = harness.subscribe("sub", FAILOVER)
    batch = subscription.attach(1, "batch", frames=100)
    single = subscription.attach(2, "single")  # frames 0: a danube-client consumer
    assert offsets_of(await take_items(batch, 10)) == list(range(10))
    await quiet(single)
    subscription.ack_range(batch, 0, 2)
    batch.close()
    got = await take(single, 7)
    assert [(d.entry.offset, d.attempt) for d in got] == [(o, 1) for o in range(3, 10)]
    for offset in (3, 4, 9):
        assert subscription.ack(offset)
    assert subscription.cursor == 5
    await harness.publish(2)
    assert await offsets(single, 2) == [10, 11]


async def test_mixed_failover_danube_consumer_active_then_a_batch_consumer(
    harness: Harness,
) -> None:
    await harness.publish(6)
    subscription = harness.subscribe("sub", FAILOVER)
    single = subscription.attach(1, "single")
    batch = subscription.attach(2, "batch", frames=100)
    assert await offsets(single, 6) == list(range(6))
    await quiet(batch)
    for offset in (0, 1, 3):
        subscription.ack(offset)
    single.close()
    # Its entries went out one by one: they come back one by one, then new ones in frames.
    redelivered = await take_items(batch, 3)
    assert all(isinstance(i, Delivery) for i in redelivered)
    assert offsets_of(redelivered) == [2, 4, 5]
    await harness.publish(4)
    fresh = await take_items(batch, 4)
    assert all(isinstance(i, Frame) for i in fresh)
    assert offsets_of(fresh) == [6, 7, 8, 9]
    assert subscription.ack_range(batch, 0, 9) == 7
    assert subscription.cursor == 10


async def test_the_unacked_window_is_bounded_in_messages_not_frames(harness: Harness) -> None:
    await harness.publish(20)
    policy = DispatchPolicy(max_unacked=5, ack_timeout_s=30)
    subscription = harness.subscribe("sub", EXCLUSIVE, policy=policy)
    handle = subscription.attach(1, "a", frames=100)
    assert offsets_of(await take_items(handle, 5)) == [0, 1, 2, 3, 4]
    await quiet(handle)
    assert handle.in_flight == 5
    assert subscription.ack_range(handle, 0, 2) == 3
    assert offsets_of(await take_items(handle, 3)) == [5, 6, 7]
    await quiet(handle)
    assert handle.in_flight == 5


async def test_an_ack_timeout_redelivers_the_frames_unacked_entries_one_by_one(
    harness: Harness,
) -> None:
    await harness.publish(3)
    clock = ManualClock()
    subscription = harness.subscribe("sub", EXCLUSIVE, clock=clock)
    handle = subscription.attach(1, "a", frames=100)
    assert offsets_of(await take_items(handle, 3)) == [0, 1, 2]
    subscription.ack_range(handle, 0, 0)
    clock.advance(FAST.ack_timeout_s)
    assert subscription.stats.ack_timeouts == 2
    clock.advance(FAST.redelivery_max_s)
    got = await take_items(handle, 2)
    assert [(d.entry.offset, d.attempt) for d in got if isinstance(d, Delivery)] == [
        (1, 2),
        (2, 2),
    ]
    assert subscription.ack_range(handle, 0, 2) == 2
    assert subscription.cursor == 3


async def test_a_nack_inside_a_frame_redelivers_that_entry_alone(harness: Harness) -> None:
    await harness.publish(5)
    clock = ManualClock()
    subscription = harness.subscribe("sub", EXCLUSIVE, clock=clock)
    handle = subscription.attach(1, "a", frames=100)
    assert offsets_of(await take_items(handle, 5)) == list(range(5))
    assert subscription.nack(2)
    assert handle.in_flight == 4
    clock.advance(FAST.redelivery_max_s)
    got = await take_items(handle, 1)
    assert [(d.entry.offset, d.attempt) for d in got if isinstance(d, Delivery)] == [(2, 2)]
    assert subscription.ack_range(handle, 0, 4) == 5
    assert subscription.cursor == 5


async def test_a_queued_frame_turned_per_message_keeps_its_place_in_the_queue(
    harness: Harness,
) -> None:
    await harness.publish(6)
    clock = ManualClock()
    subscription = harness.subscribe("sub", EXCLUSIVE, clock=clock)
    handle = subscription.attach(1, "a", frames=2)
    await asyncio.sleep(0.05)
    assert handle.queued == 3  # three frames, none taken yet
    assert subscription.nack(2)  # inside the second frame: 3 stays, alone, in its place
    items = await take_items(handle, 5)
    assert offsets_of(items) == [0, 1, 3, 4, 5]
    assert [type(i) for i in items] == [Frame, Delivery, Frame]


async def test_settled_frames_keep_no_entries_alive(harness: Harness) -> None:
    await harness.publish(300)
    subscription = harness.subscribe("sub", EXCLUSIVE)
    handle = subscription.attach(1, "a", frames=10)
    got = 0
    while got < 300:
        for item in await asyncio.wait_for(handle.next_batch(10), 2.0):
            assert isinstance(item, Frame)
            got += len(item.entries)
            subscription.ack_range(handle, 0, item.base_offset + len(item.entries) - 1)
    assert subscription.cursor == 300
    # (Internals: heap items of settled runs may remain until they reach their heap's top.)
    held = [run for heap in (subscription._runs, subscription._run_deadlines) for *_, run in heap]
    assert all(not run.entries for run in held)


async def test_a_poison_message_inside_a_frame_blocks_new_frames_until_acked(
    harness: Harness,
) -> None:
    await harness.publish(3)
    clock = ManualClock()
    policy = DispatchPolicy(max_redeliveries=0, redelivery_max_s=60)  # Block, the default
    subscription = harness.subscribe("sub", EXCLUSIVE, policy=policy, clock=clock)
    handle = subscription.attach(1, "a", frames=100)
    assert offsets_of(await take_items(handle, 3)) == [0, 1, 2]
    assert subscription.nack(1)  # its only allowed delivery failed: it blocks
    assert subscription.blocked == (1,)
    assert subscription.ack(0) and subscription.ack(2)
    await harness.publish(4)
    await quiet(handle)  # nothing new goes out while blocked
    clock.advance(60)
    got = await take_items(handle, 1)
    assert [(d.entry.offset, d.attempt) for d in got if isinstance(d, Delivery)] == [(1, 2)]
    assert subscription.ack_range(handle, 0, 2) == 1  # the poison message
    assert not subscription.blocked
    assert subscription.cursor == 3
    fresh = await take_items(handle, 4)
    assert offsets_of(fresh) == [3, 4, 5, 6]
    assert all(isinstance(i, Frame) for i in fresh)


@pytest.mark.parametrize("sub_type", [SubscriptionType.SHARED, SubscriptionType.KEY_SHARED])
async def test_shared_and_key_shared_stay_per_message(
    harness: Harness, sub_type: SubscriptionType
) -> None:
    await harness.publish(6)
    subscription = harness.subscribe("sub", sub_type)
    handle = subscription.attach(1, "a", frames=100)
    assert handle.frames == 0
    items = await take_items(handle, 6)
    assert all(isinstance(i, Delivery) for i in items)
    assert offsets_of(items) == list(range(6))
    assert subscription.ack_range(handle, 0, 5) == 6
    assert subscription.cursor == 6


async def test_frames_from_segments_and_cache_are_stored_bytes_not_entries(
    wal_dir: Path,
) -> None:
    """A frame consumer is handed the stored bodies (no Entry per message) whether the read
    came from segment files or the cache; they serve the bytes the decoded entries serve, and
    a frame that must go one by one (a nack) still gets its entries."""
    store = await TopicStore.open(wal_dir, segment_bytes=16 * 1024, cache_topic_max_bytes=4096)
    harness = Harness(store)
    try:
        for n in range(20):
            await store.append_batch(
                TOPIC,
                [Entry(b"b%d-%d" % (n, i), producer_name="p", routing_key="k") for i in range(50)],
            )
        plain = store.create_reader(TOPIC, 0)
        decoded = {e.offset: e for e in await read_all(plain, 1000)}
        plain.close()
        subscription = harness.subscribe("frames", EXCLUSIVE)
        handle = subscription.attach(1, "a", frames=64)
        items = await take_items(handle, 1000)
        assert offsets_of(items) == list(range(1000))
        for item in items:
            assert isinstance(item, Frame)
            assert isinstance(item.entries, StoredEntries)
            want = [decoded[item.base_offset + i] for i in range(len(item.entries))]
            assert served_frame(item.entries) == served_block(want)
        # One by one from here: a nack makes its frame per-message state; the entries are
        # built then, the same as decoded.
        assert subscription.ack_range(handle, 0, 999) == 1000
        await harness.publish(3)
        fresh = await take_items(handle, 3)
        assert all(isinstance(i, Frame) and isinstance(i.entries, StoredEntries) for i in fresh)
        assert subscription.nack(1001)
        (again,) = await asyncio.wait_for(handle.next_batch(10), 2.0)
        assert isinstance(again, Delivery)
        assert (again.entry.offset, again.entry.payload, again.attempt) == (1001, b"m1", 2)
    finally:
        await harness.close()


async def test_failover_switching_between_danube_and_batch_consumers_loses_and_repeats_nothing(
    wal_dir: Path,
) -> None:
    """The active consumer of a Failover subscription changes kind back and forth (a
    danube-client consumer, then a batch consumer, ...), each time with entries queued in the
    one leaving and with the subscription waiting for appends in between: the subscription
    changes how it reads (plain entries / stored bytes) between reads, and every entry is
    received once, in offset order, with its payload, as single messages by the one and (what
    it reads for it) as frames by the other."""
    store = await TopicStore.open(wal_dir, segment_bytes=16 * 1024, cache_topic_max_bytes=4096)
    harness = Harness(store)
    payloads: list[bytes] = []

    async def publish(count: int) -> None:
        for _ in range(count // 25):
            batch = [Entry(b"e%d" % (len(payloads) + i), producer_name="p") for i in range(25)]
            payloads.extend(entry.payload for entry in batch)
            await store.append_batch(TOPIC, batch)

    try:
        await publish(200)
        subscription = harness.subscribe("sub", FAILOVER)
        received: list[tuple[int, bytes]] = []
        active = subscription.attach(1, "c1")
        for consumer_id in range(2, 8):
            frames = 64 if active.frames == 0 else 0
            for publish_after in (50, 25):
                items = await take_items(active, len(payloads) - len(received))
                if frames == 64:  # ``active`` takes single messages
                    assert all(isinstance(item, Delivery) for item in items)
                elif publish_after == 25:  # what was read for it: stored bytes at the end
                    assert isinstance(items[-1], Frame)
                    assert isinstance(items[-1].entries, StoredEntries)
                got = messages(items)
                received.extend(got)
                assert subscription.ack_range(active, 0, len(received) - 1) == len(got)
                await publish(publish_after)  # (the subscription waits for these)
                await settle_loop()
            # 25 entries are queued in ``active``: they go to the next consumer.
            following = subscription.attach(consumer_id, f"c{consumer_id}", frames=frames)
            active.close()
            active = following
        received.extend(messages(await take_items(active, len(payloads) - len(received))))
        assert received == list(enumerate(payloads))
        subscription.ack_range(active, 0, len(received) - 1)
        assert subscription.cursor == len(payloads) == 200 + 6 * 75
        assert subscription.stats.redelivered == 0
        await quiet(active)
    finally:
        await harness.close()


async def read_all(reader: TopicReader, stop: int) -> list[Entry]:
    out: list[Entry] = []
    while len(out) < stop:
        out.extend(await asyncio.wait_for(reader.next_batch(), 5.0))
    return out


async def test_a_danube_consumer_of_an_exclusive_subscription_gets_the_entries_as_appended(
    wal_dir: Path,
) -> None:
    """Entries for a consumer that takes single messages are read plain: it is given the
    entries the cache holds (those appended), not entries decoded again from stored bytes."""
    store = await TopicStore.open(wal_dir)
    harness = Harness(store)
    try:
        for sub_type in (EXCLUSIVE, FAILOVER):
            subscription = harness.subscribe(sub_type.name, sub_type, start=None)
            handle = subscription.attach(1, "single")
            appended = [Entry(b"a%d" % i, producer_name="p") for i in range(5)]
            for entry in appended:
                await store.append(TOPIC, entry)
            got = await take(handle, 5)
            assert all(d.entry is entry for d, entry in zip(got, appended, strict=True))
    finally:
        await harness.close()
