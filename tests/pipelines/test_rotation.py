"""``rotation_sensor`` and ``rotate_topics`` through real Dagster, on the real etcd and fs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance, SensorResult, build_sensor_context, instance_for_test

from assets.rotation import rotate_topics, rotation_sensor
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import EtcdResource, ObjectStoreResource
from tests.objects.test_orphans import Topic
from tests.objects.test_reader import T
from tests.objects.test_rotation import advance_clock, read_all, seed

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

RANGES = 20
"""Segment ranges seeded; one run merges them all (their clock says they are old enough)."""


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        yield instance


def _with_topic(etcd_server: str, keys: Keys, objects: Path, work: str) -> list[int]:
    async def run() -> list[int]:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(objects)})
        topic = await Topic(kv, keys, store).start()
        try:
            if work == "seed":
                await seed(topic, RANGES, clock=False)
            elif work == "clock":
                await advance_clock(topic, RANGES * 10)
            else:
                return await read_all(Manifest(kv, keys), store, RANGES * 10)
            return []
        finally:
            await topic.close()
            await store.close()
            await kv.close()

    return asyncio.run(run())


def _resources(etcd_server: str, keys: Keys, data_dir: Path) -> dict[str, object]:
    return {
        "etcd": EtcdResource(endpoints=etcd_server, prefix=keys.prefix),
        "objects": ObjectStoreResource(data_dir=str(data_dir)),
    }


def _evaluate(
    instance: DagsterInstance, cursor: str | None, resources: dict[str, object]
) -> SensorResult:
    context = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
    result = rotation_sensor(context)
    assert isinstance(result, SensorResult)
    return result


def test_the_sensor_requests_a_run_that_rotates_the_topic(
    etcd_server: str, keys: Keys, tmp_path: Path, instance: DagsterInstance
) -> None:
    resources = _resources(etcd_server, keys, tmp_path)
    _with_topic(etcd_server, keys, tmp_path / "objects", "seed")
    first = _evaluate(instance, None, resources)
    assert not first.run_requests  # no clock yet: the owner may still commit there
    _with_topic(etcd_server, keys, tmp_path / "objects", "clock")
    second = _evaluate(instance, first.cursor, resources)
    [request] = second.run_requests or []
    assert request.run_key is not None and request.run_key.startswith(f"{T}|")
    assert request.run_config == {"ops": {"rotate": {"config": {"topics": [T]}}}}
    assert not _evaluate(instance, second.cursor, resources).run_requests  # nothing changed

    result = rotate_topics.execute_in_process(
        run_config=request.run_config, resources=resources, instance=instance
    )
    assert result.success
    [output] = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = output.event_specific_data.metadata  # type: ignore[union-attr]
    assert metadata["objects_rotated"].value == 1
    assert metadata["entries_before"].value == RANGES and metadata["entries_after"].value == 1
    assert metadata["bytes_in"].value > 0 and metadata["bytes_out"].value > 0
    assert _with_topic(etcd_server, keys, tmp_path / "objects", "read") == list(range(RANGES * 10))
    # The swap changed the manifest, but nothing is left to rotate.
    assert not _evaluate(instance, second.cursor, resources).run_requests
