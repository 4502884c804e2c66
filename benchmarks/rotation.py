"""Rotation of a topic's segment ranges into one rolling object, against a raw opendal read +
write of the same bytes.

Run: ``.venv/bin/python benchmarks/rotation.py [--mib N] [--s3]`` (default 64 MiB of payload,
~30 s on 2 cores; ``--s3`` adds the same against a local ``moto_server``).

Setup (``catchup_read.Setup``): a TopicStore holds ``/bench/catchup`` (N MiB of JSON-like
payloads of 100 B to 1 KiB, four producers) and a little of ``/bench/other`` in the same
segments; the real SegmentUploader (zstd) uploads every sealed segment (8 MiB) to an fs object
store and commits the manifest (etcd: the in-process ``MemoryKV``, the same contract); the
topic's ingest clock is then written past every range.

Main figure (``value``): MB/s (10^6 bytes of the replaced ranges' stored bytes) of
``rotate_topic``: plan, footer and ranged reads of every segment object, CRC checks, zstd
decompression and re-compression into 1 MiB frames, ``put_if_absent``, the whole object read
back and CRC32C-checked, and the manifest swap. Baseline: raw ``opendal.AsyncOperator``:
``read(key, offset, size)`` of the same byte ranges, then one ``write`` of their concatenation.
Three samples of each, interleaved (between samples the manifest is swapped back and the
rolling object deleted); medians. ``cpu_s``: process CPU seconds of one rotation.

The uploader's frames of this topic are ~1 MiB already, so the main figure copies them as
stored. ``recompress_*``: the same rotation with 4 MiB target frames, so that every frame is
decompressed and re-compressed (what happens to a quiet topic's small frames).

Cost figures: PUTs per sealed segment by the uploader (all topics share one object), PUTs per
rolling object by rotation, and the topic's manifest entries and objects before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import opendal
from _common import MIB, bench_dir, emit, machine, median, ratio, say, warn_if_busy
from catchup_read import OTHER, TOPIC, Setup

from danube_ingest.metadata.clock import ClockMark, ClockWriter
from danube_ingest.objects.rotation import RotationLimits, rotate_topic
from danube_ingest.runtime import tune_gc
from danube_ingest.testing import MotoServer

SAMPLES = 3
LIMITS = RotationLimits()
#: Frames of 4 MiB: the uploader's 1 MiB frames are then all decompressed and re-compressed
#: (what a quiet topic's small frames always are).
RECOMPRESS = RotationLimits(frame_bytes=4 * MIB)


async def measure(root: Path, total: int, s3: dict[str, str] | None = None) -> dict[str, Any]:
    setup = Setup(root, (100, 1024), total, s3)
    await setup.build()
    segments = {r.object_key for t in (TOPIC, OTHER) for r in await setup.manifest.ranges(t)}
    uploader_puts = setup.objects.stats.puts
    owner = setup.ownership.owned(TOPIC)
    assert owner is not None
    end = setup.ranges[-1].end_offset
    far = int(time.time() * 1000) + 10 * 3_600_000
    await ClockWriter(setup.ownership).advance({TOPIC: ClockMark(end, far, owner.epoch)})
    op = opendal.AsyncOperator(setup.scheme, **setup.options)
    originals = setup.ranges
    stored = setup.stored

    async def rotate_once(limits: RotationLimits) -> tuple[float, float, int, list[str]]:
        puts = setup.objects.stats.puts
        cpu = time.process_time()
        start = time.perf_counter()
        report = await rotate_topic(setup.manifest, setup.objects, TOPIC, limits)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
        assert report.bytes_in == stored and report.entries_after == 1, report
        new = await setup.manifest.ranges(TOPIC)
        # Back to the segment ranges for the next sample; the next rotation writes afresh.
        assert await setup.manifest.replace(None, new, originals)
        for key in report.objects:
            await setup.objects.delete(key)
        return elapsed, cpu, setup.objects.stats.puts - puts, report.objects

    async def raw_once(i: int) -> float:
        start = time.perf_counter()
        parts = [
            await op.read(r.object_key, offset=r.byte_start, size=r.byte_length) for r in originals
        ]
        await op.write(f"bench-raw/{i}.bin", b"".join(bytes(p) for p in parts))
        elapsed = time.perf_counter() - start
        await op.delete(f"bench-raw/{i}.bin")
        return elapsed

    await raw_once(-1)  # warm the page cache
    rotations, cpus, raws, recompressions, recompress_cpus = [], [], [], [], []
    puts = 0
    keys: list[str] = []
    for i in range(SAMPLES):
        raws.append(await raw_once(i))
        elapsed, cpu, puts, keys = await rotate_once(LIMITS)
        rotations.append(elapsed)
        cpus.append(cpu)
        elapsed, cpu, _, _ = await rotate_once(RECOMPRESS)
        recompressions.append(elapsed)
        recompress_cpus.append(cpu)
    final = await rotate_topic(setup.manifest, setup.objects, TOPIC, LIMITS)
    after = await setup.manifest.ranges(TOPIC)
    await setup.close()
    rotate_s, raw_s = median(rotations), median(raws)
    return {
        "stored_mb": stored / 1e6,
        "payload_mb": setup.payload_bytes / 1e6,
        "rotation_mb_s": stored / 1e6 / rotate_s,
        "raw_mb_s": stored / 1e6 / raw_s,
        "ratio": raw_s / rotate_s,
        "cpu_s": median(cpus),
        "recompress_mb_s": stored / 1e6 / median(recompressions),
        "recompress_ratio": raw_s / median(recompressions),
        "recompress_cpu_s": median(recompress_cpus),
        "uploader_puts_per_segment": uploader_puts / len(segments),
        "segments": len(segments),
        "rotation_puts_per_object": puts / max(1, len(keys)),
        "entries_before": len(originals),
        "entries_after": len(after),
        "objects_after": len({r.object_key for r in after}),
        "bytes_out": final.bytes_out,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="payload MiB written to the topic")
    parser.add_argument("--s3", action="store_true", help="also measure on a local moto_server")
    args = parser.parse_args()
    tune_gc()
    note = warn_if_busy("start")
    with bench_dir("rotation") as root:
        say(f"rotation, fs, payloads 100 B..1 KiB, ~{args.mib} MiB:")
        fs = await measure(root, args.mib * MIB)
        say("  ", json.dumps({k: round(v, 3) for k, v in fs.items()}))
    remote: dict[str, Any] | None = None
    if args.s3:
        with bench_dir("rotation-s3") as root:
            say(f"rotation, s3 (a local moto_server), ~{args.mib} MiB:")
            moto = MotoServer()
            moto.start()
            try:
                moto.create_bucket("bench")
                remote = await measure(root, args.mib * MIB, moto.options("bench"))
            finally:
                moto.stop()
            say("  ", json.dumps({k: round(v, 3) for k, v in remote.items()}))
    emit(
        {
            "benchmark": "rotation",
            "value": fs["rotation_mb_s"],
            "unit": "MB/s of input (stored bytes of the replaced ranges)",
            "baseline": fs["raw_mb_s"],
            "ratio": ratio(fs["rotation_mb_s"], fs["raw_mb_s"]),
            "ratio_meaning": "rotation throughput / raw opendal read + write of the same bytes",
            "goal": ">= 0.5",
            "fs": fs,
            "s3_moto": remote,
            "load": note,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
