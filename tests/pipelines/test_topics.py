"""The observable source asset ``topics`` and the asset graph it starts: its edges, and an
observation of a real daemon's topic (through Dagster, and recorded by ``prune_marks_sensor``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    SensorResult,
    build_sensor_context,
    define_asset_job,
)

from assets.topics import TOPICS_KEY, topics
from assets.wal_marks import prune_marks_sensor
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.metadata.clock import read_clock
from danube_ingest.metadata.records import Records
from danube_ingest.testing import broker_config, running_broker
from pipelines.definitions import defs
from pipelines.resources import EtcdResource
from tests.broker.support import Clients

TOPIC = "/default/observed"


def test_asset_graph_shows_the_data_flow() -> None:
    graph = defs.resolve_asset_graph()
    parents = {
        key.to_user_string(): graph.get(key).parent_keys for key in graph.get_all_asset_keys()
    }
    assert graph.get(TOPICS_KEY).is_observable
    assert parents["topics"] == set()
    assert parents["object_manifest"] == {TOPICS_KEY}
    assert parents["wal_prune_marks"] == {AssetKey("object_manifest"), TOPICS_KEY}
    assert parents["parquet_partitions"] == {AssetKey("object_manifest")}
    assert parents["iceberg_tables"] == {AssetKey("parquet_partitions")}
    assert set(parents) == {
        "topics",
        "object_manifest",
        "parquet_partitions",
        "iceberg_tables",
        "wal_prune_marks",
    }


async def _until(check: Any, what: str, timeout: float = 30.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def _observe(resource: EtcdResource, instance: DagsterInstance) -> dict[str, Any]:
    """Observe ``topics`` in a run (as the UI's Observe button does); its metadata values."""
    job = define_asset_job("observe_topics", selection=[TOPICS_KEY])
    observing = Definitions(assets=[topics], jobs=[job], resources={"etcd": resource})
    result = observing.resolve_job_def("observe_topics").execute_in_process(instance=instance)
    assert result.success
    (event,) = [e for e in result.all_events if e.event_type_value == "ASSET_OBSERVATION"]
    observation = event.asset_observation_data.asset_observation
    assert observation.tags["dagster/data_version"]
    return {name: value.value for name, value in observation.metadata.items()}


@pytest.mark.slow
@pytest.mark.dagster
async def test_observation_of_a_real_daemons_topic(
    tmp_path: Path, etcd_server: str, etcd_kv: EtcdKV, keys: Keys
) -> None:
    overrides = {
        "storage.mode": "wal_cloud",
        "storage.wal.segment_bytes": "64KiB",
        "storage.wal.segment_seconds": 1,
        # Dagster's work in this process (threads) may starve the lease refresh of a 2 s TTL
        # on a busy machine: the owner would vanish from what is observed.
        "etcd.lease_ttl_seconds": 15,
    }
    config = broker_config(tmp_path / "b1", etcd_server, prefix=keys.prefix, overrides=overrides)
    async with running_broker(config) as broker, Clients(broker.url) as clients:
        producer = await clients.producer(TOPIC, "p1")
        sub = await clients.consumer(TOPIC, "s1", "c1")
        for i in range(40):
            await producer.send(f"m{i:03}".encode())
        for _ in range(15):
            await sub.consumer.ack(await asyncio.wait_for(sub.queue.get(), 20))
        await sub.consumer.close()  # the cursor stays at 15

        async def uploaded() -> bool:
            clock = await read_clock(etcd_kv, keys, TOPIC)
            end = await Manifest(etcd_kv, keys).end_offset(TOPIC)
            return end == 40 and clock is not None and clock.offset == 40

        async def acked() -> bool:
            return await Records(etcd_kv, keys).get_cursor(TOPIC, "s1") == 15

        await _until(uploaded, "40 messages uploaded")
        await _until(acked, "the cursor at 15 in etcd")

        resource = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)
        with DagsterInstance.ephemeral() as instance:
            metadata = await asyncio.to_thread(_observe, resource, instance)
            context = build_sensor_context(instance=instance, resources={"etcd": resource})
            evaluated = await asyncio.to_thread(prune_marks_sensor, context)
    assert metadata["topics"] == 1
    assert metadata["owned"] == 1 and metadata["brokers"] == 1
    assert metadata["subscriptions"] == 1
    assert metadata["total_lag"] == 25 and metadata["max_lag"] == 25  # 40 uploaded, 15 acked
    assert metadata["slowest_clock"] > 0
    (row,) = [line for line in metadata["per_topic"].splitlines() if TOPIC in line]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == TOPIC
    assert cells[1].startswith("broker-1 e")  # owner and epoch
    assert cells[2] == "40"  # manifest end
    assert cells[3] == "s1: 25"  # lag behind the uploaded end
    assert cells[4].startswith("40 @ ")  # the clock
    assert int(cells[5]) >= 40  # offsets reserved: at least what was assigned
    assert cells[6] == "1"  # ranges
    # The sensor records the same observation without a run, and asks for the mark of 15.
    assert isinstance(evaluated, SensorResult)
    (observation,) = evaluated.asset_events
    assert {k: v.value for k, v in observation.metadata.items()} == metadata
    (request,) = evaluated.run_requests or []
    assert request.run_config["ops"]["wal_prune_marks"]["config"]["topics"] == [TOPIC]
