"""The Spark conversion (``convert(engine="spark")`` on ``local[2]``) against a single-process
pyarrow decode + Parquet write of the same objects.

Run: ``.venv/bin/python benchmarks/spark_convert.py`` (no arguments, ~60 s on 2 cores, of which
~10 s start the Spark session, which is excluded from every figure).

Setup: one topic without a schema, 8 minute-wide partitions of 40,000 entries each (payloads of
60 to 200 bytes of JSON-like text, attributes, a producer name), each partition in one ``.bin``
object written with the real object writer (``BinWriter``, zstd) to an fs store, its manifest
range and the topic clock in a ``MemoryKV`` (Spark tasks never touch etcd: the driver plans and
commits, so the in-process KV has etcd's contract at no network cost).

Main figure (``value``): rows/s of a whole ``convert(engine="spark")`` run: table and rendition
creation, planning, one Spark task per partition (read the object's frames, decode, build the
Arrow batch, write the Parquet file to staging), then the driver's commits, publishes and
frontier advance. Each round gets a fresh KV copy and warehouse directory.

Baseline: the same objects read, decoded and written as Parquet in this process, one partition
after another (``aread_part`` + ``write_partition``: what each Spark task does, without Spark,
without commits). One warm-up of each, then three interleaved rounds; medians reported.

Extras: MB/s of object bytes read (compressed) and of Parquet written; process-tree CPU seconds
of each side (the Spark side counts the JVM and the Python workers, read from /proc); the local
engine's ``convert`` in the same rounds; peak RSS of the process tree (this process, the JVM and
the Python workers), sampled every 50 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from _common import bench_dir, emit, machine, median, ratio, say, warn_if_busy

from danube_ingest.analytics.columns import table_schema
from danube_ingest.analytics.convert import StoreSpec, convert
from danube_ingest.analytics.layout import partition_end
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.plan import read_plan_input
from danube_ingest.analytics.session import spark_session
from danube_ingest.analytics.source import aread_part, plan_reads
from danube_ingest.metadata import Keys, MemoryKV
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.objects.binfmt.writer import BinWriter
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry

TOPIC = "/bench/clicks"
PARTITIONS = 8
ROWS = 40_000
WIDTH_S = 60
#: 2026-11-24T10:00:00Z.
T0 = 1_795_514_400_000
ROUNDS = 3
GOAL = 0.5


def _payload(i: int) -> bytes:
    text = json.dumps(
        {"user": i % 9973, "page": f"/p/{i % 311}", "ms": i * 7, "ref": "x" * (i % 140)}
    )
    return text.encode()


def build_objects(root: Path) -> tuple[list[ObjectRange], int]:
    """Write one object per partition; returns the manifest ranges and their bytes."""
    ranges = []
    size = 0
    width_ms = WIDTH_S * 1000
    for p in range(PARTITIONS):
        entries = [
            Entry(
                _payload(o),
                publish_ms=T0 + p * width_ms + (o % ROWS) * width_ms // ROWS - 3,
                producer_name=f"producer-{o % 4}",
                routing_key=None if o % 3 else f"k{o % 17}",
                attributes={"n": str(o % 10)},
                offset=o,
                ingest_ms=T0 + p * width_ms + (o % ROWS) * width_ms // ROWS,
            )
            for o in range(p * ROWS, (p + 1) * ROWS)
        ]
        writer = BinWriter("zstd")
        writer.add_entries(TOPIC, entries)
        data = writer.finish()
        key = f"segments/bench/0/{p * ROWS:020d}.bin"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
        span = writer.footer.topics[TOPIC]
        ranges.append(
            ObjectRange(
                topic=TOPIC,
                object_key=key,
                start_offset=span.first_offset,
                end_offset=span.last_offset + 1,
                entries=span.entries,
                byte_start=span.position,
                byte_length=span.length,
                object_size=len(data),
                object_crc=0,
                first_ingest_ms=span.first_ingest_ms,
                last_ingest_ms=span.last_ingest_ms,
                kind="segment",
                broker="bench",
                epoch=1,
            )
        )
        size += span.length
    return ranges, size


async def fresh_kv(ranges: list[ObjectRange]) -> tuple[MemoryKV, Keys]:
    kv, keys = MemoryKV(), Keys("/bench")
    for rng in ranges:
        await kv.put(keys.storage_object(TOPIC, rng.start_offset), rng.encode())
    end = partition_end(T0 + (PARTITIONS - 1) * WIDTH_S * 1000, WIDTH_S)
    await kv.put(keys.topic_clock(TOPIC), TopicClock(PARTITIONS * ROWS, end).encode())
    return kv, keys


def _tree() -> list[int]:
    """This process and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of the live process tree, children included."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _tree():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        except (OSError, ValueError):
            continue
    return total / ticks


