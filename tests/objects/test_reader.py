"""CloudReader on objects with many frames per topic range (as rotated topic objects are):
several reads in flight, starts anywhere, gaps between ranges, a stale manifest."""

from __future__ import annotations

import pytest
from crc32c import crc32c

from danube_ingest.errors import ObjectFormatError, ObjectNotFoundError
from danube_ingest.metadata import BrokerSession, Keys, MemoryKV, Ownership
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import BinWriter
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.store import ObjectStore
from danube_ingest.store import WALCache
from danube_ingest.wal.block import served_block
from danube_ingest.wal.framing import Entry, messages_frame
from danube_ingest.wal.meta import TopicMeta
from danube_ingest.wal.stored import StoredEntries

T = "/default/rolled"


def entries(start: int, end: int) -> list[Entry]:
    out = []
    for offset in range(start, end):
        entry = Entry(f"e{offset}".encode().ljust(200, b"-"), producer_name="p")
        entry.offset = offset
        entry.ingest_ms = 1_000 + offset
        out.append(entry)
    return out


class Setup:
    def __init__(self) -> None:
        self.kv = MemoryKV()
        self.keys = Keys("/r")
        self.objects = ObjectStore.memory()
        self.manifest = Manifest(self.kv, self.keys)

    async def start(self) -> None:
        self.session = BrokerSession(self.kv, self.keys, "b", "http://b", ttl=30)
        await self.session.start()
        self.ownership = Ownership(self.kv, self.keys, self.session)
        await self.ownership.acquire(T)

    async def put_object(self, name: str, start: int, end: int, codec: str = "zstd") -> ObjectRange:
        """Store a topic object with small frames holding offsets [start, end)."""
        writer = BinWriter(codec, frame_target_bytes=2048)
        writer.add_entries(T, entries(start, end))
        data = writer.finish()
        key = f"topics/default/rolled/{name}.bin"
        await self.objects.put(key, data)
        span = writer.footer.topics[T]
        assert len(span.frames) > 10
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
            kind="topic",
        )

    async def add_object(self, name: str, start: int, end: int) -> None:
        """``put_object``, and its range committed to the manifest."""
        rng = await self.put_object(name, start, end)
        result = await self.manifest.commit(self.ownership, [rng])
        assert result.committed

    async def close(self) -> None:
        await self.ownership.close()
        await self.session.close()


@pytest.fixture
async def setup() -> Setup:
    s = Setup()
    await s.start()
    await s.add_object("a", 0, 500)
    await s.add_object("b", 500, 900)
    await s.add_object("c", 1000, 1200)  # offsets 900..999 never existed
    return s


async def read_all(cloud: CloudReader, start: int, max_batch: int) -> list[int]:
    cursor = cloud.cursor(T)
    got: list[int] = []
    nxt = start
    while True:
        batch, reached = await cursor.read(nxt, max_batch)
        if not batch and reached == nxt:
            break
        got.extend(e.offset for e in batch)
        assert [e.payload[: len(f"e{e.offset}")] for e in batch] == [
            f"e{e.offset}".encode() for e in batch
        ]
        nxt = reached
    cursor.close()
    return got


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
async def test_every_offset_once_in_order_whatever_the_reads_in_flight(
    setup: Setup, prefetch: int
) -> None:
    cloud = CloudReader(setup.manifest, setup.objects, read_bytes=3000, prefetch=prefetch)
    expected = [*range(0, 900), *range(1000, 1200)]
    assert await read_all(cloud, 0, 64) == expected
    for start in (1, 333, 499, 500, 899, 900, 950, 1000, 1199):
        assert await read_all(cloud, start, 7) == [o for o in expected if o >= start]
    assert await read_all(cloud, 1200, 10) == []
    await setup.close()


async def test_a_replaced_object_is_found_again_through_the_manifest(setup: Setup) -> None:
    cloud = CloudReader(setup.manifest, setup.objects, read_bytes=3000)
    cursor = cloud.cursor(T)
    batch, _ = await cursor.read(0, 10)
    assert [e.offset for e in batch] == list(range(10))
    # A rotation replaced object "a" by "a2" (same offsets) and deleted "a".
    old = await setup.manifest.ranges(T, 0)
    new = await setup.put_object("a2", 0, 500, codec="lz4")
    assert await setup.manifest.replace(None, [old[0]], [new])
    await setup.objects.delete(old[0].object_key)
    cloud.forget(old[0].object_key)
    got = [e.offset for e in batch]
    nxt = 10
    while nxt < 500:
        batch, nxt = await cursor.read(nxt, 50)
        got.extend(e.offset for e in batch)
    assert got == list(range(500))
    cursor.close()
    # Gone without a replacement: a clear error, not a silent skip.
    await setup.objects.delete("topics/default/rolled/b.bin")
    cloud.forget("topics/default/rolled/b.bin")
    cursor = cloud.cursor(T)
    with pytest.raises(ObjectNotFoundError):
        await cursor.read(600, 10)
    cursor.close()
    await setup.close()


