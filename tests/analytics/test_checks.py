"""danube_ingest.analytics.checks on a real etcd and an fs warehouse: which topics have
objects, and the three table checks passing on a sound table and failing on a deleted or truncated
Parquet file, a wrong row count and a gap below the frontier."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.analytics.checks import (
    check_contiguity,
    check_files,
    check_rows,
    committed_parts,
    topics_with_manifest,
)
from danube_ingest.analytics.records import TableKeys
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import Records, TopicRecord
from danube_ingest.objects.store import ObjectStore
from tests.pipelines.parquet_support import H0, HOUR, TOPIC, convert, publish_topic

pytestmark = [pytest.mark.etcd]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[ObjectStore]:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    yield store
    await store.close()


async def test_topics_are_the_reliable_ones_with_objects(etcd_kv: EtcdKV, keys: Keys) -> None:
    await publish_topic(etcd_kv, keys)
    records = Records(etcd_kv, keys)
    await records.create_topic_if_absent(TopicRecord("/default/empty"))
    await records.create_topic_if_absent(TopicRecord("/default/fanout", reliable=False))
    assert await topics_with_manifest(etcd_kv, keys) == [TOPIC]


async def test_checks_pass_on_a_sound_table(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys)
    done = await convert(etcd_kv, keys, store)
    assert [d[1:4] for d in done] == [(600, 0, 599), (600, 600, 1199), (600, 1200, 1799)]
    assert await check_rows(etcd_kv, keys, store, TOPIC) == []
    assert await check_contiguity(etcd_kv, keys, TOPIC) == []
    assert await check_files(etcd_kv, keys, store, TOPIC) == []


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
async def test_checks_fail_on_a_damaged_file(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore, damage: str
) -> None:
    await publish_topic(etcd_kv, keys)
    done = await convert(etcd_kv, keys, store)
    path = done[1][4][0]
    if damage == "deleted":
        await store.delete(path)
    else:
        data = await store.get(path)
        await store.put(path, data[: len(data) // 2])
    files = await check_files(etcd_kv, keys, store, TOPIC)
    assert [(f.start_ms, path in f.problem) for f in files] == [(H0 + HOUR, True)], files
    assert ("missing" if damage == "deleted" else "bytes, its commit records") in files[0].problem
    rows = await check_rows(etcd_kv, keys, store, TOPIC)
    assert [f.start_ms for f in rows] == [H0 + HOUR], rows
    assert "Parquet footer" in rows[0].problem


async def test_a_file_with_the_same_size_but_other_bytes_fails_its_crc(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys, hours=1)
    path = (await convert(etcd_kv, keys, store))[0][4][0]
    data = bytearray(await store.get(path))
    data[100] ^= 0xFF
    await store.put(path, bytes(data))
    files = await check_files(etcd_kv, keys, store, TOPIC)
    assert len(files) == 1 and "CRC32C" in files[0].problem, files


async def test_rows_check_fails_when_the_commit_disagrees_with_the_manifest(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys, hours=2)
    await convert(etcd_kv, keys, store)
    # The manifest says the second hour's first range holds fewer entries than its offsets.
    ranges_key = keys.storage_object(TOPIC, 600)
    stored = await etcd_kv.get(ranges_key)
    assert stored is not None
    await etcd_kv.put(ranges_key, stored.value.replace(b'"entries":300', b'"entries":299'))
    rows = await check_rows(etcd_kv, keys, store, TOPIC)
    assert [f.start_ms for f in rows] == [H0 + HOUR], rows
    assert "the manifest holds 599 entries" in rows[0].problem


async def test_contiguity_fails_on_a_gap_below_upper(
    etcd_kv: EtcdKV, keys: Keys, store: ObjectStore
) -> None:
    await publish_topic(etcd_kv, keys)
    await convert(etcd_kv, keys, store)
    table, _ = await committed_parts(etcd_kv, keys, TOPIC)
    assert table is not None and table.active is not None
    await etcd_kv.delete(TableKeys(keys, TOPIC).part(table.active, H0 + HOUR))
    gaps = await check_contiguity(etcd_kv, keys, TOPIC)
    assert [f.start_ms for f in gaps] == [H0 + HOUR], gaps
