"""The ``wal_prune_marks`` asset against a real etcd: what it computes, that it only moves
marks forward, and how it fails. (tests/broker/test_prune_marks_asset.py runs it against a
real broker whose cleaner then acts on the marks.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from assets.wal_marks import update_prune_marks, wal_prune_marks
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.records import Records, SubscriptionRecord, TopicRecord
from danube_ingest.store.topic_store import region_index
from danube_ingest.testing import free_port
from pipelines.definitions import defs, prune_marks_schedule
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
        entry = ObjectRange(
            topic=topic,
            object_key="segments/b1/r0/00000000000000000001.bin",
            start_offset=0,
            end_offset=manifest_end,
            entries=manifest_end,
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
    for name, cursor in (cursors or {}).items():
        await records.put_subscription(SubscriptionRecord(topic, name, "Exclusive"))
        if cursor is not None:
            await records.set_cursor(topic, name, cursor)


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
    assert prune_marks_schedule.cron_schedule == "* * * * *"
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