def tree_rss() -> int:
    total = 0
    for pid in _tree():
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class PeakRss:
    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, tree_rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def baseline(objects: ObjectStore, ranges: list[ObjectRange], out: Path) -> int:
    """Read, decode and write every partition in this process; returns Parquet bytes."""
    kv, keys = await fresh_kv(ranges)
    plan = await read_plan_input(kv, keys, TOPIC)
    warehouse = ObjectStore("fs", options={"root": str(out)})
    written = 0
    for rng in plan.ranges:
        start = rng.first_ingest_ms - rng.first_ingest_ms % (WIDTH_S * 1000)
        parts = plan_reads([rng], start_ms=start, end_ms=partition_end(start, WIDTH_S))
        batches = [b for part in parts async for b in aread_part(objects, part)]
        files = await write_partition(warehouse, f"p{start}/", batches, table_schema(None))
        written += sum(f.size for f in files)
    await warehouse.close()
    return written


async def run_convert(
    objects: ObjectStore,
    objects_root: Path,
    ranges: list[ObjectRange],
    out: Path,
    engine: str,
    spark: Any,
) -> int:
    kv, keys = await fresh_kv(ranges)
    warehouse = ObjectStore("fs", options={"root": str(out)})
    result = await convert(
        kv=kv,
        keys=keys,
        objects=objects,
        warehouse=warehouse,
        topic=TOPIC,
        engine=engine,  # type: ignore[arg-type]
        spark=spark,
        width_s=WIDTH_S,
        objects_spec=StoreSpec("fs", {"root": str(objects_root)}),
        warehouse_spec=StoreSpec("fs", {"root": str(out)}),
    )
    await warehouse.close()
    assert sum(p.rows for p in result.partitions) == PARTITIONS * ROWS
    return sum(f.stat().st_size for f in out.rglob("*.parquet"))


def timed(job: Coroutine[Any, Any, int]) -> tuple[float, float, int]:
    """Wall and process-tree CPU seconds of running ``job``, and its result."""
    cpu, wall = tree_cpu_s(), time.perf_counter()
    value = asyncio.run(job)
    return time.perf_counter() - wall, tree_cpu_s() - cpu, value


def main() -> None:
    with bench_dir("spark-convert") as base, PeakRss() as rss:
        objects_root = base / "objects"
        say(f"building {PARTITIONS} objects of {ROWS} entries ...")
        ranges, in_bytes = build_objects(objects_root)
        objects = ObjectStore("fs", options={"root": str(objects_root)})
        say("starting Spark local[2] (not timed) ...")
        spark = spark_session(
            "bench-spark-convert", master="local[2]", config={"spark.ui.enabled": "false"}
        )
        spark.sparkContext.setLogLevel("ERROR")
        rss_after_start = tree_rss()
        load_start = warn_if_busy("start")
        rows = PARTITIONS * ROWS
        figures: dict[str, list[tuple[float, float, int]]] = {"spark": [], "local": [], "base": []}
        for n in range(ROUNDS + 1):
            for name in ("spark", "base", "local"):
                out = base / f"{name}-{n}"
                if name == "base":
                    job = baseline(objects, ranges, out)
                else:
                    job = run_convert(objects, objects_root, ranges, out, name, spark)
                wall, cpu, written = timed(job)
                shutil.rmtree(out, ignore_errors=True)
                if n:  # round 0 warms up (Python workers, imports, caches)
                    figures[name].append((wall, cpu, written))
                say(f"  round {n} {name}: {wall:.2f} s, {rows / wall:,.0f} rows/s, cpu {cpu:.2f} s")
        load_end = warn_if_busy("end")
        spark.stop()
        asyncio.run(objects.close())

    def med(name: str, index: int) -> float:
        return median([f[index] for f in figures[name]])

    spark_s, base_s, local_s = med("spark", 0), med("base", 0), med("local", 0)
    value, base_rate = rows / spark_s, rows / base_s
    say(f"spark convert: {value:,.0f} rows/s; single-process pyarrow: {base_rate:,.0f} rows/s")
    emit(
        {
            "benchmark": "spark_convert",
            "value": value,
            "unit": "rows/s",
            "baseline": base_rate,
            "ratio": ratio(value, base_rate),
            "ratio_meaning": "convert(engine=spark) on local[2] rows/s over single-process "
            f"pyarrow decode + Parquet write of the same objects (goal >= {GOAL})",
            "goal": GOAL,
            "rows": rows,
            "partitions": PARTITIONS,
            "spark_mb_per_s_in": in_bytes / spark_s / 1e6,
            "baseline_mb_per_s_in": in_bytes / base_s / 1e6,
            "parquet_mb_per_s_out_spark": med("spark", 2) / spark_s / 1e6,
            "spark_cpu_s": med("spark", 1),
            "baseline_cpu_s": med("base", 1),
            "spark_cpu_us_per_row": med("spark", 1) / rows * 1e6,
            "baseline_cpu_us_per_row": med("base", 1) / rows * 1e6,
            "local_engine_rows_per_s": rows / local_s,
            "local_engine_ratio": ratio(rows / local_s, base_rate),
            "object_mb": in_bytes / 1e6,
            "parquet_mb": med("spark", 2) / 1e6,
            "peak_rss_tree_mb": rss.peak / 1e6,
            "rss_tree_after_spark_start_mb": rss_after_start / 1e6,
            "load_start": load_start,
            "load_end": load_end,
            **machine(),
        }
    )


if __name__ == "__main__":
    main()
