"""Rotation and the Spark conversion, each SIGKILLed at chosen steps and run again: the
history checker then requires what every other scenario requires of the daemon, and of their
own output a gap-free, overlap-free manifest (rotation) or gap-free, overlap-free Parquet
commits (conversion), with every acknowledged message readable exactly once.

The kills land exactly between two steps: the child runs with ``DANUBE_TEST_STOP_AT``
(``danube_ingest.stoppoint``), stops itself (SIGSTOP) at the named step, and the test SIGKILLs
it there (the conversion job: its whole process group, driver, JVM and Python workers).

* Rotation (``objects.rotation.rotate_topic`` in a child process, as the Dagster op calls it):
  killed after the first group's object is stored and before its swap, after a swap, and after
  a later group's store; then run to completion. Every ``topics/`` object must be named by the
  manifest (no orphan left by a killed run), the orphan collector (grace passed) deletes only
  what is superseded, every object verifies, and a new daemon with an empty WAL serves the
  ``audit`` subscription, created at the start, from the objects alone.
* Conversion (``python -m danube_ingest.analytics.job`` on ``local[2]``): killed once every
  partition is staged (one Spark job writes them all), the first partition committed and
  published, and the second one's commit record stored before its files are published; the
  later partitions staged and not committed. Then run to completion (a JVM start each: about
  20-40 s on a shared 2-core machine, so one kill). The committed Parquet is read back and fed
  to the checker as the deliveries of a ``parquet`` subscription.
  The daemon runs under libfaketime at 60x (its wall clock only; monotonic time is real), so
  that a few seconds of load cover several one-minute partitions and complete them at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from danube_ingest.analytics.iceberg import IcebergTarget, identifier
from danube_ingest.analytics.layout import partition_end, partition_start
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.config import load_config
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.metadata.clock import read_clock
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.orphans import (
    MIN_GRACE_S,
    collect_orphans,
    manifest_integrity,
    referenced_objects,
)
from danube_ingest.objects.store import ObjectStore
from danube_ingest.stoppoint import ENV as STOP_AT
from danube_ingest.testing import History, assert_history_ok, manifest_spans
from danube_ingest.testing_history import Span
from tests.broker.support import stop_all
from tests.broker.test_both_clients import create_topic

from .conftest import BrokerFactory
from .harness import LIBFAKETIME, Kind, Load, acked_count, read_all, record, start_workload

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

ROOT = Path(__file__).resolve().parents[2]
ROTATED = "/default/rotated"
CONVERTED = "/default/converted"
#: Seconds one child (a rotation, a conversion job with its JVM) may take on a loaded machine.
CHILD_TIMEOUT = 90.0

#: The rotation child: ``rotate_topic`` as the Dagster op runs it, with small objects (its
#: last argument: the most stored bytes per object), printing its report as one JSON line.
_ROTATE = """
import asyncio, json, sys
from danube_ingest.metadata import EtcdKV, Keys, Manifest
from danube_ingest.objects.rotation import RotationLimits, rotate_topic
from danube_ingest.objects.store import ObjectStore

async def main(endpoint, prefix, root, topic, max_bytes):
    kv = await EtcdKV.connect([endpoint], timeout=5.0)
    store = ObjectStore("fs", options={"root": root})
    limits = RotationLimits(max_object_bytes=int(max_bytes))
    report = await rotate_topic(Manifest(kv, Keys(prefix)), store, topic, limits)
    print(json.dumps({"objects": report.objects, "ranges": report.ranges_replaced}))
    await store.close()
    await kv.close()

