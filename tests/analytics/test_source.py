"""Planning and reading a topic's objects without Spark: real objects written by the real
uploader from real WAL segments (manifest on the real etcd), and hand-built objects with many
small frames for the byte-level checks: only the needed frames are fetched, bounds by offset
and ingest time, bounded batches, corrupt and missing objects."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from pathlib import Path

import pytest

from danube_ingest.analytics import aread_part, plan_reads, read_part
from danube_ingest.analytics.source import ReadPart
from danube_ingest.errors import ObjectFormatError, ObjectNotFoundError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import BinWriter, parse_object
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry
from tests.objects.support import ColdStack

T = "/default/source"


async def read_all(store: ObjectStore, parts: list[ReadPart], **kw: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for part in parts:
        async for batch in aread_part(store, part, **kw):
            rows.extend(batch.to_pylist())
    return rows


@pytest.fixture
async def produced(etcd_kv: EtcdKV, keys: Keys, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Three uploaded segments of T (and another topic sharing them) from a real WAL."""
    objects = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    stack = await ColdStack(etcd_kv, keys, objects, tmp_path / "wal").open()
    await stack.acquire(T, "/default/other")
    stack.uploader.start()
    sent: list[Entry] = []
    for round_ in range(3):
        batch = []
        for i in range(40):
            n = round_ * 40 + i
            e = Entry(
                f"m{n}".encode() * 5,
                producer_name=f"p{round_}",
                routing_key=None if n % 3 else f"k{n}",
                attributes={"n": str(n)} if n % 2 else None,
                publish_ms=1_700_000_000_000 + n,
            )
            batch.append(e)
        await asyncio.gather(*(stack.store.append(T, e) for e in batch))
        await stack.append("/default/other", [b"other"] * 5)
        sent.extend(batch)
        await stack.seal_and_upload()
        await asyncio.sleep(0.01)  # distinct ingest times between segments
    ranges = await Manifest(etcd_kv, keys).ranges(T)
    yield objects, ranges, sent
    await stack.close()


async def test_reads_every_produced_message_once(produced) -> None:  # type: ignore[no-untyped-def]
    objects, ranges, sent = produced
    assert len(ranges) == 3
    parts = plan_reads(ranges)
    assert [(p.object_key, p.start_offset, p.end_offset) for p in parts] == [
        (r.object_key, r.start_offset, r.end_offset) for r in ranges
    ]
    assert pickle.loads(pickle.dumps(parts)) == parts
    rows = await read_all(objects, parts, max_rows=16)
    assert [r["offset"] for r in rows] == [e.offset for e in sent] == list(range(120))
    for row, e in zip(rows, sent, strict=True):
        assert row["payload"] == e.payload
        assert row["producer"] == e.producer_name
        assert row["routing_key"] == e.routing_key
        assert dict(row["attributes"]) == (e.attributes or {})  # type: ignore[call-overload]
        assert int(row["ingest_time"].timestamp() * 1000) == e.ingest_ms  # type: ignore[attr-defined]
        assert int(row["publish_time"].timestamp() * 1000) == e.publish_ms  # type: ignore[attr-defined]
    # The synchronous reader (Spark tasks) yields the same rows, batches of at most max_rows.
    batches = await asyncio.to_thread(lambda: list(read_part(objects, parts[1], max_rows=16)))
    assert [b.num_rows for b in batches] == [16, 16, 8]
    assert [r for b in batches for r in b.to_pylist()] == rows[40:80]


