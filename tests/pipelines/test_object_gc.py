"""The ``object_gc`` job and the ``object_manifest`` checks (job ``manifest_integrity``) through
Dagster, on the real etcd and fs."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from dagster import AssetSelection, materialize

from assets.objects import manifest_integrity_checks, object_gc, object_manifest
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.jumps import record_jump
from danube_ingest.objects.store import ObjectStore
from pipelines.definitions import defs
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.objects.test_orphans import Topic
from tests.objects.test_reader import T

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

SEGMENT = "segments/b/r0/00000000000000000001.bin"


def _setup(
    etcd_server: str, keys: Keys, objects: Path, damage: str | None, jump: bool = False
) -> None:
    """Offsets 0..99 in SEGMENT (committed, damaged as told), 100..199 in another object (not
    committed), and with damage ``gap`` 300..399 committed after a gap; ``jump`` records the
    owner's jump over the gap."""

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
        elif damage == "gap":
            await topic.commit(await topic.put("segments/b/r0/00000000000000000003.bin", 300, 400))
        if jump:
            await record_jump(topic.ownership, T, 100, 300)
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


def _run_checks(etcd_server: str, keys: Keys, data_dir: Path) -> dict[str, tuple[bool, dict]]:
    result = materialize(
        [object_manifest, manifest_integrity_checks],
        resources=_resources(etcd_server, keys, data_dir),
        selection=AssetSelection.checks(manifest_integrity_checks),
        raise_on_error=False,
    )
    return {
        e.check_name: (e.passed, {k: v.value for k, v in e.metadata.items()})
        for e in result.get_asset_check_evaluations()
    }


@pytest.mark.parametrize(
    ("damage", "jump", "intact", "contiguous"),
    [
        (None, False, True, True),
        ("missing", False, False, True),
        ("truncated", False, False, True),
        ("flipped", False, False, True),
        ("gap", False, True, False),
        ("gap", True, True, True),
    ],
    ids=["intact", "missing", "truncated", "flipped", "gap", "gap-with-jump"],
)
def test_manifest_checks_fail_on_a_damaged_object_and_on_an_unexplained_gap(
    etcd_server: str,
    keys: Keys,
    tmp_path: Path,
    damage: str | None,
    jump: bool,
    intact: bool,
    contiguous: bool,
) -> None:
    _setup(etcd_server, keys, tmp_path / "objects", damage, jump)
    checks = _run_checks(etcd_server, keys, tmp_path)
    assert {name: passed for name, (passed, _) in checks.items()} == {
        "objects_intact": intact,
        "ranges_contiguous": contiguous,
    }
    objects_meta = checks["objects_intact"][1]
    ranges_meta = checks["ranges_contiguous"][1]
    assert objects_meta["topics"] == 1 and objects_meta["jumps"] == int(jump)
    assert objects_meta["ranges"] == (2 if damage == "gap" else 1)
    if not intact:
        assert objects_meta["problems"] == 1 and SEGMENT in objects_meta["details"]
    if damage == "gap":
        assert ranges_meta["gaps"] == 1
        assert ranges_meta["unexplained_gaps"] == int(not jump)
    if not contiguous:
        assert ranges_meta["problems"] == 1 and "offsets 100..299" in ranges_meta["details"]


def test_the_checks_job_runs_hourly() -> None:
    job = defs.resolve_job_def("manifest_integrity")
    assert {k.name for k in job.asset_layer.asset_graph.asset_check_keys} >= {
        "objects_intact",
        "ranges_contiguous",
    }
    [schedule] = [s for s in defs.schedules or [] if s.job_name == "manifest_integrity"]
    assert schedule.cron_schedule == "10 * * * *"