asyncio.run(main(*sys.argv[1:]))
"""


def _state(pid: int) -> str:
    """The process state letter from ``/proc/PID/stat`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _run_child(
    command: list[str], env: dict[str, str], out: Path, stop_at: str | None
) -> tuple[subprocess.Popen[bytes], float]:
    """Run ``command`` in its own process group, stdout and stderr to ``out``. With
    ``stop_at``: wait until it stops there and SIGKILL its group; else wait until it ends.
    Returns the ended child and its seconds from start to kill or end."""
    env = {**env, STOP_AT: stop_at} if stop_at else {k: v for k, v in env.items() if k != STOP_AT}
    started = time.monotonic()
    with out.open("ab") as log:
        child = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = started + CHILD_TIMEOUT
        while stop_at is not None and _state(child.pid) != "T":
            if child.poll() is not None:
                raise AssertionError(
                    f"the child logging to {out.name} ended ({child.returncode}) before its "
                    f"stop point {stop_at}:\n{out.read_text()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"the child of {out.name} never reached {stop_at}"
            time.sleep(0.02)
        if stop_at is not None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    return child, time.monotonic() - started


async def _covered(kv: EtcdKV, keys: Keys, topic: str, end: int, at_ms: int = 0) -> None:
    """Until the topic's clock covers offsets below ``end`` (all uploaded and committed) and,
    with ``at_ms``, its time has passed ``at_ms``."""
    deadline = time.monotonic() + 60
    while True:
        clock = await read_clock(kv, keys, topic)
        if clock is not None and clock.offset >= end and clock.ingest_ms >= at_ms:
            return
        assert time.monotonic() < deadline, f"{topic}: clock {clock} never covered {end}"
        await asyncio.sleep(0.2)


async def _ranges_at_least(kv: EtcdKV, keys: Keys, topic: str, n: int) -> list[ObjectRange]:
    """The topic's manifest once it holds ``n`` ranges (one a second under load)."""
    deadline = time.monotonic() + 45
    while len(ranges := list(await Manifest(kv, keys).ranges(topic))) < n:
        assert time.monotonic() < deadline, f"{topic}: {len(ranges)} of {n} ranges in 45 s"
        await asyncio.sleep(0.2)
    return ranges


def _rotation_groups_bytes(ranges: list[ObjectRange]) -> int:
    """Most stored bytes per rolling object: the largest two neighbouring ranges, so that
    every group holds two or three ranges and the topic's ranges make several groups."""
    return max(a.byte_length + b.byte_length for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("kind", ["danube", "batch"])
@pytest.mark.timeout(150)
async def test_rotation_killed_and_rerun_loses_and_leaves_nothing(
    brokers: BrokerFactory,
    history: History,
    kind: Kind,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
) -> None:
    root = tmp_path / "objects"
    storage = {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(root)},
        "wal": {"segment_seconds": 1},
        "clock_interval_seconds": 0.5,
    }
    keys = Keys(etcd_prefix)
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    started = time.monotonic()
    try:
        first = brokers(storage=storage)
        await asyncio.to_thread(first.start)
        live, load = await start_workload(kind, first.url, ROTATED, history)
        try:
            ranges = await _ranges_at_least(kv, keys, ROTATED, 10)
            command = [sys.executable, "-c", _ROTATE, etcd_server, etcd_prefix, str(root)]
            command += [ROTATED, str(_rotation_groups_bytes(ranges))]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            out = tmp_path / "rotation.log"
            # Killed and rerun while the daemon ingests, uploads and commits new ranges.
            kills = ["rotation.stored", "rotation.swapped", "rotation.stored:2"]
            for point in kills:
                await asyncio.to_thread(_run_child, command, env, out, point)
            child, _ = await asyncio.to_thread(_run_child, command, env, out, None)
            assert child.returncode == 0, out.read_text()[-3000:]
            await load.stop()
            await live.wait_count(acked_count(history, ROTATED))
            await live.settle(quiet=0.5)
        finally:
            await live.close()
        end = max(live.offsets) + 1
        await _covered(kv, keys, ROTATED, end)
        child, _ = await asyncio.to_thread(_run_child, command, env, out, None)
        assert child.returncode == 0, out.read_text()[-3000:]
        last = json.loads(out.read_text().strip().splitlines()[-1])
        again, _ = await asyncio.to_thread(_run_child, command, env, out, None)
        assert again.returncode == 0, out.read_text()[-3000:]
        assert json.loads(out.read_text().strip().splitlines()[-1])["objects"] == []

        rotated = list(await Manifest(kv, keys).ranges(ROTATED))
        store = ObjectStore("fs", options={"root": str(root)})
        try:
            referenced = await referenced_objects(kv, keys)
            rolling = set(await store.list("topics/"))
            orphans = rolling - set(referenced)
            assert not orphans, f"rolling objects of killed runs left unreferenced: {orphans}"
            now_ms = int(time.time() * 1000) + int(3 * MIN_GRACE_S * 1000)
            collected = await collect_orphans(kv, keys, store, grace_s=MIN_GRACE_S, now_ms=now_ms)
            assert not set(collected.deleted) & set(referenced)
            integrity = await manifest_integrity(kv, keys, store, deep=True)
            assert integrity.ok, integrity.problems
        finally:
            await store.close()

        await stop_all([first])  # a clean stop: the topic is handed over, its WAL is not
        second = brokers("broker-2", storage=storage)
        await asyncio.to_thread(second.start)
        await read_all(kind, second.url, ROTATED, history, [])
    finally:
        await kv.close()
    report = assert_history_ok(
        history,
        subscriptions=[(ROTATED, "live"), (ROTATED, "audit")],
        manifest=manifest_spans(rotated),
    )
    topic_objects = [r for r in rotated if r.kind == "topic"]
    assert len(topic_objects) >= 3, f"rotation merged too little: {rotated}"
    assert (rotated[0].start_offset, rotated[-1].end_offset) == (0, end)
    record(
        "rotation-killed-rerun",
        kind,
        report,
        cycles=len(kills),
        ranges_before=len(ranges),
        ranges_after=len(rotated),
        topic_objects=len(topic_objects),
        objects_last_run=len(last["objects"]),
        orphans_collected=len(collected.deleted),
        seconds=round(time.monotonic() - started, 1),
    )


async def _commits(kv: EtcdKV, keys: Keys, topic: str) -> list[PartitionCommit]:
    entries = await kv.get_prefix(TableKeys(keys, topic).parts_prefix("r1"))
    return sorted(
        (PartitionCommit.decode(e.value, e.key) for e in entries), key=lambda c: c.start_ms
    )


@pytest.mark.spark
@pytest.mark.timeout(240)
async def test_spark_conversion_killed_and_rerun_commits_each_message_once(
    brokers: BrokerFactory,
    history: History,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    etcd_server: str,
    etcd_prefix: str,
) -> None:
    assert LIBFAKETIME.exists(), f"{LIBFAKETIME} is missing: apt-get install libfaketime"
    root = tmp_path / "objects"
    keys = Keys(etcd_prefix)
    # Inherited by the broker process only (it is started before any other child).
    monkeypatch.setenv("LD_PRELOAD", str(LIBFAKETIME))
    monkeypatch.setenv("FAKETIME", "+0 x60")
    monkeypatch.setenv("DONT_FAKE_MONOTONIC", "1")
    broker = brokers(
        warm=False,
        storage={
            "mode": "wal_cloud",
            "cloud": {"backend": "fs", "root": str(root)},
            "wal": {"segment_seconds": 1},
            "clock_interval_seconds": 0.5,
        },
    )
    await asyncio.to_thread(broker.start)
    for name in ("LD_PRELOAD", "FAKETIME", "DONT_FAKE_MONOTONIC"):
        monkeypatch.delenv(name)
    started = time.monotonic()
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        await create_topic(broker.url, CONVERTED)
        load = Load("batch", broker.url, CONVERTED, history, "p1")
        await load.start()
        await asyncio.sleep(5)  # five minutes of the daemon's clock: five partitions or six
        await load.stop()
        acked = acked_count(history, CONVERTED)
        ranges = list(await Manifest(kv, keys).ranges(CONVERTED))
        await _covered(kv, keys, CONVERTED, acked)
        ranges = list(await Manifest(kv, keys).ranges(CONVERTED))
        newest = max(r.last_ingest_ms for r in ranges)
        await _covered(kv, keys, CONVERTED, acked, partition_end(partition_start(newest, 60), 60))
        await stop_all([broker])  # leaves the two cores to Spark
        produced_s = time.monotonic() - started

        config = tmp_path / "broker.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "broker": {"data_dir": str(tmp_path / "job")},
                    "storage": {"cloud": {"backend": "fs", "root": str(root)}},
                }
            )
        )
        env: dict[str, str] = {
            **os.environ,
            "DANUBE_INGEST_CONFIG": str(config),
            "DANUBE_INGEST_ETCD_ENDPOINTS": etcd_server,
            "DANUBE_INGEST_ETCD_PREFIX": etcd_prefix,
            "PYSPARK_SUBMIT_ARGS": "--master local[2] --conf spark.ui.enabled=false pyspark-shell",
            "PYTHONPATH": str(ROOT),
        }
        env.pop("PYSPARK_PYTHON", None)  # the job sets it to its own interpreter
        command = [sys.executable, "-m", "danube_ingest.analytics.job", "--topic", CONVERTED]
        command += ["--width-s", "60"]
        out = tmp_path / "job.log"
        runs: list[float] = []
        _, seconds = await asyncio.to_thread(_run_child, command, env, out, "convert.committed:2")
        runs.append(seconds)
        halfway = await _commits(kv, keys, CONVERTED)
        assert [c.published for c in halfway] == [True, False], halfway
        child, seconds = await asyncio.to_thread(_run_child, command, env, out, None)
        runs.append(seconds)
        assert child.returncode == 0, out.read_text()[-3000:]
        lines = out.read_text().splitlines()
        result = json.loads([line for line in lines if line.startswith('{"topic"')][-1])
        commits = await _commits(kv, keys, CONVERTED)
    finally:
        await kv.close()

    rows = 0
    for commit in commits:
        for info in commit.files:
            table = pq.read_table(root / info.path, columns=["offset", "payload"])
            assert (table.num_rows, info.size) == (info.rows, (root / info.path).stat().st_size)
            for offset, payload in zip(
                table.column("offset").to_pylist(), table.column("payload").to_pylist(), strict=True
            ):
                history.delivery(CONVERTED, "parquet", "files", offset, payload)
                rows += 1
    filled = [c for c in commits if c.rows]  # a partition of the idle end may be empty
    report = assert_history_ok(
        history,
        subscriptions=[(CONVERTED, "parquet")],
        manifest=manifest_spans(ranges),
        parquet_commits=[Span(CONVERTED, c.first_offset, c.last_offset + 1) for c in filled],
    )
    assert len(commits) >= 3 and all(c.published for c in commits), commits
    assert len({c.start_ms for c in commits}) == len(commits)
    assert (filled[0].first_offset, filled[-1].last_offset + 1) == (0, acked)
    assert rows == acked == report["acked_writes"]
    # The Iceberg table the rerun published holds every acknowledged message exactly once,
    # up to the table's frontier, in one snapshot (the killed run published nothing).
    target = IcebergTarget.from_config(load_config(config))
    assert target is not None
    iceberg = target.catalog().load_table(identifier(CONVERTED))
    offsets = sorted(iceberg.scan().to_arrow().column("offset").to_pylist())
    assert offsets == list(range(acked))
    assert len(iceberg.snapshots()) == 1
    snapshot = iceberg.current_snapshot()
    assert snapshot is not None and snapshot.summary is not None
    assert int(snapshot.summary["danube.frontier-ms"]) == result["upper_ms"]
    # The rerun published the killed run's second partition and committed only the later ones.
    assert commits[:2] == [dataclasses.replace(c, published=True) for c in halfway]
    assert [(p["start_ms"], p["outcome"]) for p in result["partitions"]] == [
        (c.start_ms, "committed") for c in commits[2:]
    ]
    record(
        "spark-conversion-killed-rerun",
        "batch",
        report,
        cycles=1,
        partitions=len(commits),
        parquet_rows=rows,
        produce_s=round(produced_s, 1),
        job_runs_s=[round(s, 1) for s in runs],
        seconds=round(time.monotonic() - started, 1),
    )
