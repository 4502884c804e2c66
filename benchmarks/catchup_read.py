"""Catch-up reading of a topic from objects against a raw opendal read of the same bytes.

Run: ``.venv/bin/python benchmarks/catchup_read.py`` (no arguments, ~35 s on 2 cores).

Setup: a TopicStore (fs WAL, fsync="never", 8 MiB segments) holds two topics written by
concurrent producers (so segments, and the objects uploaded from them, interleave topics as
live traffic does): ``/bench/catchup`` gets ~48 MiB of JSON-like payloads of 100 B to 1 KiB,
``/bench/other`` a quarter of that. The real SegmentUploader (zstd, the default codec) uploads
every sealed segment to an fs object store and commits the manifest (etcd: the in-process
``MemoryKV``, the same contract as etcd). A prune mark then lets the real WalCleaner delete
every segment, so the topic exists only in objects.

Main figure (``value``): MB/s (10^6 bytes of stored object bytes of the topic, i.e. its byte
ranges in the manifest) read by ``TopicStore.create_reader(topic, 0)`` until every entry was
returned: manifest read, footer reads, ranged frame reads with prefetch, CRC checks, zstd
decompression, and decoding into Entry objects.

Baseline: raw opendal (``opendal.AsyncOperator`` on the same root): ``read(key, offset, size)``
of exactly those byte ranges, one call per range, nothing decoded. Both run against a warm
page cache; five samples of each, interleaved; medians reported.

Extras: entries/s and payload MB/s of the reader; process CPU seconds; the compression ratio;
``ceiling_read_plus_decompress``: the ratio a reader would reach that did nothing but read the
bytes and decompress them in C on one thread (no CRC, no decoding, no Python); the main case
with objects compressed with lz4 instead of zstd;
the same with payloads of 16 KiB (where per-entry costs matter less); and the main case against
an S3 server (``moto_server`` on loopback, a separate process) instead of local files, where
the baseline is a network read rather than a copy out of the page cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import lz4.block
import opendal
import zstandard
from _common import MIB, bench_dir, emit, machine, median, ratio, say, warn_if_busy

from danube_ingest.config import load_config
from danube_ingest.metadata import BrokerSession, Keys, MemoryKV, Ownership
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.objects.binfmt import FRAME_PREFIX_SIZE, parse_object
from danube_ingest.objects.cleaner import WalCleaner
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import SegmentUploader
from danube_ingest.runtime import tune_gc
from danube_ingest.store.topic_store import TopicStore
from danube_ingest.testing import MotoServer
from danube_ingest.wal.framing import Entry

TOPIC = "/bench/catchup"
OTHER = "/bench/other"
SAMPLES = 5
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def payload(rng: random.Random, size: int) -> bytes:
    """A JSON-like event of about ``size`` bytes (compresses about as real events do)."""
    doc: dict[str, Any] = {
        "id": rng.randrange(10**12),
        "user": f"u{rng.randrange(100_000)}",
        "ts": 1_700_000_000_000 + rng.randrange(10**9),
        "kind": rng.choice(WORDS),
    }
    length = len(json.dumps(doc)) + 12
    fill = []
    while length < size:
        word = rng.choice(WORDS) + str(rng.randrange(1000))
        fill.append(word)
        length += len(word) + 1
    doc["note"] = " ".join(fill)
    return json.dumps(doc).encode()[:size]


class Setup:
    def __init__(
        self,
        root: Path,
        sizes: tuple[int, int],
        total: int,
        s3: dict[str, str] | None = None,
        codec: str = "zstd",
    ) -> None:
        self.root = root
        self.sizes = sizes
        self.total = total
        self.codec = codec
        if s3 is None:
            self.scheme, self.options = "fs", {"root": str(root / "objects")}
        else:
            self.scheme, self.options = "s3", s3

    async def build(self) -> None:
        kv = MemoryKV()
        keys = Keys("/bench")
        self.session = BrokerSession(kv, keys, "b1", "http://b1", ttl=60)
        await self.session.start()
        self.ownership = Ownership(kv, keys, self.session)
        self.objects = ObjectStore(self.scheme, options=self.options)
        self.manifest = Manifest(kv, keys)
        self.store = await TopicStore.open(self.root / "wal", fsync="never")
        self.store.attach_cloud(CloudReader(self.manifest, self.objects))
        for topic in (TOPIC, OTHER):
            await self.ownership.acquire(topic)
        uploader = SegmentUploader(
            self.store, self.objects, self.manifest, self.ownership, codec=self.codec
        )
        uploader.start()
        rng = random.Random(7)
        written = 0
        self.entries = 0
        self.payload_bytes = 0

        async def producer(topic: str, share: float) -> None:
            nonlocal written
            while written < self.total:
                batch = [payload(rng, rng.randint(*self.sizes)) for _ in range(64)]
                await asyncio.gather(*(self.store.append(topic, Entry(p)) for p in batch))
                if topic == TOPIC:
                    self.entries += len(batch)
                    self.payload_bytes += sum(map(len, batch))
                written += int(sum(map(len, batch)) * share)

        await asyncio.gather(*(producer(TOPIC, 1.0) for _ in range(4)), producer(OTHER, 0.0))
        for region in self.store.regions:
            active = region.active_seq
            region.rotate()
            while active not in region.sealed:
                await asyncio.sleep(0.01)
        await uploader.drain(timeout=120)
        while any(r.sealed - r.uploaded for r in self.store.regions):
            await asyncio.sleep(0.01)
        await uploader.stop()
        info = self.store.info(TOPIC)
        assert info is not None
        marks = PruneMarks(kv, keys)
        for topic in (TOPIC, OTHER):
            i = self.store.info(topic)
            assert i is not None
            await marks.set_mark("b1", i.region, topic, i.high_watermark)
        retention = load_config(None, {}).storage.wal.retention
        cleaner = WalCleaner(
            self.store, broker_id="b1", retention=retention, kv=kv, keys=keys, require_upload=True
        )
        await cleaner.clean_once()
        info = self.store.info(TOPIC)
        assert info is not None and info.first_offset == info.high_watermark, info
        self.ranges: list[ObjectRange] = await self.manifest.ranges(TOPIC)
        self.stored = sum(r.byte_length for r in self.ranges)

    async def read_topic(self) -> float:
        reader = self.store.create_reader(TOPIC, 0, max_batch=1024)
        count = 0
        start = time.perf_counter()
        while count < self.entries:
            count += len(await reader.next_batch())
        elapsed = time.perf_counter() - start
        reader.close()
        assert count == self.entries, (count, self.entries)
        return elapsed

    async def read_raw(self) -> float:
        op = opendal.AsyncOperator(self.scheme, **self.options)
        start = time.perf_counter()
        total = 0
        for rng in self.ranges:
            data = await op.read(rng.object_key, offset=rng.byte_start, size=rng.byte_length)
            total += len(data)
        elapsed = time.perf_counter() - start
        assert total == self.stored
        return elapsed

    async def load_frames(self) -> None:
        """Keep the topic's stored frames in memory (for the decompression-only figure)."""
        self.frames: list[tuple[int, bytes]] = []
        for rng in self.ranges:
            data = await self.objects.get(rng.object_key)
            span = parse_object(data, rng.object_key).topics[TOPIC]
            for ref in span.frames:
                frame = data[ref.position : ref.position + ref.length]
                raw_len = int.from_bytes(frame[8:12], "little")
                self.frames.append((raw_len, frame[FRAME_PREFIX_SIZE:]))

    def decompress_only(self) -> float:
        """Seconds the codec (C, one thread) needs just to decompress the topic's frames."""
        start = time.perf_counter()
        for raw_len, stored in self.frames:
            if self.codec == "zstd":
                zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
            else:
                lz4.block.decompress(stored, uncompressed_size=raw_len)
        return time.perf_counter() - start

    async def close(self) -> None:
        await self.store.close()
        await self.ownership.close()
        await self.session.close()
        await self.objects.close()


