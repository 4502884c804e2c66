"""The ``object_gc`` and ``manifest_integrity`` jobs through Dagster, on the real etcd and fs."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from assets.objects import manifest_integrity_job, object_gc
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.objects.test_orphans import Topic

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

SEGMENT = "segments/b/r0/00000000000000000001.bin"


def _setup(etcd_server: str, keys: Keys, objects: Path, damage: str | None) -> None:
    async def run() -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(objects)})
        topic = await Topic(kv, keys, store).start()
        await topic.commit(await topic.put(SEGMENT, 0, 100))
        await topic.put("segments/b/r0/00000000000000000002.bin", 100, 200)
        if damage == "missing":
            await store.delete(SEGMENT)
        elif damage == "truncated":
            await store.put(SEGMENT, (await store.get(SEGMENT))[:-1])
        elif damage == "flipped":
            data = bytearray(await store.get(SEGMENT))
            data[100] ^= 0x01
            await store.put(SEGMENT, bytes(data))
        await topic.close()
        await kv.close()

    asyncio.run(run())


def _resources(etcd_server: str, keys: Keys, data_dir: Path) -> dict[str, object]:
    return {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(data_dir)),
    }


def test_object_gc_deletes_the_old_orphan(etcd_server: str, keys: Keys, tmp_path: Path) -> None:
    _setup(etcd_server, keys, tmp_path / "objects", None)
    orphan = tmp_path / "objects" / "segments" / "b" / "r0" / "00000000000000000002.bin"
    past = time.time() - 7200
    os.utime(orphan, (past, past))
    result = object_gc.execute_in_process(resources=_resources(etcd_server, keys, tmp_path))
    assert result.success
    [materialization] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = materialization.event_specific_data.metadata  # type: ignore[union-attr]
    assert metadata["deleted"].value == 1 and metadata["kept"].value == 1
    assert metadata["bytes"].value > 0 and metadata["too_young"].value == 0
    assert not orphan.exists() and (tmp_path / "objects" / SEGMENT).exists()


@pytest.mark.parametrize("damage", [None, "missing", "truncated", "flipped"])
def test_manifest_integrity_fails_on_a_damaged_object(
    etcd_server: str, keys: Keys, tmp_path: Path, damage: str | None
) -> None:
    _setup(etcd_server, keys, tmp_path / "objects", damage)
    result = manifest_integrity_job.execute_in_process(
        resources=_resources(etcd_server, keys, tmp_path), raise_on_error=False
    )
    assert result.success is (damage is None)
    if damage is not None:
        [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert SEGMENT in str(failure.event_specific_data)
