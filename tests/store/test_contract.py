"""The TopicStore contract, held by every storage mode (memory, file, file without fsync).

What any store must do, whatever keeps its bytes: consecutive offsets per topic, readers that
see exactly the appended sequence from any offset (from segment files, the cache or live
appends), monotone ingest time, all-or-nothing rejection of oversized entries, out-of-range
errors below the first retained offset, readers that end when the store closes, and readers
that never hold up the writer.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections import deque
from pathlib import Path

import pytest

from danube_ingest.errors import OffsetOutOfRangeError, PayloadTooLargeError, WalClosedError
from danube_ingest.store.cache import DEFAULT_HOT_MAX_BYTES
from danube_ingest.wal import Entry, Sealed
from danube_ingest.wal import log as wal_log

from .conftest import (
    KiB,
    MiB,
    SteppedClock,
    StoreFactory,
    append_all,
    assert_sequence,
    info_of,
    now_ms,
    read_until,
    within,
)

# -- appending -------------------------------------------------------------------------------


async def test_append_returns_consecutive_offsets_per_topic(stores: StoreFactory) -> None:
    store = await stores.open()
    assert store.info("a") is None
    for i in range(20):
        assert await store.append("a", Entry(b"a%d" % i)) == i
        if i % 2:
            assert await store.append("b", Entry(b"b%d" % i)) == i // 2

    # Appends staged without awaiting are ordered by call and all acknowledged.
    entries = [Entry(b"c%d" % i) for i in range(300)]
    acks = [store.append("a", e) for e in entries]
    assert [e.offset for e in entries] == list(range(20, 320))
    assert await asyncio.gather(*acks) == list(range(20, 320))

    info = store.info("a")
    assert info is not None
    assert (info.first_offset, info.high_watermark) == (0, 320)
    assert info_of(store, "b").high_watermark == 10
    assert store.topics() == ["a", "b"]


async def test_cache_keeps_all_but_its_newest_entries_as_bytes(stores: StoreFactory) -> None:
    # The cache holds ~10 MiB of this topic, but only its newest DEFAULT_HOT_MAX_BYTES (4 MiB)
    # as Entry objects: the rest is frame bytes, which the garbage collector never walks. Read
    # back from the cache, the old entries are decoded, equal to what was appended.
    store = await stores.open(cache_max_bytes=64 * MiB, cache_topic_max_bytes=32 * MiB)
    payloads = [b"%07d" % i * 14 for i in range(60_000)]  # 98 bytes each

    def live_entries() -> int:
        gc.collect()
        return sum(isinstance(o, Entry) for o in gc.get_objects())

    before = live_entries()
    last = None
    for payload in payloads:
        last = store.append("t", Entry(payload))
    assert last is not None
    await last
    del last
    assert store.cache.first_offset(store.regions[0].topic("t")) == 0  # all of it cached
    hot = live_entries() - before
    assert 0 < hot < DEFAULT_HOT_MAX_BYTES // 98
    assert_sequence(await read_until(store.create_reader("t", 0), 60_000), 0, payloads)


async def test_append_batch_returns_its_offsets(stores: StoreFactory) -> None:
    store = await stores.open()
    first = [Entry(b"x%d" % i) for i in range(10)]
    assert await store.append_batch("t", first) == range(0, 10)
    assert [e.offset for e in first] == list(range(10))
    assert await store.append("t", Entry(b"single")) == 10
    assert await store.append_batch("t", [Entry(b"one")]) == range(11, 12)
    assert await store.append_batch("t", []) == range(0)
    assert info_of(store, "t").high_watermark == 12

    got = await read_until(store.create_reader("t", 0), 12)
    assert_sequence(got, 0, [*(b"x%d" % i for i in range(10)), b"single", b"one"])


# -- reading ---------------------------------------------------------------------------------


async def test_readers_from_start_and_middle(stores: StoreFactory) -> None:
    store = await stores.open(segment_bytes=16 * KiB)
    rng = random.Random(1)
    payloads = [rng.randbytes(rng.randint(0, 500)) for _ in range(400)]
    await asyncio.gather(*(store.append("t", Entry(p)) for p in payloads))

    reader = store.create_reader("t", 0, max_batch=7)
    batch = await reader.next_batch()
    assert 1 <= len(batch) <= 7
    got = batch + await read_until(reader, 400)
    assert_sequence(got, 0, payloads)

    middle = store.create_reader("t", 123)
    assert middle.position == 123
    assert_sequence(await read_until(middle, 400), 123, payloads[123:])

    # The async iterator yields the same entries one at a time.
    seen = []
    async for entry in store.create_reader("t", 390, max_batch=3):
        seen.append(entry)
        if entry.offset == 399:
            break
    assert_sequence(seen, 390, payloads[390:])


async def test_reader_at_high_watermark_waits_for_live_appends(stores: StoreFactory) -> None:
    store = await stores.open()
    await append_all(store, "t", [b"old0", b"old1"])
    reader = store.create_reader("t", 2)
    pending = asyncio.create_task(reader.next_batch())
    await asyncio.sleep(0.05)
    assert not pending.done()

    assert await store.append("t", Entry(b"live")) == 2
    batch = await within(pending)
    assert_sequence(batch, 2, [b"live"])


async def test_reader_beyond_high_watermark_waits_until_reached(stores: StoreFactory) -> None:
    store = await stores.open()
    await append_all(store, "t", [b"p0"])
    reader = store.create_reader("t", 5)
    pending = asyncio.create_task(read_until(reader, 8))
    await append_all(store, "t", [b"p1", b"p2", b"p3"])
    await asyncio.sleep(0.05)
    assert not pending.done()  # hwm is 4: offset 5 does not exist yet

    await append_all(store, "t", [b"p4", b"p5", b"p6", b"p7"])
    assert_sequence(await within(pending), 5, [b"p5", b"p6", b"p7"])

    # A reader on a topic nobody has written yet waits too.
    empty = asyncio.create_task(store.create_reader("fresh", 0).next_batch())
    await asyncio.sleep(0.02)
    assert not empty.done()
    await store.append("fresh", Entry(b"first"))
    assert_sequence(await within(empty), 0, [b"first"])


async def test_all_entry_fields_round_trip(stores: StoreFactory) -> None:
    # A tiny cache and small segments: the first reads come from segment files.
    store = await stores.open(
        segment_bytes=4 * KiB, cache_max_bytes=4 * KiB, cache_topic_max_bytes=2 * KiB
    )
    sent = []
    for i in range(60):
        sent.append(
            Entry(
                b"payload-%d" % i * (i % 7),
                publish_ms=1_700_000_000_000 + i,
                producer_name=f"producer-{i % 3}",
                routing_key=None if i % 4 == 0 else f"key-{i}",
                attributes=None if i % 5 == 0 else {"a": str(i), "ünï": "cødé"},
                schema_id=None if i % 2 else 40 + i,
                schema_version=i % 3,
                producer_id=i * 1000,
                request_id=i,
            )
        )
    await store.append_batch("t", sent[:30])
    for entry in sent[30:]:
        await store.append("t", entry)
    got = await read_until(store.create_reader("t", 0, max_batch=11), 60)
    assert got == sent
    assert store.create_reader("t", 59) is not None


# -- many topics, concurrently ---------------------------------------------------------------


def plan_topic(rng: random.Random, count: int, large: bool) -> list[list[bytes]]:
    """A topic's appends: single payloads and batches, sizes from empty to over 1 MiB."""
    payloads = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.03:
            payloads.append(b"")
        elif roll < 0.04:
            payloads.append(rng.randbytes(rng.randint(16 * KiB, 200 * KiB)))
        else:
            payloads.append(rng.randbytes(rng.randint(1, 2 * KiB)))
    if large:
        payloads.insert(rng.randrange(len(payloads)), rng.randbytes(MiB + rng.randint(1, MiB // 2)))
    ops = []
    i = 0
    while i < len(payloads):
        size = 1 if rng.random() < 0.6 else rng.randint(2, 30)
        ops.append(payloads[i : i + size])
        i += size
    return ops


async def test_concurrent_topics_rotation_tiny_cache(stores: StoreFactory) -> None:
    """50 topics, ~4000 entries, appended concurrently while readers at random offsets follow.

    Small segments and a tiny cache make the readers move between segment files, the cache
    and live appends; each must see exactly its topic's acknowledged sequence.
    """
    rng = random.Random(20240611)
    cache_max = 256 * KiB
    store = await stores.open(
        regions=3,
        segment_bytes=32 * KiB,
        cache_max_bytes=cache_max,
        cache_topic_max_bytes=16 * KiB,
    )
    topics = [f"topic-{i:02d}" for i in range(50)]
    plans = {
        t: plan_topic(rng, rng.randint(40, 120), large=i % 8 == 0) for i, t in enumerate(topics)
    }
    totals = {t: sum(len(op) for op in ops) for t, ops in plans.items()}
    acked: dict[str, dict[int, bytes]] = {t: {} for t in topics}

    def record(topic: str, offset: int, payload: bytes) -> None:
        assert offset not in acked[topic], f"offset {offset} of {topic} acknowledged twice"
        acked[topic][offset] = payload

    async def appender(topic: str, ops: deque[list[bytes]], seed: int) -> None:
        local = random.Random(seed)
        while ops:
            op = ops.popleft()
            if len(op) > 1:
                entries = [Entry(p, producer_name=topic) for p in op]
                offsets = await store.append_batch(topic, entries)
                assert list(offsets) == [e.offset for e in entries]
                for offset, payload in zip(offsets, op, strict=True):
                    record(topic, offset, payload)
            else:
                # Stage a few singles before awaiting any of them (pipelined producer).
                staged = [op[0]]
                while ops and len(ops[0]) == 1 and len(staged) < 4 and local.random() < 0.5:
                    staged.append(ops.popleft()[0])
                entries = [Entry(p, producer_name=topic) for p in staged]
                acks = [store.append(topic, e) for e in entries]
                for entry, ack in zip(entries, acks, strict=True):
                    offset = await ack
                    assert offset == entry.offset
                    record(topic, offset, entry.payload)
            if local.random() < 0.3:
                await asyncio.sleep(0)

    readers: list[tuple[str, int, asyncio.Task[list[Entry]]]] = []

    def start_readers() -> None:
        for topic in topics:
            start = rng.randint(0, totals[topic])
            reader = store.create_reader(topic, start, max_batch=rng.choice([1, 7, 64, 1024]))
            readers.append((topic, start, asyncio.create_task(read_until(reader, totals[topic]))))

    start_readers()  # before anything exists: some wait beyond the high watermark
    appenders = []
    for i, topic in enumerate(topics):
        queue = deque(plans[topic])
        appenders += [asyncio.create_task(appender(topic, queue, i * 2 + k)) for k in range(2)]
    for _ in range(20):
        await asyncio.sleep(0)
    start_readers()  # while appends are under way
    await within(asyncio.gather(*appenders), 60)
    start_readers()  # after: from segment files and the cache

    expected = {}
    for topic in topics:
        assert sorted(acked[topic]) == list(range(totals[topic])), topic
        expected[topic] = [acked[topic][o] for o in range(totals[topic])]
        info = store.info(topic)
        assert info is not None
        assert (info.first_offset, info.high_watermark) == (0, totals[topic])

    for topic, start, task in readers:
        got = await within(task, 60)
        assert_sequence(got, start, expected[topic][start:])
        assert all(e.producer_name == topic for e in got)

    # Whole topics from offset 0: the tiny cache holds only their newest entries.
    for topic in topics:
        got = await read_until(store.create_reader(topic, 0, max_batch=50), totals[topic])
        assert_sequence(got, 0, expected[topic])
        assert info_of(store, topic).last_ingest_ms >= got[-1].ingest_ms
    for region in store.regions:
        assert len(region.sealed) >= 5
    for topic in topics:
        meta = next(r.topic(topic) for r in store.regions if r.topic(topic) is not None)
        assert meta is not None and len(meta.spans) >= 2, f"{topic} lies in one segment only"
    assert store.cache.nbytes <= cache_max
    assert sum(any(p == b"" for p in expected[t]) for t in topics) > 10
    assert sum(any(len(p) > MiB for p in expected[t]) for t in topics) >= 6


# -- ingest time -----------------------------------------------------------------------------


async def test_ingest_time_is_assigned_and_never_decreases(stores: StoreFactory) -> None:
    store = await stores.open()
    before = now_ms()
    first = Entry(b"first")
    await store.append("t", first)
    assert before <= first.ingest_ms <= now_ms()

    marked = now_ms()
    await store.advance_time("t")
    info = store.info("t")
    assert info is not None and info.last_ingest_ms >= marked
    after = Entry(b"after")
    await store.append("t", after)
    assert after.ingest_ms >= info.last_ingest_ms

    # advance_time on a topic that has no entries yet registers it at offset 0.
    await store.advance_time("quiet")
    quiet = store.info("quiet")
    assert quiet is not None
    assert (quiet.first_offset, quiet.high_watermark) == (0, 0)
    assert quiet.last_ingest_ms >= marked


async def test_ingest_time_never_decreases_when_the_clock_steps_back(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock(1_800_000_000_000)
    monkeypatch.setattr(wal_log, "time", clock)
    store = await stores.open()
    start = clock.ms

    first = Entry(b"first")
    await store.append("t", first)
    assert first.ingest_ms == start

    clock.ms = start - 5000  # NTP stepped the clock back
    behind = Entry(b"behind")
    await store.append("t", behind)
    assert behind.ingest_ms == start
    await store.advance_time("t")
    assert info_of(store, "t").last_ingest_ms == start

    clock.ms = start + 100
    await store.advance_time("t")
    assert info_of(store, "t").last_ingest_ms == start + 100
    clock.ms = start + 1
    batch = [Entry(b"b1"), Entry(b"b2")]
    await store.append_batch("t", batch)
    assert [e.ingest_ms for e in batch] == [start + 100, start + 100]

    # Another topic keeps its own clock: the step back applies to it.
    other = Entry(b"other")
    await store.append("other", other)
    assert other.ingest_ms == start + 1

    got = await read_until(store.create_reader("t", 0), 4)
    assert [e.ingest_ms for e in got] == [start, start, start + 100, start + 100]


# -- limits and retention --------------------------------------------------------------------


async def test_payload_too_large_stores_nothing(stores: StoreFactory) -> None:
    store = await stores.open(max_entry_bytes=1000)
    assert await store.append("t", Entry(b"a" * 10)) == 0

    with pytest.raises(PayloadTooLargeError, match="topic t"):
        await store.append("t", Entry(b"x" * 1001))
    with pytest.raises(PayloadTooLargeError):
        await store.append_batch("t", [Entry(b"fits"), Entry(b"x" * 1001), Entry(b"fits")])
    with pytest.raises(PayloadTooLargeError):
        await store.append("new", Entry(b"x" * 5000))
    assert not store.info("new")

    assert info_of(store, "t").high_watermark == 1
    assert await store.append("t", Entry(b"y" * 1000)) == 1
    assert await store.append_batch("t", [Entry(b"z")]) == range(2, 3)
    got = await read_until(store.create_reader("t", 0), 3)
    assert_sequence(got, 0, [b"a" * 10, b"y" * 1000, b"z"])


async def test_offset_out_of_range_after_deleting_oldest_segments(stores: StoreFactory) -> None:
    store = await stores.open(
        segment_bytes=4 * KiB, cache_max_bytes=16 * KiB, cache_topic_max_bytes=8 * KiB
    )
    payloads = [bytes([i % 251]) * 200 for i in range(300)]
    await append_all(store, "t", payloads)  # one commit each: a segment per ~20 entries
    region = store.regions[0]
    assert len(region.sealed) >= 10

    behind = store.create_reader("t", 0, max_batch=5)
    assert_sequence(await behind.next_batch(), 0, payloads[:5])
    ahead = store.create_reader("t", 0, max_batch=1000)
    read_ahead = await read_until(ahead, 250)
    assert_sequence(read_ahead, 0, payloads[: len(read_ahead)])

    while info_of(store, "t").first_offset <= 100:
        await region.delete_segment(min(region.sealed))
    first = info_of(store, "t").first_offset
    assert info_of(store, "t").high_watermark == 300

    with pytest.raises(OffsetOutOfRangeError) as raised:
        await behind.next_batch()
    assert (raised.value.topic, raised.value.offset, raised.value.first_offset) == ("t", 5, first)
    with pytest.raises(OffsetOutOfRangeError):
        async for _ in store.create_reader("t", first - 1):
            pass

    assert_sequence(await read_until(store.create_reader("t", first), 300), first, payloads[first:])
    await append_all(store, "t", [b"more"])
    rest = await read_until(ahead, 301)
    assert_sequence(rest, len(read_ahead), [*payloads[len(read_ahead) :], b"more"])


async def test_close_ends_waiting_readers(stores: StoreFactory) -> None:
    store = await stores.open()
    await store.append("t", Entry(b"only"))
    waiting = asyncio.create_task(store.create_reader("t", 1).next_batch())

    async def iterate() -> list[Entry]:
        return [entry async for entry in store.create_reader("t", 0)]

    iterating = asyncio.create_task(iterate())
    unborn = asyncio.create_task(store.create_reader("never-written", 0).next_batch())
    await asyncio.sleep(0.05)
    assert not (waiting.done() or iterating.done() or unborn.done())

    await store.close()
    assert await within(waiting) == []
    assert_sequence(await within(iterating), 0, [b"only"])
    assert await within(unborn) == []
    with pytest.raises(WalClosedError):
        await store.append("t", Entry(b"late"))
    assert await store.create_reader("t", 0).next_batch() == []


async def test_slow_reader_blocks_neither_appends_nor_other_readers(stores: StoreFactory) -> None:
    store = await stores.open(
        segment_bytes=64 * KiB, cache_max_bytes=128 * KiB, cache_topic_max_bytes=32 * KiB
    )
    rng = random.Random(7)
    payloads = [rng.randbytes(rng.randint(0, 600)) for _ in range(4000)]
    await append_all(store, "t", payloads[:10])
    idle = store.create_reader("t", 0, max_batch=8)
    assert_sequence(await idle.next_batch(), 0, payloads[:8])
    idle_elsewhere = store.create_reader("t", 9)  # caught up: registered as a waiter
    waiting = asyncio.create_task(idle_elsewhere.next_batch())
    follower = asyncio.create_task(read_until(store.create_reader("t", 10), 4000))

    async def produce(chunk: list[bytes]) -> None:
        for i in range(0, len(chunk), 20):
            await asyncio.gather(*(store.append("t", Entry(p)) for p in chunk[i : i + 20]))

    # Sequential chunks keep payload order = offset order; each chunk commits many times.
    await within(produce(payloads[10:]), 30)
    assert info_of(store, "t").high_watermark == 4000
    assert_sequence(await within(follower), 10, payloads[10:])
    assert waiting.done()
    assert_sequence(await waiting, 9, payloads[9 : 9 + len(waiting.result())])

    # The idle reader lost nothing while it sat still.
    assert_sequence(await read_until(idle, 4000), 8, payloads[8:])


async def test_sealed_segments_are_announced_once_with_their_size(stores: StoreFactory) -> None:
    store = await stores.open(segment_bytes=4 * KiB, segment_seconds=0.1)
    announced: list[Sealed] = []
    store.set_sealed_callback(announced.append)
    payloads = [b"%04d" % i * 50 for i in range(100)]
    await append_all(store, "t", payloads)
    region = store.regions[0]
    idle = region.active_seq  # holds data, and gets none for longer than segment_seconds
    await asyncio.sleep(0.3)
    await store.append("t", Entry(b"next"))  # committed after the idle segment's seal

    seqs = [s.seq for s in announced]
    assert seqs == sorted(set(seqs)) and set(seqs) == region.sealed
    # The idle segment was sealed by age. ("next" went into a segment created during the sleep,
    # so it may be older than segment_seconds already: its own seal can be in flight now.)
    assert idle in seqs and region.active_seq > idle
    for sealed in announced:
        assert sealed.region == "r0"
        assert sealed.size == region.segment_sizes[sealed.seq]
        if stores.wal_dir is None:
            assert sealed.path is None
        else:
            assert sealed.path is not None and Path(sealed.path).stat().st_size == sealed.size
    got = await read_until(store.create_reader("t", 0), 101)
    assert_sequence(got, 0, [*payloads, b"next"])