async def measure(
    root: Path,
    sizes: tuple[int, int],
    total: int,
    s3: dict[str, str] | None = None,
    codec: str = "zstd",
) -> dict[str, Any]:
    setup = Setup(root, sizes, total, s3, codec)
    await setup.build()
    await setup.read_raw()  # warm the page cache
    await setup.read_topic()
    await setup.load_frames()
    reads, raws, cpus, unzips = [], [], [], []
    for _ in range(SAMPLES):
        raws.append(await setup.read_raw())
        cpu = time.process_time()
        reads.append(await setup.read_topic())
        cpus.append(time.process_time() - cpu)
        unzips.append(setup.decompress_only())
    await setup.close()
    read_s, raw_s, unzip_s = median(reads), median(raws), median(unzips)
    return {
        "entries": setup.entries,
        "objects": len({r.object_key for r in setup.ranges}),
        "stored_mb": setup.stored / 1e6,
        "payload_mb": setup.payload_bytes / 1e6,
        "compression": setup.payload_bytes / setup.stored,
        "reader_mb_s": setup.stored / 1e6 / read_s,
        "raw_mb_s": setup.stored / 1e6 / raw_s,
        "reader_entries_s": setup.entries / read_s,
        "reader_payload_mb_s": setup.payload_bytes / 1e6 / read_s,
        "reader_cpu_s": median(cpus),
        "ratio": raw_s / read_s,
        "decompress_s": unzip_s,
        "ceiling_read_plus_decompress": raw_s / (raw_s + unzip_s),
        "share_of_ceiling": (raw_s / read_s) / (raw_s / (raw_s + unzip_s)),
    }


