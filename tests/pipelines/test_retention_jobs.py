"""The ``object_retention`` and ``etcd_compaction`` jobs through Dagster, on the real etcd
and fs: the ranges expire, the floor moves, the objects go with ``object_gc``; etcd history
is compacted."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from assets.objects import object_gc
from assets.retention import etcd_compaction, object_retention
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.manifest import Manifest, Retired, retired_objects
from danube_ingest.metadata.policies import Policies, RetentionPolicy
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.objects.test_orphans import Topic
from tests.objects.test_reader import T

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

SEGMENTS = [f"segments/b/r0/{seq:020d}.bin" for seq in (1, 2)]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _setup(etcd_server: str, keys: Keys, objects: Path) -> None:
    """Two ranges of ``T`` in two objects; the namespace keeps 100 ms of ingest time."""
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    store = ObjectStore("fs", options={"root": str(objects)})
    topic = await Topic(kv, keys, store).start()
    await topic.commit(await topic.put(SEGMENTS[0], 0, 100))
    await topic.commit(await topic.put(SEGMENTS[1], 100, 200))
    await topic.close()
    await kv.close()


async def _manifest(etcd_server: str, keys: Keys) -> list[int]:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        return [r.start_offset for r in await Manifest(kv, keys).ranges(T)]
    finally:
        await kv.close()


async def _set_policy(etcd_server: str, keys: Keys, scope: str, policy: RetentionPolicy) -> None:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        await Policies(kv, keys).set(scope, policy)
    finally:
        await kv.close()


def _resources(etcd_server: str, keys: Keys, data_dir: Path) -> dict[str, object]:
    return {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(data_dir)),
    }


def _metadata(result: Any) -> dict[str, Any]:
    [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    return {k: v.value for k, v in output.event_specific_data.metadata.items()}


def test_object_retention_expires_then_object_gc_collects(
    etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    _run(_setup(etcd_server, keys, tmp_path / "objects"))
    resources = _resources(etcd_server, keys, tmp_path)
    nothing = object_retention.execute_in_process(resources=resources)
    assert nothing.success and _metadata(nothing)["topics"] == 0  # no policy: keep for ever

    # Ingest times of the test objects are in 1970: a day of age expires both ranges.
    _run(_set_policy(etcd_server, keys, "/default", RetentionPolicy(max_age_ms=86_400_000)))
    _run(_set_policy(etcd_server, keys, T, RetentionPolicy(max_bytes=10**12)))
    result = object_retention.execute_in_process(resources=resources)
    assert result.success
    metadata = _metadata(result)
    assert metadata["topics"] == 1 and metadata["ranges_expired"] == 2
    assert metadata["floors_moved"] == 1 and metadata["bytes_expired"] > 0
    assert f"{T}: 2 ranges" in metadata["floors"] and "floor 200 (max_age)" in metadata["floors"]
    assert _run(_manifest(etcd_server, keys)) == []

    again = object_retention.execute_in_process(resources=resources)
    assert _metadata(again)["ranges_expired"] == 0

    # The objects are unreferenced now; object_gc takes them once they and their
    # retirement are past the grace. Age the files; the retirements are aged below.
    past = time.time() - 7200
    for key in SEGMENTS:
        os.utime(tmp_path / "objects" / key, (past, past))
    young = object_gc.execute_in_process(resources=resources)
    assert _metadata(young)["deleted"] == 0 and _metadata(young)["retired_recently"] == 2
    _run(_age_retirements(etcd_server, keys))
    gc = object_gc.execute_in_process(resources=resources)
    assert _metadata(gc)["deleted"] == 2
    assert not any((tmp_path / "objects" / key).exists() for key in SEGMENTS)


async def _age_retirements(etcd_server: str, keys: Keys) -> None:
    """Rewrite the retirement records two hours earlier (the collector's clock is the wall's)."""
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        for key, record in (await retired_objects(kv, keys)).items():
            older = Retired(key, record.retired_ms - 2 * 3_600_000)
            await kv.put(keys.storage_retired(key), older.encode())
    finally:
        await kv.close()


def test_object_retention_refuses_a_malformed_default(
    etcd_server: str, keys: Keys, tmp_path: Path
) -> None:
    config = {
        "ops": {
            "apply_object_retention": {
                "config": {"max_age": "soon", "max_bytes": "", "table_max_age": ""}
            }
        }
    }
    result = object_retention.execute_in_process(
        resources=_resources(etcd_server, keys, tmp_path), run_config=config, raise_on_error=False
    )
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "invalid duration 'soon'" in str(failure.event_specific_data)


def test_etcd_compaction_records_then_compacts(etcd_server: str, keys: Keys) -> None:
    resources = {"etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix)}
    first = etcd_compaction.execute_in_process(resources=resources)
    assert first.success and _metadata(first)["compacted"] == 0  # only a sample so far
    assert _metadata(first)["db_size"] > 0
    config = {"ops": {"compact_etcd_history": {"config": {"keep_s": 0.001}}}}
    time.sleep(0.01)
    second = etcd_compaction.execute_in_process(resources=resources, run_config=config)
    metadata = _metadata(second)
    assert metadata["compacted"] == _metadata(first)["revision"]
    assert metadata["revision"] > metadata["compacted"]
