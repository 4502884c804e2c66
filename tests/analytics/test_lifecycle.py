"""``lifecycle``: a second rendition built beside the active one, the handover while a reader
holds the old one, and ``collect`` (held renditions kept, dead runs' staging after the grace),
on a real etcd with real ``.bin`` objects and an fs warehouse."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.analytics import layout
from danube_ingest.analytics.commit import begin
from danube_ingest.analytics.convert import CONVERTER_VERSION, convert
from danube_ingest.analytics.lifecycle import (
    COLLECT_GRACE_S,
    collect,
    expire_partitions,
    new_rendition,
)
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.records import TableKeys
from danube_ingest.analytics.renditions import activate, hold, read_rendition, read_table
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.policies import Policies, RetentionPolicy
from danube_ingest.objects.store import ObjectStore
from tests.analytics.tables_support import SCHEMA, rows
from tests.pipelines.parquet_support import H0, HOUR, ROOT, TOPIC, ingest_ms, publish_topic

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ObjectStore]:
    """The topic's objects and the warehouse, in one fs store (as the daemon's)."""
    objects = ObjectStore("fs", options={"root": str(tmp_path)})
    yield objects
    await objects.close()


def files_below(root: Path, prefix: str) -> dict[str, bytes]:
    base = root / prefix
    return {str(p.relative_to(root)): p.read_bytes() for p in base.rglob("*") if p.is_file()}


async def test_new_rendition_is_handed_over_and_the_old_one_collected_once_released(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore, tmp_path: Path
) -> None:
    await publish_topic(etcd_kv, keys, hours=2, extra_ms=1, objects=store)
    first = await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    assert first.rendition == "r1" and [p.start_ms for p in first.partitions] == [H0, H0 + HOUR]
    r1_files = files_below(tmp_path, f"{ROOT}r1/")
    assert r1_files

    assert await new_rendition(etcd_kv, keys, TOPIC) == "r2"
    r2 = await read_rendition(etcd_kv, keys, TOPIC, "r2")
    assert r2 is not None and r2.state == "building"
    assert (r2.converter_version, r2.schema_ref) == (CONVERTER_VERSION, "")
    with pytest.raises(DanubeIngestError, match="behind the table's upper"):
        await activate(etcd_kv, keys, TOPIC, "r2")
    second = await convert(
        kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, rendition="r2"
    )
    assert second.rendition == "r2" and second.upper_ms == first.upper_ms
    r2_files = files_below(tmp_path, f"{ROOT}r2/")
    assert len(r2_files) == len(r1_files)

    async with hold(etcd_kv, keys, TOPIC) as held:
        assert held == "r1"
        table = await activate(etcd_kv, keys, TOPIC, "r2")
        assert table.active == "r2"
        result = await collect(etcd_kv, keys, store)
        assert result.held == [(TOPIC, "r1")] and result.collected == []
        assert files_below(tmp_path, f"{ROOT}r1/") == r1_files
        r1 = await read_rendition(etcd_kv, keys, TOPIC, "r1")
        assert r1 is not None and r1.state == "draining"

    result = await collect(etcd_kv, keys, store, topic=TOPIC)
    assert result.collected == [(TOPIC, "r1")] and result.held == []
    assert result.files_deleted == len(r1_files)
    assert result.counts()["renditions_collected"] == 1
    assert files_below(tmp_path, f"{ROOT}r1/") == {}
    tables = TableKeys(keys, TOPIC)
    assert await etcd_kv.get_prefix(tables.parts_prefix("r1")) == []
    r1 = await read_rendition(etcd_kv, keys, TOPIC, "r1")
    assert r1 is not None and r1.state == "collected"
    assert files_below(tmp_path, f"{ROOT}r2/") == r2_files
    assert len(await etcd_kv.get_prefix(tables.parts_prefix("r2"))) == 2
    table_after = await read_table(etcd_kv, keys, TOPIC)
    assert table_after is not None and table_after.active == "r2"
    # Idempotent: nothing left to collect, the active rendition untouched.
    again = await collect(etcd_kv, keys, store)
    assert again.counts() == dict.fromkeys(again.counts(), 0)
    assert files_below(tmp_path, f"{ROOT}r2/") == r2_files


async def test_a_dead_runs_staging_is_collected_after_the_grace_and_not_before(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore, tmp_path: Path
) -> None:
    await publish_topic(etcd_kv, keys, hours=1, extra_ms=1, objects=store)
    await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    began = H0 + 5 * HOUR
    intent = await begin(etcd_kv, keys, TOPIC, "r1", [H0 + HOUR], 0, now_ms=began)
    final = f"{ROOT}{layout.partition_dir('r1', TOPIC, H0 + HOUR, 3600)}"
    staged = await write_partition(
        store, intent.staging_path(ROOT, final), [rows([1], ingest_ms)], SCHEMA
    )
    assert staged
    staging = layout.staging_prefix(ROOT)
    # While its intent lives, no grace is enough.
    live = await collect(etcd_kv, keys, store, staging_grace_s=0, now_ms=began + 10 * HOUR)
    assert live.staging_runs == [] and files_below(tmp_path, staging)
    await intent.close()  # the run dies: its intent is gone
    grace_ms = COLLECT_GRACE_S * 1000
    early = await collect(etcd_kv, keys, store, now_ms=began + grace_ms - 1000)
    assert early.staging_runs == [] and files_below(tmp_path, staging)
    late = await collect(etcd_kv, keys, store, now_ms=began + grace_ms + 1000)
    assert late.staging_runs == [intent.token]
    assert late.counts()["staging_runs_collected"] == 1
    assert files_below(tmp_path, staging) == {}
    assert files_below(tmp_path, f"{ROOT}r1/")  # the committed files are not staging


async def test_table_retention_moves_since_and_deletes_the_partitions_below(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore, tmp_path: Path
) -> None:
    await publish_topic(etcd_kv, keys, hours=3, extra_ms=1, objects=store)
    done = await convert(kv=etcd_kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
    assert [p.start_ms for p in done.partitions] == [H0, H0 + HOUR, H0 + 2 * HOUR]
    tables = TableKeys(keys, TOPIC)
    before = {e.key for e in await etcd_kv.get_prefix(tables.parts_prefix("r1"))}
    files = files_below(tmp_path, f"{ROOT}r1/")
    # Keep 90 minutes at H0 + 3h: the partition holding H0 + 1.5h (from H0 + 1h) on.
    await Policies(etcd_kv, keys).set("/default", RetentionPolicy(table_max_age_ms=HOUR * 3 // 2))
    now = H0 + 3 * HOUR

    async with hold(etcd_kv, keys, TOPIC):
        held = await expire_partitions(etcd_kv, keys, store, now_ms=now)
    assert held.since == {TOPIC: H0 + HOUR} and held.held == [(TOPIC, "r1")]
    assert held.partitions == [] and files_below(tmp_path, f"{ROOT}r1/") == files

    result = await expire_partitions(etcd_kv, keys, store, now_ms=now)
    assert result.partitions == [(TOPIC, "r1", H0)] and result.held == []
    table = await read_table(etcd_kv, keys, TOPIC)
    assert table is not None and table.since_ms == H0 + HOUR
    after = {e.key for e in await etcd_kv.get_prefix(tables.parts_prefix("r1"))}
    assert after == before - {tables.part("r1", H0)}
    left = files_below(tmp_path, f"{ROOT}r1/")
    gone = set(files) - set(left)
    assert gone and len(gone) == result.files_deleted
    assert sum(len(files[g]) for g in gone) == result.bytes_deleted
    assert all(layout.partition_dir("r1", TOPIC, H0, 3600) in g for g in gone)
    assert not any(layout.partition_dir("r1", TOPIC, H0, 3600) in k for k in left)

    again = await expire_partitions(etcd_kv, keys, store, now_ms=now)
    assert again.partitions == [] and again.files_deleted == 0
    assert files_below(tmp_path, f"{ROOT}r1/") == left
