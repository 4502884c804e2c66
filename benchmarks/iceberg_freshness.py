"""Freshness of the Iceberg tables: a message's ingest -> the first Spark SQL query by name that
returns it, p50 / p99, at a steady publish rate, with the daemon's and the catalog's default
settings. Run:

    flock /tmp/danube-bench.lock .venv/bin/python benchmarks/iceberg_freshness.py   # ~6 min

(``--seconds 60 --rate 2000`` for a short run.) Needs the Iceberg jars of ``make setup``.

Setup, on loopback in a temporary directory: a local etcd, the real broker in a child process
(``BrokerChild``) with the daemon's defaults (``storage.mode: wal_cloud``, fs object store under
its data directory, ``wal.segment_seconds`` 10, ``storage.clock_interval_seconds`` 10,
``iceberg.tail_step_seconds`` 10, hour-wide tables), and in this process:

* a producer (``danube_ingest.client.Producer``) publishing ``--rate`` 100-byte messages a
  second to one topic, handed over every 10 ms, for ``--seconds``;
* the control plane's two loops, as the Dagster sensors run them: every 10 s the tail step
  (``iceberg_tail_sensor``: ``extend_tail`` then ``publish``), every 30 s the conversion of
  complete partitions (``parquet_topics_sensor`` requesting a ``parquet_partitions`` run:
  ``convert`` on the local engine, which publishes). Not measured here: Dagster's own tick and
  run-launch delays;
* a reader thread with a SparkSession from ``catalog_session`` (the catalog, the jars,
  ``local[2]``) querying ``danube.default.fresh`` by name about once a second for the rows
  past the highest offset it has seen, grouped by 100 ms of ``ingest_time``: each row's
  freshness is the query's end minus its ingest time (the bucket's middle), so a value
  includes up to one query's duration.

Reported: p50 / p99 / max freshness over every message (weighted by bucket counts), messages
published and seen, the number of data files in the table's current snapshot at the end, and
the CPU seconds of the broker and of this process. Goal (the issue's): p99 <= 60 s at 10k
msg/s for 5 minutes. Memory: the producer buffers at most ``max_buffered`` messages; the reader
keeps one count per 100 ms bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _common import bench_dir, cpu_pressure, emit, machine, say, warn_if_busy
from publish_danube_client import BrokerChild, proc_cpu

TOPIC = "/default/fresh"
TABLE = "danube.default.fresh"
TAIL_EVERY_S = 10.0
CONVERT_EVERY_S = 30.0
TICK_S = 0.01
GOAL_P99_S = 60.0

BROKER_YAML = """\
etcd:
  prefix: /danube-fresh
"""


def weighted(buckets: dict[float, int], p: float) -> float:
    """The ``p`` percentile of values weighted by their counts."""
    total = sum(buckets.values())
    if not total:
        return float("nan")
    seen = 0
    for value in sorted(buckets):
        seen += buckets[value]
        if seen >= total * p / 100:
            return value
    return max(buckets)


async def produce(url: str, rate: int, seconds: float) -> int:
    from danube_ingest.client import Producer

    pad = bytes(100)
    sent = 0
    total = int(rate * seconds)
    async with Producer(url, TOPIC, max_batch_messages=10_000, max_buffered=rate) as producer:
        start = time.perf_counter()
        next_tick = start
        while sent < total:
            due = min(total, int((time.perf_counter() - start) * rate) + 1)
            if due > sent:
                await producer.send_many([pad] * (due - sent))
                sent = due
            next_tick += TICK_S
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
        await producer.flush()
    return sent


async def follow(config: Any, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """The two sensors' work, in this process (see the module docstring)."""
    from danube_ingest.analytics.convert import convert, pending_partitions
    from danube_ingest.analytics.follow import tail_round
    from danube_ingest.analytics.iceberg import IcebergTarget
    from danube_ingest.metadata import EtcdKV, Keys
    from danube_ingest.objects.store import ObjectStore

    target = IcebergTarget.from_config(config)
    assert target is not None
    kv = await EtcdKV.connect(list(config.etcd.endpoints), timeout=5.0)
    keys = Keys(config.etcd.prefix)
    store = ObjectStore.from_config(config)
    last_convert = 0.0
    try:
        while not stop.is_set():
            began = time.monotonic()
            if began - last_convert >= CONVERT_EVERY_S:
                last_convert = began
                if await pending_partitions(kv, keys, TOPIC):
                    await convert(
                        kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC,
                        iceberg=target,
                    )  # fmt: skip
                    counts["conversions"] += 1
            done = await tail_round(
                kv, keys, store, target, root="warehouse/",
                step_s=config.iceberg.tail_step_seconds, topics=[TOPIC],
            )  # fmt: skip
            counts["tail_steps"] += len(done.moved)
            for problem in done.problems:  # (the next round tries again, as the sensor)
                say(f"tail step failed: {problem}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    stop.wait(), max(0.0, TAIL_EVERY_S - (time.monotonic() - began))
                )
    finally:
        await store.close()
        await kv.close()