async def test_offset_and_ingest_time_bounds(produced) -> None:  # type: ignore[no-untyped-def]
    objects, ranges, sent = produced
    parts = plan_reads(ranges, start_offset=45, end_offset=85)
    assert [p.object_key for p in parts] == [r.object_key for r in ranges[1:3]]
    rows = await read_all(objects, parts)
    assert [r["offset"] for r in rows] == list(range(45, 85))
    # Ingest-time bounds: from the second segment's first time to the third's.
    start_ms, end_ms = sent[40].ingest_ms, sent[80].ingest_ms
    assert sent[39].ingest_ms < start_ms < end_ms
    parts = plan_reads(ranges, start_ms=start_ms, end_ms=end_ms)
    assert all(p.start_ms == start_ms and p.end_ms == end_ms for p in parts)
    rows = await read_all(objects, parts)
    assert [r["offset"] for r in rows] == [
        e.offset for e in sent if start_ms <= e.ingest_ms < end_ms
    ]
    assert [r["offset"] for r in rows] == list(range(40, 80))
    assert ranges[0].object_key not in {p.object_key for p in parts}
    assert plan_reads(ranges, start_offset=120) == []
    assert plan_reads(ranges, start_ms=sent[-1].ingest_ms + 1) == []


def small_frames_object(start: int, end: int) -> tuple[bytes, ObjectRange, int]:
    entries = []
    for offset in range(start, end):
        e = Entry(f"e{offset}".encode().ljust(200, b"-"), producer_name="p")
        e.offset = offset
        e.ingest_ms = 1_000 + offset
        entries.append(e)
    writer = BinWriter("none", frame_target_bytes=2048)
    writer.add_entries(T, entries)
    data = writer.finish()
    span = writer.footer.topics[T]
    rng = ObjectRange(
        topic=T,
        object_key="topics/default/source/data.bin",
        start_offset=start,
        end_offset=end,
        entries=end - start,
        byte_start=span.position,
        byte_length=span.length,
        object_size=len(data),
        object_crc=0,
        first_ingest_ms=1_000 + start,
        last_ingest_ms=1_000 + end - 1,
        kind="topic",
    )
    return data, rng, len(span.frames)


async def test_fetches_the_footer_and_only_the_needed_frames() -> None:
    data, rng, frames = small_frames_object(0, 1000)
    assert frames > 50
    store = ObjectStore.memory()
    await store.put(rng.object_key, data)
    [part] = plan_reads([rng], start_offset=500, end_offset=510)
    rows = await read_all(store, [part])
    assert [r["offset"] for r in rows] == list(range(500, 510))
    assert store.stats.gets == 2  # one ranged read of the footer, one of the frames
    assert store.stats.bytes_read < 65536 + 3 * 2048 < len(data) / 3
    # By ingest time, too.
    store.stats.gets = 0
    [part] = plan_reads([rng], start_ms=1_700, end_ms=1_705)
    assert [r["offset"] for r in await read_all(store, [part])] == list(range(700, 705))
    assert store.stats.gets == 2


async def test_corrupt_and_missing_objects_name_key_and_position() -> None:
    data, rng, _ = small_frames_object(0, 300)
    store = ObjectStore.memory()
    [part] = plan_reads([rng])
    with pytest.raises(ObjectNotFoundError) as missing:
        await read_all(store, [part])
    assert rng.object_key in str(missing.value)
    assert f"[{rng.object_size - min(rng.object_size, 65536)}, {rng.object_size})" in str(
        missing.value
    )
    # A flipped byte inside the 3rd frame: the rows before it are read, then the error.
    corrupt = bytearray(data)
    third = parse_object(data).topics[T].frames[2]
    corrupt[third.position + 30] ^= 0xFF
    await store.put(rng.object_key, bytes(corrupt))
    with pytest.raises(ObjectFormatError) as bad:
        await read_all(store, [part], read_bytes=1)  # one frame per read
    assert bad.value.key == rng.object_key and bad.value.position == third.position
    assert f"{rng.object_key} at byte {third.position}" in str(bad.value)
    # A footer that disagrees with the manifest.
    await store.put(rng.object_key, data)
    shifted = dataclasses.replace(part, byte_length=part.byte_length + 1)
    with pytest.raises(ObjectFormatError, match="the manifest says"):
        await read_all(store, [shifted])
    # Truncated object: the trailer is gone.
    await store.put(rng.object_key, data[:-7])
    with pytest.raises(ObjectFormatError, match=rng.object_key):
        await read_all(store, [part])
