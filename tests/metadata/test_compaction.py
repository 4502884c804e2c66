"""``compact_history`` on MemoryKV and the real etcd: history older than ``keep_s`` goes,
never past a hold, never twice."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.metadata import KV, Keys, RevisionCompactedError
from danube_ingest.metadata.compaction import (
    compact_history,
    hold_revision,
    release_revision,
    revision_holds,
)

HOUR_MS = 3_600_000
T0 = 1_700_000_000_000


async def _watch_from(kv: KV, keys: Keys, revision: int) -> None:
    """Replay one event from ``revision`` (``RevisionCompactedError`` if compacted away)."""
    stream = await kv.watch_prefix(f"{keys.prefix}/", start_revision=revision)
    try:
        await asyncio.wait_for(anext(stream), 5)
    finally:
        await stream.cancel()


async def test_compacts_at_the_newest_sample_older_than_keep(kv: KV, keys: Keys) -> None:
    first = await compact_history(kv, keys, now_ms=T0)
    assert first.compacted is None and first.previous == 0
    await kv.put(f"{keys.prefix}/x", b"1")
    half = await compact_history(kv, keys, now_ms=T0 + HOUR_MS // 2)
    assert half.compacted is None  # no sample is an hour old yet

    later = await compact_history(kv, keys, now_ms=T0 + HOUR_MS + 1)
    assert later.compacted == first.revision and later.held_by == []
    with pytest.raises(RevisionCompactedError):
        await _watch_from(kv, keys, first.revision - 1)
    await _watch_from(kv, keys, first.revision)  # what keep_s keeps is still there

    again = await compact_history(kv, keys, now_ms=T0 + HOUR_MS + 1)
    assert again.compacted is None and again.previous == first.revision
    last = await compact_history(kv, keys, now_ms=T0 + 2 * HOUR_MS)
    assert last.compacted == half.revision


async def test_never_compacts_past_a_hold(kv: KV, keys: Keys) -> None:
    held = await kv.put(f"{keys.prefix}/x", b"1")
    await hold_revision(kv, keys, "sensor", held, holder="parquet_topics_sensor")
    await compact_history(kv, keys, now_ms=T0)
    await kv.put(f"{keys.prefix}/x", b"2")
    report = await compact_history(kv, keys, now_ms=T0 + 2 * HOUR_MS)
    assert report.compacted == held
    assert report.held_by == ["hold sensor (parquet_topics_sensor)"]
    await _watch_from(kv, keys, held)
    assert await revision_holds(kv, keys) == {"hold sensor (parquet_topics_sensor)": held}
    await release_revision(kv, keys, "sensor")
    freed = await compact_history(kv, keys, now_ms=T0 + 3 * HOUR_MS)
    assert freed.compacted is not None and freed.compacted > held


async def test_an_open_conversion_holds_its_input_revision(kv: KV, keys: Keys) -> None:
    revision = await kv.put(f"{keys.prefix}/tables/ns/t/intents/tok", b'{"input_revision": 0}')
    await kv.put(
        f"{keys.prefix}/tables/ns/t/intents/tok", f'{{"input_revision": {revision}}}'.encode()
    )
    await compact_history(kv, keys, now_ms=T0)
    report = await compact_history(kv, keys, now_ms=T0 + 2 * HOUR_MS)
    assert report.compacted == revision and report.held_by == ["conversion ns/t/intents/tok"]


async def test_keep_must_be_positive(kv: KV, keys: Keys) -> None:
    with pytest.raises(ValueError, match="keep_s must be above zero"):
        await compact_history(kv, keys, keep_s=0)