def read_loop(
    spark: Any, stop: threading.Event, buckets: dict[float, int], seen: list[int]
) -> None:
    """Query the table by name until ``stop``; count each new row's freshness."""
    high = -1
    while not stop.is_set():
        try:
            rows = spark.sql(
                "SELECT CAST(floor(unix_millis(ingest_time) / 100) AS BIGINT) AS b, "
                f"count(*) AS n, max(offset) AS hi FROM {TABLE} WHERE offset > {high} "
                "GROUP BY b"
            ).collect()
        except Exception as exc:  # (before the table exists; said once it did)
            if high >= 0:
                say(f"query failed: {str(exc).strip().splitlines()[0][:200]}")
            time.sleep(1.0)
            continue
        now_ms = time.time() * 1000
        for row in rows:
            age = round((now_ms - (row.b * 100 + 50)) / 1000, 1)
            buckets[age] = buckets.get(age, 0) + row.n
            high = max(high, row.hi)
        seen[0] = high + 1
        time.sleep(1.0)


def spark_for(config: Any) -> Any:
    """The reader's session (made before the event loop runs: uvloop reaps child processes,
    and the JVM's launcher waits on its child)."""
    from danube_ingest.analytics import catalog_session

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = catalog_session(
        "freshness",
        master="local[2]",
        config={"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC"},
        broker_config=config,
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


async def run(
    rate: int, seconds: float, work: Path, etcd: Any, broker: BrokerChild, config: Any, spark: Any
) -> None:
    warn_if_busy("start")
    pressure_before = cpu_pressure()
    buckets: dict[float, int] = {}
    seen = [0]
    counts = {"conversions": 0, "tail_steps": 0}
    stop_reader = threading.Event()
    reader = threading.Thread(target=read_loop, args=(spark, stop_reader, buckets, seen))
    stop = asyncio.Event()
    try:
        reader.start()
        follower = asyncio.create_task(follow(config, stop, counts))
        broker0, self0 = proc_cpu(broker.pid), time.process_time()
        say(f"publishing {rate:,} msg/s for {seconds:.0f} s to {TOPIC}")
        sent = await produce(broker.url, rate, seconds)
        # Let the last messages become visible (at most two clock intervals and steps).
        deadline = time.monotonic() + 90.0
        while seen[0] < sent and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        broker_cpu = proc_cpu(broker.pid) - broker0
        self_cpu = time.process_time() - self0
        stop.set()
        await follower
    finally:
        stop.set()
        stop_reader.set()
        reader.join(timeout=60)
        files = _files(config)
    p50, p99 = weighted(buckets, 50), weighted(buckets, 99)
    seen_total = sum(buckets.values())
    say(
        f"freshness over {seen_total:,} of {sent:,} messages: p50 {p50:.1f} s, p99 {p99:.1f} s, "
        f"max {max(buckets, default=float('nan')):.1f} s (goal p99 <= {GOAL_P99_S:.0f} s); "
        f"{counts['tail_steps']} tail steps, {counts['conversions']} conversions; {files} data "
        f"files in the table; CPU s broker {broker_cpu:.1f}, this process {self_cpu:.1f}"
    )
    emit(
        {
            "benchmark": "iceberg_freshness",
            "value": p99,
            "unit": "s",
            "baseline": GOAL_P99_S,
            "ratio": p99 / GOAL_P99_S,
            "ratio_meaning": "p99 freshness (ingest -> seen in Spark SQL by name) / the 60 s goal",
            "p50_s": p50,
            "max_s": max(buckets, default=None),
            "rate": rate,
            "seconds": seconds,
            "published": sent,
            "seen": seen_total,
            "tail_steps": counts["tail_steps"],
            "conversions": counts["conversions"],
            "files": files,
            "broker_cpu_s": broker_cpu,
            "self_cpu_s": self_cpu,
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": cpu_pressure(),
            "machine": machine(),
        }
    )


def _files(config: Any) -> int:
    from danube_ingest.analytics.iceberg import IcebergTarget

    target = IcebergTarget.from_config(config)
    assert target is not None
    try:
        table = target.catalog().load_table(("default", "fresh"))
    except Exception:
        return 0
    return sum(1 for _ in table.scan().plan_files())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=10_000, help="messages per second")
    parser.add_argument("--seconds", type=float, default=300.0, help="how long to publish")
    args = parser.parse_args()
    import uvloop

    from danube_ingest.config import load_config
    from danube_ingest.testing import LocalEtcd

    with bench_dir("iceberg-fresh") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint, "fresh-broker", BROKER_YAML)
        broker.data_dir.mkdir(parents=True, exist_ok=True)
        config = load_config(
            None,
            {
                "broker.data_dir": str(broker.data_dir),
                "etcd.endpoints": [etcd.endpoint],
                "etcd.prefix": "/danube-fresh",
            },
        )
        spark = spark_for(config)
        try:
            broker.start(90.0)
            uvloop.run(run(args.rate, args.seconds, work, etcd, broker, config, spark))
        finally:
            broker.stop()
            spark.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
