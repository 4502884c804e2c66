"""``collect_orphans`` and ``manifest_integrity`` on the real etcd, over memory, fs and s3."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from crc32c import crc32c

from danube_ingest.cli import main
from danube_ingest.metadata import BrokerSession, EtcdKV, Keys, Ownership
from danube_ingest.metadata.jumps import record_jump
from danube_ingest.metadata.manifest import Manifest, ObjectRange, retire_ops, retired_objects
from danube_ingest.objects.binfmt import BinWriter
from danube_ingest.objects.orphans import collect_orphans, manifest_integrity
from danube_ingest.objects.store import ObjectInfo, ObjectStore

from .test_reader import T, entries

pytestmark = pytest.mark.etcd

HOUR_MS = 3_600_000


@dataclass
class Topic:
    """One broker owning ``T``, writing objects and committing their ranges."""

    kv: EtcdKV
    keys: Keys
    objects: ObjectStore

    async def start(self) -> Topic:
        self.manifest = Manifest(self.kv, self.keys)
        self.session = BrokerSession(self.kv, self.keys, "b", "http://b", ttl=30)
        await self.session.start()
        self.ownership = Ownership(self.kv, self.keys, self.session)
        await self.ownership.acquire(T)
        return self

    async def put(self, key: str, start: int, end: int) -> ObjectRange:
        """Store an object holding offsets [start, end) of ``T``; nothing committed."""
        writer = BinWriter("zstd", frame_target_bytes=2048)
        writer.add_entries(T, entries(start, end))
        data = writer.finish()
        await self.objects.put(key, data)
        span = writer.footer.topics[T]
        return ObjectRange(
            topic=T,
            object_key=key,
            start_offset=start,
            end_offset=end,
            entries=end - start,
            byte_start=span.position,
            byte_length=span.length,
            object_size=len(data),
            object_crc=crc32c(data),
            first_ingest_ms=span.first_ingest_ms,
            last_ingest_ms=span.last_ingest_ms,
            kind="segment",
        )

    async def commit(self, rng: ObjectRange) -> None:
        assert (await self.manifest.commit(self.ownership, [rng])).committed

    async def close(self) -> None:
        await self.ownership.close()
        await self.session.close()


@pytest.fixture
async def topic(etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore) -> AsyncIterator[Topic]:
    t = await Topic(etcd_kv, keys, object_store).start()
    yield t
    await t.close()


async def test_old_orphans_go_referenced_and_young_ones_stay(topic: Topic) -> None:
    store = topic.objects
    await topic.commit(await topic.put("segments/b/r0/00000000000000000001.bin", 0, 100))
    await topic.put("segments/b/r0/00000000000000000002.bin", 100, 200)  # PUT, never committed
    await topic.put("topics/default/rolled/x.bin", 0, 50)  # a rotation that never swapped
    await store.put("_staging/dead-upload.bin", b"partial")
    await store.put("warehouse/default/rolled/part.parquet", b"not ours")
    now = int(time.time() * 1000)

    young = await collect_orphans(topic.kv, topic.keys, store, now_ms=now)
    assert young.deleted == [] and young.kept == 1 and young.referenced == 1
    assert young.candidates == 4

    later = await collect_orphans(topic.kv, topic.keys, store, now_ms=now + 2 * HOUR_MS)
    orphans = [
        "_staging/dead-upload.bin",
        "segments/b/r0/00000000000000000002.bin",
        "topics/default/rolled/x.bin",
    ]
    remaining = await store.list("")
    if store.scheme == "memory":  # no modification times: never deleted, reported
        assert sorted(young.no_time) == sorted(later.no_time) == orphans
        assert later.deleted == [] and len(remaining) == 5
        return
    assert young.too_young == 3 and young.too_young_bytes > 0
    assert sorted(later.deleted) == orphans and later.deleted_bytes > 0
    assert remaining == [
        "segments/b/r0/00000000000000000001.bin",
        "warehouse/default/rolled/part.parquet",
    ]
    again = await collect_orphans(topic.kv, topic.keys, store, now_ms=now + 2 * HOUR_MS)
    assert again.deleted == [] and again.kept == 1


async def test_dry_run_deletes_nothing(topic: Topic, tmp_path: Path) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "dry")})
    key = "segments/b/r0/00000000000000000009.bin"
    await store.put(key, b"orphan")
    later = int(time.time() * 1000) + 2 * HOUR_MS
    report = await collect_orphans(topic.kv, topic.keys, store, now_ms=later, dry_run=True)
    assert report.deleted == [key] and report.deleted_bytes == 6
    assert await store.list("") == [key]


class CommitWhileCollecting(ObjectStore):
    """An fs store on which the manifest commit of ``rng`` lands while the collector looks at
    the object (after it listed the objects and read the manifest, before it deletes)."""

    topic: Topic
    rng: ObjectRange

    async def stat(self, key: str) -> ObjectInfo | None:
        info = await super().stat(key)
        if key == self.rng.object_key:
            await self.topic.commit(self.rng)
        return info


async def test_a_commit_landing_before_the_delete_keeps_its_object(
    topic: Topic, tmp_path: Path
) -> None:
    store = CommitWhileCollecting("fs", options={"root": str(tmp_path / "race")})
    topic.objects = store
    rng = await topic.put("segments/b/r0/00000000000000000003.bin", 0, 10)
    store.topic, store.rng = topic, rng
    await topic.put("segments/b/r0/00000000000000000004.bin", 10, 20)
    later = int(time.time() * 1000) + 2 * HOUR_MS
    report = await collect_orphans(topic.kv, topic.keys, store, now_ms=later)
    assert report.rescued == 1
    assert report.deleted == ["segments/b/r0/00000000000000000004.bin"]
    assert await store.list("") == [rng.object_key]
    assert (await topic.manifest.ranges(T))[0].object_key == rng.object_key


async def test_a_replaced_object_waits_for_its_retirement_grace_then_goes(topic: Topic) -> None:
    """Rotation-style swap: the old object is retired in the swap's transaction and kept
    for the grace period from then, however old the object itself is (a reader that opened
    it just before the swap finishes); then deleted, its record with it."""
    store = topic.objects
    await topic.commit(await topic.put("segments/b/r0/00000000000000000005.bin", 0, 100))
    [old] = await topic.manifest.ranges(T)  # as stored: stamped with the broker and epoch
    rolled = await topic.put("topics/default/rolled/r.bin", 0, 100)
    rolled = ObjectRange(**{**_fields(rolled), "kind": "topic"})
    swap_ms = int(time.time() * 1000) + 5 * HOUR_MS  # the object is hours old by then
    assert await topic.manifest.replace(None, [old], [rolled], now_ms=swap_ms)
    assert list(await retired_objects(topic.kv, topic.keys)) == [old.object_key]

    soon = await collect_orphans(topic.kv, topic.keys, store, now_ms=swap_ms + 60_000)
    assert soon.deleted == [] and soon.retired_recently == 1 and soon.kept == 1
    assert old.object_key in await store.list("segments/")

    later = await collect_orphans(topic.kv, topic.keys, store, now_ms=swap_ms + 2 * HOUR_MS)
    # Also on memory, which gives no modification time: the retirement record dates it.
    assert later.deleted == [old.object_key] and later.records_dropped == 1
    assert await store.list("segments/") == []
    assert await retired_objects(topic.kv, topic.keys) == {}
    assert [r.object_key for r in await topic.manifest.ranges(T)] == [rolled.object_key]


async def test_a_retirement_record_of_a_vanished_object_is_dropped(topic: Topic) -> None:
    await topic.kv.txn([], retire_ops(topic.keys, ["segments/b/r0/gone.bin"], now_ms=0))
    report = await collect_orphans(topic.kv, topic.keys, topic.objects)
    assert report.records_dropped == 1 and report.deleted == []
    assert await retired_objects(topic.kv, topic.keys) == {}


def _fields(rng: ObjectRange) -> dict[str, object]:
    return {f: getattr(rng, f) for f in rng.__slots__}


async def test_integrity_passes_with_recorded_jumps_and_fails_on_damaged_objects(
    topic: Topic,
) -> None:
    store = topic.objects
    names = ("intact", "missing", "truncated", "flipped")
    for i, name in enumerate(names):
        # 100 offsets each, 10 jumped over between ranges (a new owner's reservation)
        await topic.commit(
            await topic.put(f"topics/default/rolled/{name}.bin", i * 110, i * 110 + 100)
        )
    report = await manifest_integrity(topic.kv, topic.keys, store, deep=True)
    assert not report.ok and report.gaps == report.unexplained_gaps == 3
    assert report.object_problems == [] and len(report.range_problems) == 3
    assert "offsets 100..109" in report.range_problems[0]
    for i in range(1, len(names)):
        await record_jump(topic.ownership, T, i * 110 - 10, i * 110)
    report = await manifest_integrity(topic.kv, topic.keys, store, deep=True)
    assert report.ok and report.gaps == 3 and report.unexplained_gaps == 0
    assert report.jumps == 3 and [t.topic for t in report.topics] == [T]

    await store.delete("topics/default/rolled/missing.bin")
    data = await store.get("topics/default/rolled/truncated.bin")
    await store.put("topics/default/rolled/truncated.bin", data[:-1])
    flipped = bytearray(await store.get("topics/default/rolled/flipped.bin"))
    flipped[100] ^= 0x01
    await store.put("topics/default/rolled/flipped.bin", bytes(flipped))

    report = await manifest_integrity(topic.kv, topic.keys, store)
    assert not report.ok and report.range_problems == []
    missing, truncated, crc = report.object_problems
    assert "missing.bin" in missing and "not found" in missing
    assert "truncated.bin" in truncated and "bytes, the manifest says" in truncated
    assert "flipped.bin" in crc and "CRC32C" in crc


def test_cli_gc_deletes_old_orphans(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = tmp_path / "objects" / "segments" / "b" / "r0" / "00000000000000000001.bin"
    young = orphan.with_name("00000000000000000002.bin")
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"old")
    young.write_bytes(b"new")
    two_hours_ago = time.time() - 7200
    os.utime(orphan, (two_hours_ago, two_hours_ago))
    args = ["objects", "gc", "--data-dir", str(tmp_path), "--etcd", etcd_server]
    args += ["--prefix", keys.prefix]
    assert main([*args, "--dry-run"]) == 0
    assert "would delete segments/b/r0/00000000000000000001.bin" in capsys.readouterr().out
    assert orphan.exists()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "deleted 1 (3 bytes); 1 younger than 3600 s" in out
    assert not orphan.exists() and young.exists()


def test_cli_verify_exits_1_on_a_gap_no_recorded_jump_covers(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def setup(jump: bool) -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
        topic = await Topic(kv, keys, store).start()
        if jump:
            await record_jump(topic.ownership, T, 100, 300)
        else:
            await topic.commit(await topic.put("segments/b/r0/00000000000000000001.bin", 0, 100))
            await topic.commit(await topic.put("segments/b/r0/00000000000000000002.bin", 300, 400))
        await topic.close()
        await store.close()
        await kv.close()

    asyncio.run(setup(jump=False))
    args = ["objects", "verify", "--data-dir", str(tmp_path), "--etcd", etcd_server]
    args += ["--prefix", keys.prefix, "--topic", T]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and "offsets 100..299" in out and "no recorded offset jump" in out
    asyncio.run(setup(jump=True))
    assert main(args) == 0
    assert (
        "no offsets 100..299 (skipped by a new owner: a recorded jump)" in capsys.readouterr().out
    )
