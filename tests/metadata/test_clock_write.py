"""The topic clock's write side (``ClockWriter``): only forward, only by the owner at the mark's
epoch, compare-and-swap against other writers. MemoryKV and a real etcd."""

from __future__ import annotations

from danube_ingest.metadata.clock import ClockMark, ClockWriter, TopicClock, read_clock
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV

from .conftest import Broker

TOPIC = "/default/clocked"


async def test_the_clock_only_moves_forward_field_by_field(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    epoch = (await a.ownership.acquire(TOPIC)).epoch
    writer = ClockWriter(a.ownership)

    first = await writer.advance({TOPIC: ClockMark(10, 1_000, epoch)})
    assert first.writes == 1 and first.fenced == []
    assert await read_clock(kv, keys, TOPIC) == TopicClock(10, 1_000, "a", epoch)
    # A later time at a lower offset: both facts hold, so both maxima are stored.
    await writer.advance({TOPIC: ClockMark(5, 2_000, epoch)})
    assert await read_clock(kv, keys, TOPIC) == TopicClock(10, 2_000, "a", epoch)
    # Nothing newer: nothing written.
    stale = await writer.advance({TOPIC: ClockMark(3, 500, epoch)})
    assert stale.writes == 0 and stale.stored[TOPIC] == TopicClock(10, 2_000, "a", epoch)
    assert await read_clock(kv, keys, TOPIC) == TopicClock(10, 2_000, "a", epoch)


async def test_a_clock_changed_by_another_writer_is_merged_not_overwritten(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    epoch = (await a.ownership.acquire(TOPIC)).epoch
    writer = ClockWriter(a.ownership)
    await writer.advance({TOPIC: ClockMark(10, 1_000, epoch)})
    # Someone else moved it further meanwhile (the writer's cached revision is now stale).
    await kv.put(keys.topic_clock(TOPIC), TopicClock(50, 900_000, "x", epoch).encode())
    result = await writer.advance({TOPIC: ClockMark(20, 5_000, epoch)})
    assert result.fenced == [] and result.contended == []
    assert await read_clock(kv, keys, TOPIC) == TopicClock(50, 900_000, "x", epoch)
    await writer.advance({TOPIC: ClockMark(60, 5_000, epoch)})
    assert await read_clock(kv, keys, TOPIC) == TopicClock(60, 900_000, "a", epoch)


async def test_a_fenced_owner_cannot_move_the_clock(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    epoch_a = (await a.ownership.acquire(TOPIC)).epoch
    writer_a = ClockWriter(a.ownership)
    await writer_a.advance({TOPIC: ClockMark(10, 1_000, epoch_a)})

    # b never owned the topic: it writes nothing.
    refused = await ClockWriter(b.ownership).advance({TOPIC: ClockMark(99, 99_000, epoch_a)})
    assert refused.fenced == [TOPIC] and refused.writes == 0

    # a loses the topic to b (a's session ends, b acquires at the next epoch) ...
    await a.session.close()
    epoch_b = (await b.ownership.acquire(TOPIC)).epoch
    assert epoch_b == epoch_a + 1
    lost = await writer_a.advance({TOPIC: ClockMark(99, 99_000, epoch_a)})
    assert lost.fenced == [TOPIC] and lost.writes == 0
    assert await read_clock(kv, keys, TOPIC) == TopicClock(10, 1_000, "a", epoch_a)

    # ... and b cannot write a mark made under a's epoch either (entries stamped in between
    # by another owner are not bounded by it).
    writer_b = ClockWriter(b.ownership)
    old = await writer_b.advance({TOPIC: ClockMark(99, 99_000, epoch_a)})
    assert old.fenced == [TOPIC] and old.writes == 0
    ok = await writer_b.advance({TOPIC: ClockMark(20, 2_000, epoch_b)})
    assert ok.writes == 1
    assert await read_clock(kv, keys, TOPIC) == TopicClock(20, 2_000, "b", epoch_b)


async def test_many_topics_are_written_in_batches(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    topics = [f"/default/t{i}" for i in range(130)]  # three transactions
    marks = {}
    for i, topic in enumerate(topics):
        marks[topic] = ClockMark(i, 1_000 + i, (await a.ownership.acquire(topic)).epoch)
    result = await ClockWriter(a.ownership).advance(marks)
    assert result.writes == len(topics) and result.fenced == []
    for i, topic in enumerate(topics):
        assert await read_clock(kv, keys, topic) == TopicClock(i, 1_000 + i, "a", 1)