async def read_both(cloud: CloudReader, start: int, max_batch: int) -> int:
    """Read from ``start`` to the end with a stored cursor and a decoding one; check that each
    stored read serves exactly the bytes its decoded entries serve; return how many reads."""
    decoding = cloud.cursor(T)
    decoded: dict[int, Entry] = {}
    nxt = start
    while True:
        twin, reached = await decoding.read(nxt, max_batch)
        if not twin and reached == nxt:
            break
        decoded.update((e.offset, e) for e in twin)
        nxt = reached
    decoding.close()
    stored = cloud.cursor(T, stored=True)
    reads = 0
    seen: list[int] = []
    nxt = start
    while True:
        batch, reached = await stored.read(nxt, max_batch)
        if not batch:
            if reached == nxt:
                break
            nxt = reached
            continue
        assert isinstance(batch, StoredEntries) and len(batch) <= max_batch
        offsets = [batch.offset_at(i) for i in range(len(batch))]
        want = [decoded[o] for o in offsets]
        assert batch.block() == served_block(want)  # byte for byte what decoded entries serve
        assert [e.payload for e in batch] == [e.payload for e in want]
        seen.extend(offsets)
        reads += 1
        nxt = reached
    stored.close()
    assert seen == sorted(decoded)
    return reads


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none"])
async def test_stored_reads_of_objects_serve_what_decoded_reads_serve(codec: str) -> None:
    s = Setup()
    await s.start()
    for name, (start, end) in {"a": (0, 500), "b": (500, 900), "c": (1000, 1200)}.items():
        rng = await s.put_object(name, start, end, codec=codec)
        assert (await s.manifest.commit(s.ownership, [rng])).committed
    cloud = CloudReader(s.manifest, s.objects, read_bytes=3000, prefetch=1)
    for start, max_batch in ((0, 64), (333, 7), (950, 1000)):
        assert await read_both(cloud, start, max_batch)
    await s.close()


async def test_objects_serve_the_bytes_the_cache_serves(setup: Setup) -> None:
    """The same messages served from an object and from the cache: the same bytes."""
    cloud = CloudReader(setup.manifest, setup.objects, read_bytes=3000)
    cursor = cloud.cursor(T, stored=True)
    batch, _ = await cursor.read(0, 500)
    got = [batch]
    while sum(map(len, got)) < 500:
        more, _ = await cursor.read(got[-1].last_offset + 1, 500)  # type: ignore[attr-defined]
        got.append(more)
    cursor.close()
    served = StoredEntries.join(got).block()  # type: ignore[arg-type]
    cache = WALCache(1 << 30, 1 << 30, hot_max_bytes=0)
    topic = TopicMeta(T, 1)
    written = entries(0, 500)
    cache.extend(topic, written, 1, messages_frame(1, 0, written)[1:])
    assert served == cache.read(topic, 0, 500, stored=True).block()  # type: ignore[attr-defined]
    await setup.close()


@pytest.mark.parametrize("stored", [True, False])
async def test_a_corrupt_object_frame_is_reported_not_skipped(setup: Setup, stored: bool) -> None:
    key = "topics/default/rolled/a.bin"
    data = bytearray(await setup.objects.get(key))
    footer = (await CloudReader(setup.manifest, setup.objects).footer(key, len(data))).topics[T]
    frame = footer.frames[3]
    data[frame.position + frame.length // 2] ^= 0x40
    await setup.objects.put(key, bytes(data))
    cloud = CloudReader(setup.manifest, setup.objects, read_bytes=3000, prefetch=0)
    cursor = cloud.cursor(T, stored=stored)
    got: list[int] = []
    with pytest.raises(ObjectFormatError, match=f"{key}.*CRC mismatch"):
        nxt = 0
        while True:
            batch, nxt = await cursor.read(nxt, 50)
            got.extend(
                batch.offset_at(i) if isinstance(batch, StoredEntries) else batch[i].offset
                for i in range(len(batch))
            )
    assert got == list(range(len(got))) and len(got) <= frame.first_offset
    cursor.close()
    await setup.close()


async def object_of(setup: Setup, offset: int) -> tuple[str, int]:
    rng = (await setup.manifest.ranges(T, offset))[0]
    return rng.object_key, rng.object_size


async def test_a_stored_cursor_keeps_one_read_decompressed(setup: Setup) -> None:
    """Each object frame is decompressed once and kept for the cursor's following reads; the
    cursor holds one read's decompressed bytes (about ``read_bytes``, however well the frames
    compress: these ~14x), let go when it moves on or closes."""
    cloud = CloudReader(setup.manifest, setup.objects, read_bytes=3000, prefetch=0)
    cursor = cloud.cursor(T, stored=True)
    whole = sum(len(e.payload) + 60 for e in entries(0, 500))
    held = []
    decompressed = set()
    nxt = 0
    while nxt < 500:
        batch, nxt = await cursor.read(nxt, 5)
        held.append(cursor.held_bytes)
        current = cursor._entries
        assert isinstance(current, StoredEntries)
        decompressed.add(id(current))
        assert batch[0].payload.startswith(b"e")  # (built on demand, from those bytes)
    assert 0 < max(held) <= 3000 + 4096 < whole
    frames = (await cloud.footer(*await object_of(setup, 0))).topics[T].frames
    assert len(decompressed) <= len(frames) < len(held), "a frame decompressed once, read often"
    cursor.close()
    assert cursor.held_bytes == 0
    await setup.close()
