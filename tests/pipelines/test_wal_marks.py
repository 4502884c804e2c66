"""The ``wal_prune_marks`` asset against a real etcd: what it computes, that it only moves
marks forward, and how it fails. (tests/broker/test_prune_marks_asset.py runs it against a
real broker whose cleaner then acts on the marks.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dagster import DagsterInstance, RunRequest, SensorResult, build_sensor_context, materialize

from assets.topics import TOPICS_KEY
from assets.wal_marks import (
    RETRY_AFTER_S,
    marks_to_request,
    prune_marks_sensor,
    update_prune_marks,
    wal_prune_marks,
)
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.overview import read_overview
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.records import Records, SubscriptionRecord, TopicRecord
from danube_ingest.store.topic_store import region_index
from danube_ingest.testing import free_port
from pipelines.definitions import defs
from pipelines.resources import EtcdResource

pytestmark = [pytest.mark.etcd, pytest.mark.dagster]

ROOT = Path(__file__).resolve().parents[2]


async def _topic(
    kv: EtcdKV,
    keys: Keys,
    topic: str,
    *,
    owner: str | None = "b1",
    manifest_end: int = 0,
    cursors: dict[str, int | None] | None = None,
) -> None:
    records = Records(kv, keys)
    await records.create_topic_if_absent(TopicRecord(topic))
    if owner is not None:
        await kv.put(keys.topic_owner(topic), Owner(owner, "http://x:1", 3).encode())
    if manifest_end:
        await _upload(kv, keys, topic, 0, manifest_end)
    for name, cursor in (cursors or {}).items():
        await records.put_subscription(SubscriptionRecord(topic, name, "Exclusive"))
        if cursor is not None:
            await records.set_cursor(topic, name, cursor)


async def _upload(kv: EtcdKV, keys: Keys, topic: str, start: int, end: int) -> None:
    """A manifest range [start, end) of the topic, as an uploader commits it."""
    entry = ObjectRange(
        topic=topic,
        object_key=f"segments/b1/r0/{start + 1:020d}.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=8,
        byte_length=100,
        object_size=200,
        object_crc=1,
        first_ingest_ms=1,
        last_ingest_ms=2,
        kind="segment",
        broker="b1",
        epoch=3,
    )
    await kv.put(Manifest(kv, keys).key(entry), entry.encode())


async def _register(kv: EtcdKV, keys: Keys, broker: str, regions: int) -> None:
    value = {"url": "http://x:1", "started_ms": 1, "regions": regions}
    await kv.put(keys.broker(broker), json.dumps(value).encode())


async def test_marks_are_min_of_manifest_end_and_lowest_cursor(etcd_kv: EtcdKV, keys: Keys) -> None:
    kv = etcd_kv
    await _register(kv, keys, "b1", regions=4)
    await _topic(kv, keys, "/default/consumed", manifest_end=500, cursors={"a": 120, "b": 300})
    await _topic(kv, keys, "/default/ahead", manifest_end=200, cursors={"a": 450})
    await _topic(kv, keys, "/default/nobody", manifest_end=80)
    await _topic(kv, keys, "/default/fresh", manifest_end=90, cursors={"a": 50, "new": None})
    await _topic(kv, keys, "/default/orphan", owner=None, manifest_end=70)
    await _topic(kv, keys, "/default/unregistered", owner="gone", manifest_end=60)
    await _topic(kv, keys, "/default/empty", cursors={"a": 0})

    decisions = {d.topic: d for d in await update_prune_marks(kv, keys)}

    def region(topic: str) -> str:
        return f"r{region_index(topic, 4)}"

    marks = PruneMarks(kv, keys)
    stored: dict[str, int] = {}
    for r in range(4):
        stored.update(await marks.marks("b1", f"r{r}"))
    # Cursor below the manifest end: the slowest subscription bounds it.
    assert decisions["/default/consumed"].mark == 120
    assert decisions["/default/consumed"].reason == "cursor"
    # A subscription ahead of the uploads: not yet uploaded data stays.
    assert decisions["/default/ahead"].mark == 200
    # No subscription: uploaded is enough.
    assert decisions["/default/nobody"].mark == 80
    # A subscription without a cursor holds the mark; no owner, unknown broker: no mark.
    for held in ("/default/fresh", "/default/orphan", "/default/unregistered"):
        assert decisions[held].mark is None, decisions[held]
    assert decisions["/default/empty"].mark == 0  # nothing to prune; no key written
    assert stored == {"/default/consumed": 120, "/default/ahead": 200, "/default/nobody": 80}
    for topic in stored:
        assert decisions[topic].region == region(topic)
        assert (await marks.marks("b1", region(topic)))[topic] == stored[topic]
        assert decisions[topic].moved


async def test_marks_only_move_forward(etcd_kv: EtcdKV, keys: Keys) -> None:
    kv = etcd_kv
    topic = "/default/t"
    await _register(kv, keys, "b1", regions=1)
    await _topic(kv, keys, topic, manifest_end=100, cursors={"a": 60})
    first = await update_prune_marks(kv, keys)
    assert [(d.mark, d.moved) for d in first] == [(60, True)]
    again = await update_prune_marks(kv, keys)
    assert [(d.mark, d.moved) for d in again] == [(60, False)]
    # A subscription created later with a lower cursor cannot pull the mark back: what was
    # below it may already be gone from the WAL (that subscription reads objects).
    await Records(kv, keys).put_subscription(SubscriptionRecord(topic, "late", "Shared"))
    await Records(kv, keys).set_cursor(topic, "late", 10)
    lower = await update_prune_marks(kv, keys)
    assert [(d.mark, d.moved) for d in lower] == [(10, False)]
    assert (await PruneMarks(kv, keys).marks("b1", "r0")) == {topic: 60}
    await Records(kv, keys).set_cursor(topic, "late", 95)
    await Records(kv, keys).set_cursor(topic, "a", 99)
    later = await update_prune_marks(kv, keys)
    assert [(d.mark, d.moved) for d in later] == [(95, True)]


async def test_materialize_reports_marks(etcd_server: str, etcd_kv: EtcdKV, keys: Keys) -> None:
    await _register(etcd_kv, keys, "b1", regions=1)
    await _topic(etcd_kv, keys, "/default/m", manifest_end=40, cursors={"s": 30})
    resource = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)
    # materialize runs its own event loop (asyncio.run inside the asset): a worker thread.
    with DagsterInstance.ephemeral() as instance:
        result = await asyncio.to_thread(
            materialize, [wal_prune_marks], resources={"etcd": resource}, instance=instance
        )
    assert result.success
    (event,) = result.get_asset_materialization_events()
    metadata = event.materialization.metadata
    assert metadata["topics"].value == 1
    assert metadata["marks_moved"].value == 1
    assert "| /default/m | b1 | r0 | 30 | cursor |" in metadata["marks"].value
    assert (await PruneMarks(etcd_kv, keys).marks("b1", "r0")) == {"/default/m": 30}


def test_unreachable_etcd_fails_the_run_with_a_clear_error() -> None:
    resource = EtcdResource(
        endpoints=f"http://127.0.0.1:{free_port()}", connect_timeout_seconds=1.0
    )
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [wal_prune_marks], resources={"etcd": resource}, instance=instance, raise_on_error=False
        )
    assert not result.success
    failures = [e for e in result.all_events if e.is_step_failure]
    assert failures
    text = str(failures[0].step_failure_data.error)
    assert "MetadataUnavailableError" in text and "127.0.0.1" in text, text


def test_code_location_loads_from_workspace_yaml() -> None:
    assert defs.resolve_job_def("prune_marks") is not None
    # The marks are requested by a sensor (a run only when one would move), not every minute.
    assert defs.resolve_sensor_def("prune_marks_sensor").job_name == "prune_marks"
    repository = defs.get_repository_def()
    assert not [s for s in repository.schedule_defs if s.job_name == "prune_marks"]
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "dagster"),
            "definitions",
            "validate",
            "-w",
            "workspace.yaml",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Validation successful for code location pipelines.definitions:defs" in (
        done.stdout + done.stderr
    )


def test_resource_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DANUBE_INGEST_ETCD_ENDPOINTS", "http://10.0.0.1:2379,http://10.0.0.2:2379")
    monkeypatch.setenv("DANUBE_INGEST_ETCD_PREFIX", "/elsewhere")
    resource = EtcdResource.from_env()
    assert resource.endpoints == "http://10.0.0.1:2379,http://10.0.0.2:2379"
    assert resource.prefix == "/elsewhere"


def _evaluate(
    resource: EtcdResource, instance: DagsterInstance, cursor: str | None
) -> SensorResult:
    """One evaluation of ``prune_marks_sensor`` (it runs its own event loop: call in a thread)."""
    context = build_sensor_context(instance=instance, cursor=cursor, resources={"etcd": resource})
    result = prune_marks_sensor(context)
    assert isinstance(result, SensorResult)
    return result


async def _run(resource: EtcdResource, instance: DagsterInstance, request: RunRequest) -> Any:
    """The run the sensor requested, as the daemon would launch it (its run config)."""
    return await asyncio.to_thread(
        materialize,
        [wal_prune_marks],
        run_config=request.run_config,
        resources={"etcd": resource},
        instance=instance,
    )


async def test_sensor_requests_a_run_only_when_a_mark_would_move(
    etcd_server: str, etcd_kv: EtcdKV, keys: Keys
) -> None:
    kv, topic = etcd_kv, "/default/s"
    await _register(kv, keys, "b1", regions=1)
    await _topic(kv, keys, topic, manifest_end=100, cursors={"a": 60})
    await _topic(kv, keys, "/default/held", manifest_end=50, cursors={"new": None})
    await _topic(kv, keys, "/default/quiet")
    resource = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)
    marks = PruneMarks(kv, keys)

    with DagsterInstance.ephemeral() as instance:
        first = await asyncio.to_thread(_evaluate, resource, instance, None)
        (request,) = first.run_requests or []
        assert request.run_config == {"ops": {"wal_prune_marks": {"config": {"topics": [topic]}}}}
        assert [e.asset_key for e in first.asset_events] == [TOPICS_KEY]

        # Asked again before the run stored the mark: no second run, no new observation.
        pending = await asyncio.to_thread(_evaluate, resource, instance, first.cursor)
        assert not pending.run_requests and not pending.asset_events
        assert pending.skip_reason is not None

        # Meanwhile the cursor moved on: the run re-reads etcd and writes what is true now.
        await Records(kv, keys).set_cursor(topic, "a", 70)
        result = await _run(resource, instance, request)
        assert result.success
        assert await marks.marks("b1", "r0") == {topic: 70}

        # Nothing moved since the run (with the cursor, and from a fresh one): no run.
        done = await asyncio.to_thread(_evaluate, resource, instance, pending.cursor)
        assert not done.run_requests
        assert json.loads(done.cursor or "")["requested"] == {}
        assert [e.asset_key for e in done.asset_events] == [TOPICS_KEY]  # the cursor moved
        fresh = await asyncio.to_thread(_evaluate, resource, instance, None)
        assert not fresh.run_requests
        quiet = await asyncio.to_thread(_evaluate, resource, instance, done.cursor)
        assert not quiet.run_requests and not quiet.asset_events

        # A subscription cursor moved: a run, which moves the mark.
        await Records(kv, keys).set_cursor(topic, "a", 100)
        moved = await asyncio.to_thread(_evaluate, resource, instance, quiet.cursor)
        (request,) = moved.run_requests or []
        assert (await _run(resource, instance, request)).success
        assert await marks.marks("b1", "r0") == {topic: 100}

        # The manifest moved (and the subscription followed): a run, which moves the mark.
        await _upload(kv, keys, topic, 100, 180)
        await Records(kv, keys).set_cursor(topic, "a", 180)
        grown = await asyncio.to_thread(_evaluate, resource, instance, moved.cursor)
        (request,) = grown.run_requests or []
        assert request.run_config["ops"]["wal_prune_marks"]["config"]["topics"] == [topic]
        assert (await _run(resource, instance, request)).success
        assert await marks.marks("b1", "r0") == {topic: 180}
        after = await asyncio.to_thread(_evaluate, resource, instance, grown.cursor)
        assert not after.run_requests


async def test_sensor_asks_again_when_a_requested_mark_was_never_stored(
    etcd_kv: EtcdKV, keys: Keys
) -> None:
    await _register(etcd_kv, keys, "b1", regions=1)
    await _topic(etcd_kv, keys, "/default/r", manifest_end=40)
    overview = await read_overview(etcd_kv, keys)
    due, outstanding = marks_to_request(overview, {}, now=1_000)
    assert [(d.topic, d.mark) for d in due] == [("/default/r", 40)]
    # The run failed: the stored mark is still 0. Not asked again at once...
    again, _ = marks_to_request(overview, outstanding, now=2_000)
    assert again == []
    # ... but once RETRY_AFTER_S passed.
    later, _ = marks_to_request(overview, outstanding, now=1_000 + RETRY_AFTER_S * 1000)
    assert [(d.topic, d.mark) for d in later] == [("/default/r", 40)]


async def test_an_unreadable_cursor_is_replaced(
    etcd_server: str, etcd_kv: EtcdKV, keys: Keys
) -> None:
    await _register(etcd_kv, keys, "b1", regions=1)
    await _topic(etcd_kv, keys, "/default/c", manifest_end=30)
    resource = EtcdResource(endpoints=etcd_server, prefix=keys.prefix)
    with DagsterInstance.ephemeral() as instance:
        for edited in ("not json", '{"requested": {"/default/c": 5}}', "[1, 2]"):
            result = await asyncio.to_thread(_evaluate, resource, instance, edited)
            (request,) = result.run_requests or []
            assert request.run_config["ops"]["wal_prune_marks"]["config"]["topics"] == [
                "/default/c"
            ]
            assert json.loads(result.cursor or "")["requested"]["/default/c"][0] == 30


def test_run_config_names_topics_that_can_be_marks() -> None:
    resource = EtcdResource(endpoints=f"http://127.0.0.1:{free_port()}")
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [wal_prune_marks],
            run_config={"ops": {"wal_prune_marks": {"config": {"topics": ["not-a-topic"]}}}},
            resources={"etcd": resource},
            instance=instance,
            raise_on_error=False,
        )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    text = str(failure.step_failure_data.error)
    assert "'not-a-topic'" in text and "/namespace/topic" in text, text
