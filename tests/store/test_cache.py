"""WALCache: both byte bounds hold after every extend, and reads return exactly what is cached.

A model of the cache's input (the blocks given to ``extend``, each with the body of the frame
it was written in) is checked against what the cache reports through its public interface: the
cached run of a topic is a suffix of its blocks starting at ``first_offset``, and its size is
the sum of those blocks' sizes. Blocks older than the newest ``hot_max_bytes`` are kept as
bytes and decoded when read: the same entries, as new objects.
"""

from __future__ import annotations

import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from danube_ingest.store import WALCache
from danube_ingest.wal import Entry
from danube_ingest.wal.block import served_block
from danube_ingest.wal.framing import messages_frame
from danube_ingest.wal.meta import TopicMeta
from danube_ingest.wal.stored import StoredEntries


class Model:
    """What was given to a cache: per topic, its blocks as (first offset, entries, size)."""

    def __init__(self, cache: WALCache, topics: int) -> None:
        self.cache = cache
        self.topics = [TopicMeta(f"t{i}", i + 1) for i in range(topics)]
        self.blocks: dict[TopicMeta, list[tuple[int, list[Entry], int]]] = {
            t: [] for t in self.topics
        }
        self.next_offset = dict.fromkeys(self.topics, 0)

    def extend(self, topic: TopicMeta, count: int, size: int, gap: int = 0) -> None:
        first = self.next_offset[topic] + gap
        if gap:
            self.blocks[topic] = []  # the cache must forget a run that does not continue
        entries = [
            Entry(b"%d" % o, offset=o, producer_name="p", routing_key="k" if o % 3 else None)
            for o in range(first, first + count)
        ]
        body = messages_frame(topic.topic_id, first, entries)[1:]
        self.cache.extend(topic, entries, size, body)
        self.blocks[topic].append((first, entries, size))
        self.next_offset[topic] = first + count

    def cached_bytes(self, topic: TopicMeta) -> int:
        first = self.cache.first_offset(topic)
        if first is None:
            return 0
        return sum(size for start, _, size in self.blocks[topic] if start >= first)

    def check(self) -> None:
        cache = self.cache
        assert cache.nbytes <= cache.max_bytes
        total = 0
        for topic in self.topics:
            cached = self.cached_bytes(topic)
            assert cached <= cache.topic_max_bytes, f"{topic.name} holds {cached} bytes"
            total += cached
            self.check_reads(topic)
        assert cache.nbytes == total

    def check_reads(self, topic: TopicMeta) -> None:
        cache = self.cache
        first = cache.first_offset(topic)
        end = self.next_offset[topic]
        known = [e for start, entries, _ in self.blocks[topic] for e in entries]
        if first is None:
            assert all(cache.read(topic, e.offset, 10) == [] for e in known)
            return
        # The cached run starts at a block boundary and reaches the newest entry.
        assert first in {start for start, _, _ in self.blocks[topic]}
        whole = cache.read(topic, first, 1 << 30)
        assert [e.offset for e in whole] == list(range(first, end))
        assert whole == known[-len(whole) :]
        # The newest hot_max_bytes are served as the very objects appended (what live readers
        # read), older blocks decoded from their bytes.
        same = [a is b for a, b in zip(whole, known[-len(whole) :], strict=True)]
        assert same == sorted(same), "hot blocks are the newest ones"
        for offset in {first - 1, first, (first + end) // 2, end - 1, end, end + 5}:
            for limit in (1, 3, 1 << 30):
                got = cache.read(topic, offset, limit)
                if first <= offset < end:
                    assert [e.offset for e in got] == list(range(offset, min(end, offset + limit)))
                else:
                    assert got == []


@settings(max_examples=300, deadline=None)
@given(
    max_bytes=st.integers(1, 5000),
    topic_share=st.floats(0.05, 1.0),
    hot_max=st.sampled_from([0, 1, 500, 3000, 1 << 30]),
    ops=st.lists(
        st.tuples(
            st.integers(0, 3),  # topic
            st.integers(1, 5),  # entries
            st.integers(0, 3000),  # block bytes, at times above either bound
            st.sampled_from([0, 0, 0, 0, 0, 0, 1, 7]),  # offset gap before the block
        ),
        max_size=80,
    ),
)
def test_bounds_hold_after_every_extend(
    max_bytes: int, topic_share: float, hot_max: int, ops: list[tuple[int, int, int, int]]
) -> None:
    cache = WALCache(max_bytes, max(1, int(max_bytes * topic_share)), hot_max)
    model = Model(cache, topics=4)
    for topic, count, size, gap in ops:
        model.extend(model.topics[topic], count, size, gap)
        model.check()


def test_random_workload_keeps_bounds_and_contents() -> None:
    rng = random.Random(5)
    model = Model(WALCache(64 * 1024, 16 * 1024, hot_max_bytes=8 * 1024), topics=20)
    for _ in range(5000):
        topic = rng.choice(model.topics)
        model.extend(topic, rng.randint(1, 40), rng.choice([0, 100, 1000, 5000, 20000]))
        assert model.cache.nbytes <= model.cache.max_bytes
    model.check()


def test_block_larger_than_the_topic_bound_is_not_kept() -> None:
    model = Model(WALCache(10_000, 1_000), topics=2)
    a, b = model.topics
    model.extend(a, 3, 400)
    model.extend(a, 2, 5_000)  # alone above topic_max_bytes
    model.check()
    assert model.cache.read(a, 3, 10) == []
    model.extend(a, 1, 100)  # continues the run after the dropped block
    model.check()
    assert [e.offset for e in model.cache.read(a, 5, 10)] == [5]

    model.extend(b, 1, 20_000)  # alone above max_bytes too
    model.check()
    assert model.cache.first_offset(b) is None


def test_least_recently_appended_topic_is_evicted_first() -> None:
    model = Model(WALCache(1_000, 600), topics=3)
    a, b, c = model.topics
    model.extend(a, 1, 300)
    model.extend(b, 1, 300)
    model.extend(a, 1, 300)  # a is now the most recently appended
    model.extend(c, 1, 300)
    model.check()
    assert model.cache.first_offset(b) is None
    assert model.cache.first_offset(a) == 0
    assert model.cache.first_offset(c) == 0


def test_per_topic_bound_evicts_oldest_blocks_of_that_topic() -> None:
    model = Model(WALCache(100_000, 1_000), topics=2)
    a, b = model.topics
    model.extend(b, 2, 500)
    for _ in range(10):
        model.extend(a, 4, 300)
    model.check()
    assert model.cache.first_offset(a) == 28  # the newest three blocks of four entries
    assert model.cache.first_offset(b) == 0


def test_many_evictions_compact_without_losing_entries() -> None:
    model = Model(WALCache(1 << 20, 5_000), topics=1)
    (topic,) = model.topics
    for _ in range(5_000):  # well past the compaction threshold, several times
        model.extend(topic, 2, 10)
    model.check()
    assert model.cache.first_offset(topic) == 10_000 - 1_000


def test_drop_forgets_a_topic() -> None:
    model = Model(WALCache(10_000, 5_000), topics=2)
    a, b = model.topics
    model.extend(a, 5, 1_000)
    model.extend(b, 5, 2_000)
    model.cache.drop(a)
    assert model.cache.first_offset(a) is None
    assert model.cache.read(a, 0, 10) == []
    assert model.cache.nbytes == 2_000
    model.cache.drop(a)  # idempotent
    assert model.cache.nbytes == 2_000


def test_topic_bound_above_total_bound_is_rejected() -> None:
    with pytest.raises(ValueError, match="topic_max_bytes"):
        WALCache(1_000, 2_000)


def test_only_the_newest_blocks_are_kept_as_objects() -> None:
    # Cold blocks are bytes, which the garbage collector does not track: however much is
    # cached, a full collection only meets the entries of the newest hot_max_bytes.
    cache = WALCache(1 << 30, 1 << 30, hot_max_bytes=10 * 1_000)
    topics = [TopicMeta(f"t{i}", i + 1) for i in range(4)]
    payload = bytes(100)

    def live_entries() -> int:
        gc.collect()
        return sum(isinstance(o, Entry) for o in gc.get_objects())

    before = live_entries()
    for n in range(400):
        topic = topics[n % 4]
        first = n // 4 * 100
        entries = [Entry(payload, offset=first + i) for i in range(100)]
        cache.extend(topic, entries, 1_000, messages_frame(topic.topic_id, first, entries)[1:])
    del entries
    assert cache.nbytes == 400 * 1_000
    assert live_entries() - before <= 10 * 100  # ten hot blocks of 100 entries
    for topic in topics:
        got = cache.read(topic, 0, 1 << 30)
        assert [e.offset for e in got] == list(range(10_000))
        assert all(e.payload == payload for e in got)
    del got
    assert live_entries() - before <= 10 * 100

    # Without frame bodies a block cannot be cooled: it stays as it was given.
    plain = WALCache(1 << 30, 1 << 30, hot_max_bytes=0)
    kept = [Entry(payload, offset=i) for i in range(3)]
    plain.extend(topics[0], kept, 1_000)
    assert all(a is b for a, b in zip(plain.read(topics[0], 0, 10), kept, strict=True))


def test_a_cold_block_read_in_pieces_is_not_walked_from_its_start_each_time() -> None:
    """A reader taking a cold block a few entries at a time (as the dispatcher does, 256 per
    read) gets the same entries in any order of reads; going on from where the last read of
    that block stopped, the read starts there (``decode_messages(resume=...)``)."""
    cache = WALCache(1 << 30, 1 << 30, hot_max_bytes=0)
    topic = TopicMeta("t", 1)
    entries = [
        Entry(b"p%d" % i, offset=i, routing_key="k" if i % 3 else None, attributes={"a": "b"})
        for i in range(1000)
    ]
    cache.extend(topic, entries, 100_000, messages_frame(topic.topic_id, 0, entries)[1:])
    got: list[Entry] = []
    while len(got) < 1000:
        got += cache.read(topic, len(got), 256)
        assert cache._topics[topic].resume == (
            cache._topics[topic].blocks[0],
            len(got),
            got[-1]._end,
        )
    assert got == entries
    # Backwards, or again from the same place: still the right entries.
    for start in (900, 10, 10, 0, 999, 500):
        assert cache.read(topic, start, 7) == entries[start : start + 7]
    # Evicted: the memo goes with the block.
    cache.extend(topic, [Entry(b"x", offset=1000)], 1 << 30)
    assert cache._topics[topic].resume is None


def test_stored_reads_build_no_entries_and_serve_the_decoded_bytes() -> None:
    """A frame consumer's reader (``stored=True``) gets the blocks' bodies, hot ones cooled on
    the spot, never an Entry per message; what it serves is byte for byte what the decoded
    entries are served as."""
    cache = WALCache(1 << 30, 1 << 30, hot_max_bytes=3 * 1_000)
    topic = TopicMeta("t", 1)
    blocks = []
    for n in range(6):
        entries = [
            Entry(b"m%d" % (n * 100 + i), offset=n * 100 + i, routing_key="k" if i % 2 else None)
            for i in range(100)
        ]
        cache.extend(topic, entries, 1_000, messages_frame(topic.topic_id, n * 100, entries)[1:])
        blocks.append(entries)
    decoded = [e for entries in blocks for e in entries]
    del entries, blocks

    def live_entries() -> int:
        gc.collect()
        return sum(isinstance(o, Entry) for o in gc.get_objects())

    for start, limit in ((0, 1 << 30), (150, 256), (299, 2), (420, 1000), (599, 5)):
        before = live_entries()
        got = cache.read(topic, start, limit, stored=True)
        assert isinstance(got, StoredEntries)
        assert live_entries() == before, "a stored read built Entry objects"
        want = decoded[start : start + limit]
        assert (got.first_offset, got.last_offset, len(got)) == (
            want[0].offset,
            want[-1].offset,
            len(want),
        )
        assert got.block() == served_block(want)
        assert [e.payload for e in got] == [e.payload for e in want]
    assert all(isinstance(b, bytes) for b in cache._topics[topic].blocks), "hot blocks cooled"
    # Per-message readers still get the same entries.
    assert cache.read(topic, 0, 1 << 30) == decoded

    # A block appended without its body can only be read as entries.
    plain = WALCache(1 << 30, 1 << 30)
    kept = [Entry(b"x", offset=i) for i in range(3)]
    plain.extend(topic, kept, 1_000)
    got = plain.read(topic, 0, 10, stored=True)
    assert isinstance(got, list) and all(a is b for a, b in zip(got, kept, strict=True))