async def main() -> None:
    tune_gc()
    note = warn_if_busy("start")
    with bench_dir("catchup") as root:
        say("catch-up read, payloads 100 B..1 KiB, ~48 MiB:")
        small = await measure(root / "small", (100, 1024), 48 * MIB)
        say("  ", json.dumps({k: round(v, 3) for k, v in small.items()}))
    with bench_dir("catchup16k") as root:
        say("catch-up read, payloads 16 KiB, ~24 MiB:")
        large = await measure(root / "large", (16384, 16384), 24 * MIB)
        say("  ", json.dumps({k: round(v, 3) for k, v in large.items()}))
    with bench_dir("catchup-lz4") as root:
        say("catch-up read, payloads 100 B..1 KiB, ~24 MiB, objects compressed with lz4:")
        fast = await measure(root, (100, 1024), 24 * MIB, codec="lz4")
        say("  ", json.dumps({k: round(v, 3) for k, v in fast.items()}))
    with bench_dir("catchup-s3") as root:
        say("catch-up read, payloads 100 B..1 KiB, ~24 MiB, s3 (a local moto_server):")
        moto = MotoServer()
        moto.start()
        try:
            moto.create_bucket("bench")
            remote = await measure(root, (100, 1024), 24 * MIB, moto.options("bench"))
        finally:
            moto.stop()
        say("  ", json.dumps({k: round(v, 3) for k, v in remote.items()}))
    emit(
        {
            "benchmark": "catchup_read",
            "value": small["reader_mb_s"],
            "unit": "MB/s of stored object bytes",
            "baseline": small["raw_mb_s"],
            "ratio": ratio(small["reader_mb_s"], small["raw_mb_s"]),
            "ratio_meaning": "reader throughput / raw opendal ranged reads of the same bytes",
            "goal": ">= 0.5",
            "small_payloads": small,
            "payload_16k": large,
            "ratio_16k": large["ratio"],
            "lz4": fast,
            "ratio_lz4": fast["ratio"],
            "s3_moto": remote,
            "ratio_s3_moto": remote["ratio"],
            "load": note,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
