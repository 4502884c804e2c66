"""CloudReader on objects with many frames per topic range (as rotated topic objects are):
several reads in flight, starts anywhere, gaps between ranges, a stale manifest."""

from __future__ import annotations

import pytest
from crc32c import crc32c

from danube_ingest.errors import ObjectNotFoundError
from danube_ingest.metadata import BrokerSession, Keys, MemoryKV, Ownership
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import BinWriter
from danube_ingest.objects.reader import CloudReader
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry

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
