"""Planning complete partitions from real manifest entries and topic clocks."""

from __future__ import annotations

import pytest

from danube_ingest.analytics.errors import CommitFailedError
from danube_ingest.analytics.plan import complete_partitions, plan_run, read_plan_input
from danube_ingest.analytics.renditions import create_rendition, create_table
from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.clock import TopicClock

from .tables_support import HOUR, T0, TOPIC, ingest_ms_of, object_range, publish_input

TEN_MIN = 600_000


def test_only_partitions_the_clock_has_passed() -> None:
    # Offsets 0..299 at 6 s apart: 100 per 10 minutes, so [T0, T0 + 30 min) in three ranges.
    ranges = [object_range(0, 120), object_range(120, 300)]
    clock = TopicClock(offset=300, ingest_ms=T0 + 25 * 60_000)
    parts = complete_partitions(clock, ranges, width_s=600)
    assert [(p.start_ms, p.end_ms) for p in parts] == [
        (T0, T0 + TEN_MIN),
        (T0 + TEN_MIN, T0 + 2 * TEN_MIN),
    ]
    first, second = parts
    assert first.ranges == (ranges[0],)
    assert (first.min_offset, first.end_offset) == (0, 120)
    assert second.ranges == (ranges[0], ranges[1])
    assert second.min_offset <= 100 and second.end_offset >= 200
    # Nothing is complete before the clock passes a partition's end, nor without a clock.
    assert complete_partitions(TopicClock(300, T0 + TEN_MIN - 1), ranges, width_s=600) == []
    assert complete_partitions(None, ranges, width_s=600) == []
    assert complete_partitions(TopicClock(300, T0 + HOUR), ranges, width_s=3600)[0].end_ms == (
        T0 + HOUR
    )


def test_starts_at_the_frontier_and_returns_empty_partitions_too() -> None:
    ranges = [object_range(0, 100)]  # [T0, T0 + 10 min)
    clock = TopicClock(offset=100, ingest_ms=T0 + 3 * HOUR + 1)  # idle for hours: markers
    parts = complete_partitions(clock, ranges, width_s=3600, upper_ms=T0 + HOUR)
    assert [p.start_ms for p in parts] == [T0 + HOUR, T0 + 2 * HOUR]
    assert all(p.empty and p.min_offset == p.end_offset == 100 for p in parts)
    assert complete_partitions(clock, ranges, width_s=3600, limit=2) == [
        complete_partitions(clock, ranges, width_s=3600)[0],
        parts[0],
    ]
    # No entry at all and no frontier: nothing to start from.
    assert complete_partitions(clock, [], width_s=3600) == []
    assert len(complete_partitions(clock, [], width_s=3600, upper_ms=T0)) == 3


def test_an_empty_partition_between_entries_points_at_the_next_range() -> None:
    late = object_range(100, 110, at=lambda o: ingest_ms_of(o) + 2 * HOUR)
    ranges = [object_range(0, 100), late]
    clock = TopicClock(offset=110, ingest_ms=T0 + 4 * HOUR)
    parts = complete_partitions(clock, ranges, width_s=3600)
    assert [(p.start_ms, p.min_offset, p.end_offset, len(p.ranges)) for p in parts] == [
        (T0, 0, 100, 1),
        (T0 + HOUR, 100, 100, 0),
        (T0 + 2 * HOUR, 100, 110, 1),
        (T0 + 3 * HOUR, 110, 110, 0),
    ]


async def test_plan_input_is_one_consistent_read(kv: KV, keys: Keys) -> None:
    empty = await read_plan_input(kv, keys, TOPIC)
    assert (empty.clock, empty.ranges, empty.revision) == (None, [], 0)
    clock = TopicClock(offset=300, ingest_ms=T0 + HOUR, broker="b1", epoch=1)
    await publish_input(kv, keys, [120, 300], clock)
    got = await read_plan_input(kv, keys, TOPIC)
    assert got.clock == clock
    assert got.ranges == [object_range(0, 120), object_range(120, 300)]
    clock_kv = await kv.get(keys.topic_clock(TOPIC))
    assert clock_kv is not None and got.revision == clock_kv.mod_revision
    parts = complete_partitions(got.clock, got.ranges, width_s=3600)
    assert [p.start_ms for p in parts] == [T0]


async def test_plan_run_starts_at_the_rendition_frontier_or_since(kv: KV, keys: Keys) -> None:
    await publish_input(kv, keys, [120, 300], TopicClock(offset=300, ingest_ms=T0 + HOUR))
    with pytest.raises(CommitFailedError, match="no table or no rendition r1"):
        await plan_run(kv, keys, TOPIC, "r1")
    await create_table(kv, keys, TOPIC, since_ms=T0 + TEN_MIN, width_s=600)
    rendition = await create_rendition(kv, keys, TOPIC, "v1")
    plan = await plan_run(kv, keys, TOPIC, rendition, limit=3)
    assert plan.width_s == 600
    assert [p.start_ms for p in plan.partitions] == [T0 + i * TEN_MIN for i in (1, 2, 3)]
    assert plan.input_revision == (await read_plan_input(kv, keys, TOPIC)).revision
