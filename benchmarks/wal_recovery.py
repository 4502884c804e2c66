"""Recovery scan speed of a region's segment files against a plain sequential read.

Run: ``.venv/bin/python benchmarks/wal_recovery.py`` (no arguments, about 6 to 10 s on 2 cores).

Setup: a TopicStore (fsync="never", default 8 MiB segments) is filled with ~128 MiB of
entries of 100 B to 1 KiB over 8 topics by 256 concurrent asyncio tasks each looping
``await store.append`` (so frames are what live traffic produces: one MESSAGES frame per topic
per handoff, ~30 entries each), then closed. The snapshot (``r0/meta.json``) is deleted so
recovery has to scan every segment; nothing else is touched.

Main figure (``value``): MB/s (10^6 bytes) scanned by
``danube_ingest.wal.recovery.recover_region(region_dir)``, which reads every segment, verifies
every frame's two CRCs and rebuilds each topic's offsets and sparse index.

Baseline: a plain sequential read of the same files (each file read fully with 1 MiB
``readinto`` calls into one reused buffer). Both run with a warm page cache (every file is
fsync'ed, so no background writeback competes, then read once before measuring; this machine
has RAM to spare), so the figure is CPU and memory cost, not disk bandwidth. Five samples of
each, interleaved; medians reported. MB per CPU-second (process CPU time) is reported too: it
is much less distorted by other load on the machine than MB per wall-clock second.

Extras: frames/s; a second data set with many small frames (1024 topics, one task each, so
most MESSAGES frames hold one entry) to show the per-frame cost; and the time to open a
TopicStore on the main data set with the snapshot present vs absent.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

from _common import MIB, bench_dir, emit, machine, median, ratio, say, warn_if_busy

from danube_ingest.runtime import tune_gc
from danube_ingest.store.topic_store import TopicStore
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.meta import SNAPSHOT_NAME
from danube_ingest.wal.recovery import recover_region
from danube_ingest.wal.segment import list_segments, segment_path

MAIN_BYTES = 128 * MIB
MAIN_TOPICS = 8
MAIN_TASKS = 256
SMALL_BYTES = 24 * MIB
SMALL_TOPICS = 1024
SMALL_TASKS = 1024
MIN_PAYLOAD = 100
MAX_PAYLOAD = 1024
SAMPLES = 5
READ_MIN_SECONDS = 0.25
OPEN_REPEATS = 3
GOAL = 0.5
MB = 1_000_000


async def fill(wal_dir: Path, total_bytes: int, topics: int, tasks: int) -> dict[str, int]:
    """Write ~``total_bytes`` of payload; return entries appended per topic."""
    pool = os.urandom(2 * MAX_PAYLOAD * 64)
    store = await TopicStore.open(wal_dir, fsync="never")
    names = [f"topic-{i:04d}" for i in range(topics)]
    counts = dict.fromkeys(names, 0)
    per_task = total_bytes // tasks

    async def writer(i: int) -> None:
        rng = random.Random(i)
        name = names[i % topics]
        written = 0
        n = 0
        while written < per_task:
            size = rng.randint(MIN_PAYLOAD, MAX_PAYLOAD)
            start = rng.randrange(0, len(pool) - size)
            await store.append(name, Entry(pool[start : start + size]))
            written += size
            n += 1
        counts[name] += n

    await asyncio.gather(*(writer(i) for i in range(tasks)))
    await store.close()
    return counts


def segment_files(region_dir: Path) -> list[Path]:
    return [segment_path(region_dir, seq) for seq in list_segments(region_dir)]


def plain_read(files: list[Path], buf: bytearray) -> int:
    """Read every file fully with 1 MiB readinto calls; return bytes read."""
    total = 0
    view = memoryview(buf)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def plain_read_rate(files: list[Path], buf: bytearray) -> tuple[float, float]:
    """(bytes/s, bytes per CPU-second) of full passes over ``files`` for >= READ_MIN_SECONDS."""
    total = 0
    start = time.perf_counter()
    cpu0 = time.process_time()
    while True:
        total += plain_read(files, buf)
        elapsed = time.perf_counter() - start
        if elapsed >= READ_MIN_SECONDS:
            return total / elapsed, total / max(time.process_time() - cpu0, 1e-9)


def recover_rate(region_dir: Path) -> tuple[float, float, float, Any]:
    """(bytes/s, frames/s, bytes per CPU-second, state) of one ``recover_region`` call."""
    start = time.perf_counter()
    cpu0 = time.process_time()
    state = recover_region(region_dir)
    cpu = max(time.process_time() - cpu0, 1e-9)
    elapsed = time.perf_counter() - start
    return (
        state.bytes_scanned / elapsed,
        state.frames_scanned / elapsed,
        state.bytes_scanned / cpu,
        state,
    )


def check_state(state: Any, counts: dict[str, int]) -> None:
    for name, n in counts.items():
        topic = state.topics.get(name)
        assert topic is not None and topic.next_offset == n, (name, n, topic and topic.next_offset)


async def timed_open(wal_dir: Path) -> float:
    start = time.perf_counter()
    store = await TopicStore.open(wal_dir, fsync="always")
    elapsed = time.perf_counter() - start
    await store.close()
    return elapsed


def settle(files: list[Path]) -> None:
    """Flush the data set to disk (fsync=never left it dirty) and pull it into the page cache.

    Without the flush, the kernel's background writeback of the data set competes with the
    measurement and halves both figures erratically.
    """
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    plain_read(files, bytearray(MIB))


def measure_scan(region_dir: Path, counts: dict[str, int], label: str) -> dict[str, Any]:
    files = segment_files(region_dir)
    nbytes = sum(p.stat().st_size for p in files)
    buf = bytearray(MIB)
    settle(files)
    (region_dir / SNAPSHOT_NAME).unlink(missing_ok=True)
    reads: list[float] = []
    reads_cpu: list[float] = []
    scans: list[float] = []
    scans_cpu: list[float] = []
    frames: list[float] = []
    state = None
    for _ in range(SAMPLES):
        rate, cpu_rate = plain_read_rate(files, buf)
        reads.append(rate)
        reads_cpu.append(cpu_rate)
        rate, frate, cpu_rate, state = recover_rate(region_dir)
        scans.append(rate)
        scans_cpu.append(cpu_rate)
        frames.append(frate)
    assert state is not None
    assert state.bytes_scanned == nbytes, (state.bytes_scanned, nbytes)
    check_state(state, counts)
    out = {
        "bytes": nbytes,
        "segments": len(files),
        "frames": state.frames_scanned,
        "entries": sum(counts.values()),
        "scan_mb_s": median(scans) / MB,
        "read_mb_s": median(reads) / MB,
        "frames_per_s": median(frames),
        "scan_mb_per_cpu_s": median(scans_cpu) / MB,
        "read_mb_per_cpu_s": median(reads_cpu) / MB,
        "scan_runs": [r / MB for r in scans],
        "read_runs": [r / MB for r in reads],
    }
    say(
        f"{label}: {nbytes / MIB:.0f} MiB in {len(files)} segments, {state.frames_scanned:,} "
        f"frames ({nbytes / state.frames_scanned / 1024:.1f} KiB/frame), "
        f"{out['entries']:,} entries"
    )
    say(
        f"  recover_region {out['scan_mb_s']:,.0f} MB/s ({out['frames_per_s']:,.0f} frames/s) | "
        f"plain read {out['read_mb_s']:,.0f} MB/s | ratio "
        f"{ratio(out['scan_mb_s'], out['read_mb_s']):.3f}   (medians of {SAMPLES}, warm cache)"
    )
    say(
        f"  per CPU-second: recover_region {out['scan_mb_per_cpu_s']:,.0f} MB, plain read "
        f"{out['read_mb_per_cpu_s']:,.0f} MB, ratio "
        f"{ratio(out['scan_mb_per_cpu_s'], out['read_mb_per_cpu_s']):.3f}"
    )
    return out


def main() -> None:
    # The daemon's process settings (danube-ingest broker applies them the same way).
    tune_gc()
    t_start = time.perf_counter()
    say("wal_recovery: recover_region(region_dir) without snapshot vs plain sequential read")
    load_start = warn_if_busy("start")
    with bench_dir("wal-recovery") as wal_dir:
        t = time.perf_counter()
        counts = asyncio.run(fill(wal_dir, MAIN_BYTES, MAIN_TOPICS, MAIN_TASKS))
        say(
            f"  wrote {sum(counts.values()):,} entries ({MIN_PAYLOAD}-{MAX_PAYLOAD} B) to "
            f"{MAIN_TOPICS} topics with {MAIN_TASKS} tasks, fsync=never, in "
            f"{time.perf_counter() - t:.1f}s"
        )
        region_dir = wal_dir / "r0"
        settle(segment_files(region_dir))

        # Open with the snapshot present (each open/close adds a tiny segment and rewrites
        # the snapshot, which leaves the data set otherwise as it was).
        open_with = [asyncio.run(timed_open(wal_dir)) for _ in range(OPEN_REPEATS)]

        main = measure_scan(region_dir, counts, "main data set (8 topics)")

        open_without = []
        for _ in range(OPEN_REPEATS):
            (region_dir / SNAPSHOT_NAME).unlink(missing_ok=True)
            open_without.append(asyncio.run(timed_open(wal_dir)))
        say(
            f"  TopicStore.open: snapshot present {median(open_with) * 1000:.1f} ms, absent "
            f"{median(open_without) * 1000:.1f} ms (medians of {OPEN_REPEATS})"
        )

    with bench_dir("wal-recovery-small") as wal_dir:
        t = time.perf_counter()
        small_counts = asyncio.run(fill(wal_dir, SMALL_BYTES, SMALL_TOPICS, SMALL_TASKS))
        say(
            f"  wrote {sum(small_counts.values()):,} entries to {SMALL_TOPICS} topics with "
            f"{SMALL_TASKS} tasks in {time.perf_counter() - t:.1f}s"
        )
        small = measure_scan(wal_dir / "r0", small_counts, "small-frame data set (1024 topics)")

    value = main["scan_mb_s"]
    baseline = main["read_mb_s"]
    result: dict[str, Any] = {
        "benchmark": "wal_recovery",
        "value": value,
        "unit": "MB/s",
        "baseline": baseline,
        "ratio": ratio(value, baseline),
        "ratio_meaning": "value/baseline, higher is better (recover_region MB/s scanned vs "
        "plain sequential 1 MiB reads of the same files; warm page cache)",
        "goal_ratio": GOAL,
        "goal_met": ratio(value, baseline) >= GOAL,
        "page_cache": "warm",
        "frames_per_s": main["frames_per_s"],
        "bytes": main["bytes"],
        "segments": main["segments"],
        "frames": main["frames"],
        "entries": main["entries"],
        "avg_frame_bytes": main["bytes"] / main["frames"],
        "value_mb_per_cpu_s": main["scan_mb_per_cpu_s"],
        "baseline_mb_per_cpu_s": main["read_mb_per_cpu_s"],
        "cpu_ratio": ratio(main["scan_mb_per_cpu_s"], main["read_mb_per_cpu_s"]),
        "cpu_ratio_meaning": "MB per CPU-second, recover_region / plain read; higher is better",
        "value_runs": main["scan_runs"],
        "baseline_runs": main["read_runs"],
        "open_snapshot_present_ms": median(open_with) * 1000,
        "open_snapshot_absent_ms": median(open_without) * 1000,
        "small_frames_value": small["scan_mb_s"],
        "small_frames_baseline": small["read_mb_s"],
        "small_frames_ratio": ratio(small["scan_mb_s"], small["read_mb_s"]),
        "small_frames_frames_per_s": small["frames_per_s"],
        "small_frames_avg_frame_bytes": small["bytes"] / small["frames"],
        "small_frames_bytes": small["bytes"],
        "elapsed_s": time.perf_counter() - t_start,
        "load_start": load_start,
        "load_end": warn_if_busy("end"),
        **machine(),
    }
    emit(result)


if __name__ == "__main__":
    main()
