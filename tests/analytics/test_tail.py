"""The tail (``analytics/tail.py``): entries past the committed partitions become visible by
name as the clock passes each step, the Iceberg table then holds exactly the entries below the
tail's end, and the partition's commit replaces the tail's pieces in one snapshot. Real etcd,
real ``.bin`` objects, an fs warehouse, the SQLite catalog."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.iceberg import (
    TAIL_TOKEN,
    IcebergTarget,
    check_table,
    freshness,
    identifier,
    maintain,
    publish,
)
from danube_ingest.analytics.tail import TailError, extend_tail, read_tail
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.objects.store import ObjectStore
from tests.analytics.test_iceberg_lifecycle import target
from tests.pipelines.parquet_support import H0, HOUR, MINUTE, ROOT, TOPIC, ingest_ms, publish_topic

pytestmark = [pytest.mark.etcd]


_target = target  # (a broker's target with data and objects in tmp_path)


async def _clock(kv: EtcdKV, keys: Keys, at_ms: int) -> None:
    clock = TopicClock(offset=1200, ingest_ms=at_ms, broker="b1", epoch=1)
    await kv.put(keys.topic_clock(TOPIC), clock.encode())


def _offsets(target: IcebergTarget) -> list[int]:
    table = target.catalog().load_table(identifier(TOPIC))
    return sorted(table.scan().to_arrow().column("offset").to_pylist())


def _below(frontier_ms: int) -> list[int]:
    return [o for o in range(1200) if ingest_ms(o) < frontier_ms]


async def test_the_tail_shows_entries_before_their_partition_completes(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    # The first hour is committed; the clock is 25 min 3 s into the second.
    await _clock(etcd_kv, keys, H0 + HOUR + 25 * MINUTE + 3_000)
    done = await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    assert done.upper_ms == H0 + HOUR and _offsets(target) == _below(H0 + HOUR)

    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    assert step is not None and step.recorded
    assert (step.frontier_ms, step.added, step.rows) == (H0 + HOUR + 25 * MINUTE, 1, 250)
    published = await publish(etcd_kv, keys, TOPIC, target)
    assert published is not None and (published.added, published.removed) == (1, 0)
    assert _offsets(target) == _below(H0 + HOUR + 25 * MINUTE)
    table = target.catalog().load_table(identifier(TOPIC))
    summary = table.current_snapshot().summary
    assert summary["danube.frontier-ms"] == str(H0 + HOUR + 25 * MINUTE)
    assert summary["danube.tokens"] == TAIL_TOKEN
    assert await check_table(etcd_kv, keys, TOPIC, target) == []
    fresh = await freshness(etcd_kv, keys, TOPIC, target)
    assert fresh is not None and fresh.lag_ms == 3_000 and not fresh.stale()
    # The same clock again: nothing new; the pieces are not the rendition's files.
    again = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    assert again is not None and (again.added, again.dropped) == (0, 0)
    tail, _ = await read_tail(etcd_kv, keys, TOPIC)
    assert tail is not None and all(
        f.path.startswith(f"{ROOT}_tails/") for p in tail.pieces for f in p.files
    )

    # 15 more minutes, at a 60 s step: a second piece.
    await _clock(etcd_kv, keys, H0 + HOUR + 40 * MINUTE + 59_000)
    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT, step_s=60)
    assert step is not None and (step.frontier_ms, step.added, step.rows) == (
        H0 + HOUR + 40 * MINUTE,
        1,
        150,
    )
    await publish(etcd_kv, keys, TOPIC, target)
    assert _offsets(target) == _below(H0 + HOUR + 40 * MINUTE)

    # The hour completes and is converted: its file replaces the two pieces in one snapshot.
    await _clock(etcd_kv, keys, H0 + 2 * HOUR)
    done = await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    assert done.published is not None
    assert (done.published.added, done.published.removed) == (1, 2)
    assert _offsets(target) == list(range(1200))
    assert await check_table(etcd_kv, keys, TOPIC, target) == []
    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    assert step is not None and (step.added, step.dropped, step.frontier_ms) == (
        0,
        2,
        H0 + 2 * HOUR,
    )
    tail, _ = await read_tail(etcd_kv, keys, TOPIC)
    assert tail is not None and tail.pieces == []
    unchanged = await publish(etcd_kv, keys, TOPIC, target)
    assert unchanged is not None and unchanged.snapshot_id is None

    # Maintenance: the replaced pieces stay while a snapshot holds them (time travel), and go
    # with the last such snapshot; no other file goes.
    pieces = sorted((tmp_path / "objects" / ROOT / "_tails").rglob("*.parquet"))
    others = sorted(p for p in (tmp_path / "objects" / ROOT).rglob("*.parquet") if p not in pieces)
    assert len(pieces) == 2 and others
    later = int(time.time() * 1000) + 2 * 3600 * 1000
    tails = (etcd_kv, keys, ROOT)
    day = 86400
    kept = await maintain(target, TOPIC, now_ms=later, tails=tails, max_tail_snapshot_age_s=day)
    assert kept is not None and kept.snapshots_expired == 0 and all(p.exists() for p in pieces)
    swept = await maintain(target, TOPIC, now_ms=later, tails=tails, max_snapshot_age_s=0)
    assert swept is not None and swept.snapshots_expired > 0
    assert not any(p.exists() for p in pieces) and all(p.exists() for p in others)
    assert _offsets(target) == list(range(1200))
    with pytest.raises(TailError, match="at least 1 s"):
        await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT, step_s=0.5)
    await store.close()


async def test_a_missing_object_is_a_tail_error_and_records_nothing(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await _clock(etcd_kv, keys, H0 + HOUR + 10 * MINUTE)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    key = f"topics/default/orders/{600:020d}.bin"
    await store.delete(key)
    with pytest.raises(TailError, match=key):
        await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
    tail, revision = await read_tail(etcd_kv, keys, TOPIC)
    assert (tail, revision) == (None, 0)
    await store.close()


@pytest.mark.dagster
async def test_the_dagster_sensor_extends_and_publishes_the_tail(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    """``iceberg_tail_sensor`` evaluated by Dagster: the tail of the open hour appears in the
    Iceberg table; a tick with nothing new changes nothing; ``tail_step_seconds: 0`` skips."""
    import asyncio

    import yaml
    from dagster import SkipReason, build_sensor_context, instance_for_test

    from assets.tails import iceberg_tail_sensor
    from pipelines.resources import EtcdResource, ObjectStoreResource

    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await _clock(etcd_kv, keys, H0 + HOUR + 30 * MINUTE + 9_000)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    etcd = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)

    def tick(config_path: str = "") -> str:
        objects = ObjectStoreResource(data_dir=str(tmp_path), config_path=config_path)
        with instance_for_test() as instance:
            context = build_sensor_context(
                instance=instance, resources={"etcd": etcd, "objects": objects}
            )
            result = iceberg_tail_sensor(context)
        assert isinstance(result, SkipReason)
        return result.skip_message or ""

    assert (await asyncio.to_thread(tick)).startswith("1 of 1 tables extended, 0 failed")
    assert _offsets(target) == _below(H0 + HOUR + 30 * MINUTE)
    assert (await asyncio.to_thread(tick)).startswith("0 of 1 tables extended")
    off = tmp_path / "off.yaml"
    off.write_text(yaml.safe_dump({"iceberg": {"tail_step_seconds": 0}}))
    assert "tail_step_seconds is 0" in await asyncio.to_thread(tick, str(off))
    await store.close()


async def test_create_makes_the_table_a_first_run_would(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=1, objects=store)
    await _clock(etcd_kv, keys, H0 + 20 * MINUTE)
    assert await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT) is None
    step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT, create=True)
    assert step is not None and (step.rendition, step.frontier_ms, step.rows) == (
        "r1",
        H0 + 20 * MINUTE,
        200,
    )
    await publish(etcd_kv, keys, TOPIC, target)
    assert _offsets(target) == _below(H0 + 20 * MINUTE)
    await store.close()


async def test_an_idle_topics_tail_stays_one_empty_piece_per_partition(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    """Steps over a quiet stretch (no entries) move the frontier with the clock, as one empty
    piece per partition, not one per step; no file is written."""
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await publish_topic(etcd_kv, keys, hours=1, objects=store)
    await _clock(etcd_kv, keys, H0 + HOUR)
    await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    for minutes in (1, 2, 3, 61):
        await _clock(etcd_kv, keys, H0 + HOUR + minutes * MINUTE)
        step = await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
        assert step is not None and step.rows == 0
        assert step.frontier_ms == H0 + HOUR + minutes * MINUTE
    tail, _ = await read_tail(etcd_kv, keys, TOPIC)
    assert tail is not None
    assert [(p.start_ms, p.end_ms, p.files) for p in tail.pieces] == [
        (H0 + HOUR, H0 + 2 * HOUR, []),
        (H0 + 2 * HOUR, H0 + 2 * HOUR + MINUTE, []),
    ]
    assert not (tmp_path / "objects" / ROOT / "_tails").exists()
    await store.close()


async def test_maintenance_expires_tail_snapshots_after_an_hour_and_keeps_the_partitions(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    """A tail step commits a snapshot every 10 s: those expire after an hour
    (``max_tail_snapshot_age_s``), while the conversions' snapshots stay for
    ``max_snapshot_age_s`` (5 days) and time travel to them still works."""
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    target = _target(tmp_path)
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    await _clock(etcd_kv, keys, H0 + HOUR + 25 * MINUTE)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    for minutes in (25, 40):
        await _clock(etcd_kv, keys, H0 + HOUR + minutes * MINUTE)
        await extend_tail(etcd_kv, keys, TOPIC, store, store, root=ROOT)
        await publish(etcd_kv, keys, TOPIC, target)
    await _clock(etcd_kv, keys, H0 + 2 * HOUR)
    await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, iceberg=target
    )
    table = target.catalog().load_table(identifier(TOPIC))
    tokens = [s.summary["danube.tokens"] for s in table.snapshots()]
    assert (
        len(tokens) == 4
        and tokens[1:3] == [TAIL_TOKEN, TAIL_TOKEN]
        and TAIL_TOKEN not in (tokens[0] + tokens[3])
    )
    first = table.snapshots()[0].snapshot_id
    in_two_hours = int(time.time() * 1000) + 2 * HOUR

    kept = await maintain(target, TOPIC, now_ms=in_two_hours, max_tail_snapshot_age_s=5 * 86400)
    assert kept is not None and (kept.snapshots_expired, kept.snapshots_kept) == (0, 4)
    done = await maintain(target, TOPIC, now_ms=in_two_hours)  # the defaults: 1 h, 5 days
    assert done is not None and (done.snapshots_expired, done.snapshots_kept) == (2, 2)
    table = target.catalog().load_table(identifier(TOPIC))
    assert [s.summary["danube.tokens"] for s in table.snapshots()] == [tokens[0], tokens[3]]
    assert _offsets(target) == list(range(1200))
    old = table.scan(snapshot_id=first).to_arrow().column("offset").to_pylist()
    assert sorted(old) == _below(H0 + HOUR)
    await store.close()
