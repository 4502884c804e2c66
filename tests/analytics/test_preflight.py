"""danube_ingest.analytics.preflight on a real etcd and an fs store: a minute table created
mid-hour has partitions only from its since (earlier minutes of the hour are outside it, not an
error), complete and committed partitions are told apart, a partition not complete and a
missing object are refused naming them; and the pending partitions of a minute table are its
complete, uncommitted minutes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.analytics.convert import ConvertError, pending_partitions
from danube_ingest.analytics.preflight import preflight, table_starts
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from tests.pipelines.parquet_support import (
    H0,
    HOUR,
    MINUTE,
    SINCE,
    TOPIC,
    convert,
    minute_table,
    publish_topic,
)

pytestmark = [pytest.mark.etcd]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ObjectStore]:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    yield store
    await store.close()


async def test_minutes_before_since_are_outside_the_table_not_an_error(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys, hours=1, objects=store)
    await minute_table(etcd_kv, keys)
    hour = [H0 + i * MINUTE for i in range(60)]
    checked = await preflight(etcd_kv, keys, TOPIC, hour, objects=store)
    assert (checked.width_s, checked.since_ms) == (60, SINCE)
    assert sorted(checked.outside) == hour[:37]
    assert "before the table's since" in checked.outside[H0]
    assert checked.convert == hour[37:] and checked.committed == []
    assert checked.objects  # the manifest's objects holding minutes 37..59
    await convert(etcd_kv, keys, store, hour[37:40], width_s=60)
    checked = await preflight(etcd_kv, keys, TOPIC, hour[30:45])
    assert sorted(checked.outside) == hour[30:37]
    assert checked.committed == hour[37:40] and checked.convert == hour[40:45]
    # A start off the table's grid is not one of its partitions either.
    off = await preflight(etcd_kv, keys, TOPIC, [SINCE + 30_000])
    assert "not the start of a partition" in off.outside[SINCE + 30_000]


async def test_a_partition_not_complete_is_refused_naming_it(etcd_kv: EtcdKV, keys: Keys) -> None:
    # The clock half-way through the second hour.
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=HOUR // 2)
    with pytest.raises(ConvertError, match=r"partition .* of /default/orders is not complete"):
        await preflight(etcd_kv, keys, TOPIC, [H0, H0 + HOUR])
    try:
        await preflight(etcd_kv, keys, TOPIC, [H0 + HOUR])
    except ConvertError as exc:
        assert exc.cause == "not_complete"


async def test_a_missing_object_is_refused_naming_it(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys, hours=2, objects=store)
    checked = await preflight(etcd_kv, keys, TOPIC, [H0 + HOUR], objects=store)
    gone = checked.objects[-1]
    await store.delete(gone)
    with pytest.raises(ConvertError, match=rf"missing from the object store: .*{gone}") as refused:
        await preflight(etcd_kv, keys, TOPIC, [H0 + HOUR], objects=store)
    assert refused.value.cause == "object_missing"
    # Partitions that do not read it pass.
    assert (await preflight(etcd_kv, keys, TOPIC, [H0], objects=store)).convert == [H0]


async def test_table_starts_begin_at_since_and_continue_after_a_start(
    etcd_kv: EtcdKV, keys: Keys
) -> None:
    await publish_topic(etcd_kv, keys, hours=2, extra_ms=HOUR // 2)
    # No table yet: the hourly table a first run would make, from the first ingest hour.
    assert await table_starts(etcd_kv, keys, TOPIC) == [H0, H0 + HOUR]
    await minute_table(etcd_kv, keys)
    starts = await table_starts(etcd_kv, keys, TOPIC)
    assert starts == list(range(SINCE, H0 + 2 * HOUR + HOUR // 2, MINUTE))
    assert await table_starts(etcd_kv, keys, TOPIC, after_ms=starts[9], limit=3) == starts[10:13]
    assert await table_starts(etcd_kv, keys, TOPIC, after_ms=starts[-1]) == []


async def test_a_minute_tables_pending_partitions_are_its_complete_uncommitted_minutes(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    """Replaces the hour grouping (``pending_hours``): a minute is pending as soon as it is
    complete, not once its whole hour is."""
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=5 * MINUTE + 1)
    await minute_table(etcd_kv, keys)
    minutes = list(range(SINCE, H0 + HOUR + 5 * MINUTE, MINUTE))
    assert await pending_partitions(etcd_kv, keys, TOPIC) == minutes
    await convert(etcd_kv, keys, store, minutes[:10], width_s=60)
    assert await pending_partitions(etcd_kv, keys, TOPIC) == minutes[10:]


async def test_the_spark_job_refuses_a_partition_not_complete_before_starting_spark(
    etcd_kv: EtcdKV, etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    """``danube_ingest.analytics.job`` (Spark engine) asked for an hour its clock has not
    passed: exit 1 with the one-line cause, and no SparkSession was started for it."""
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=HOUR // 2)
    env = {
        **os.environ,
        "DANUBE_INGEST_ETCD_ENDPOINTS": etcd_server,
        "DANUBE_INGEST_ETCD_PREFIX": keys.prefix,
        "DANUBE_INGEST_DATA_DIR": str(tmp_path),
    }
    command = [sys.executable, "-m", "danube_ingest.analytics.job", "--topic", TOPIC]
    done = await asyncio.to_thread(
        subprocess.run,
        [*command, "--start-ms", str(H0 + HOUR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "is not complete: its clock is at 2026-11-23T11:30:00Z" in done.stderr, done.stderr
    assert "spark" not in done.stderr.lower(), done.stderr
