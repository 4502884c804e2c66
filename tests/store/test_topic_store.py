"""TopicStore on files: what must survive closing and reopening the store.

The mode-independent contract is in ``test_contract.py``; the crash and write-failure tests
are in ``tests/wal/test_crash.py``.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from danube_ingest.errors import OffsetOutOfRangeError, WalCorruptionError
from danube_ingest.objects.uploader import build_segment_object
from danube_ingest.store import TopicStore
from danube_ingest.wal import Entry
from danube_ingest.wal import log as wal_log
from danube_ingest.wal.block import served_block
from danube_ingest.wal.meta import SNAPSHOT_NAME
from danube_ingest.wal.stored import StoredEntries

from .conftest import (
    KiB,
    SteppedClock,
    StoreFactory,
    append_all,
    assert_sequence,
    info_of,
    read_until,
    within,
)

OPTIONS = {"regions": 2, "segment_bytes": 8 * KiB, "cache_topic_max_bytes": 4 * KiB}


async def read_topic(store: TopicStore, topic: str) -> list[Entry]:
    info = store.info(topic)
    assert info is not None
    return await read_until(store.create_reader(topic, info.first_offset), info.high_watermark)


def snapshot(store: TopicStore) -> dict[str, tuple[int, int, int]]:
    out = {}
    for topic in store.topics():
        info = store.info(topic)
        assert info is not None
        out[topic] = (info.first_offset, info.high_watermark, info.last_ingest_ms)
    return out


async def test_reopen_continues_offsets_and_reads_back_identically(
    file_stores: StoreFactory,
) -> None:
    rng = random.Random(3)
    store = await file_stores.open(**OPTIONS)
    topics = [f"topic-{i}" for i in range(6)]
    for i in range(600):
        topic = rng.choice(topics)
        entry = Entry(
            rng.randbytes(rng.randint(0, 700)),
            producer_name=f"p{i % 4}",
            routing_key=f"k{i}" if i % 3 else None,
            attributes={"i": str(i)} if i % 5 == 0 else None,
            schema_id=i if i % 7 == 0 else None,
            publish_ms=i,
        )
        if i % 10 == 0:
            more = [
                Entry(rng.randbytes(50), producer_name="batch") for _ in range(rng.randint(1, 9))
            ]
            await store.append_batch(topic, [entry, *more])
        else:
            await store.append(topic, entry)
    await store.advance_time("topic-0")
    await store.advance_time("only-time")  # registered, never written
    assert {info_of(store, t).region for t in topics} == {"r0", "r1"}
    before = snapshot(store)
    contents = {t: await read_topic(store, t) for t in topics}
    await store.close()

    for remove_snapshot in (False, True):
        if remove_snapshot:  # recovery rebuilds the same state from the segment files alone
            for region_dir in (file_stores.wal_dir or Path()).iterdir():
                (region_dir / SNAPSHOT_NAME).unlink()
        store = await file_stores.open(**OPTIONS)
        assert all(not region.recovered.truncated for region in store.regions)
        assert snapshot(store) == before
        for topic in topics:
            assert await read_topic(store, topic) == contents[topic]
        await store.close()

    store = await file_stores.open(**OPTIONS)
    for topic in topics:
        last = before[topic]
        entry = Entry(b"after reopen")
        assert await store.append(topic, entry) == last[1]
        assert entry.ingest_ms >= last[2]
    assert await store.append("only-time", Entry(b"first")) == 0


async def test_retention_survives_reopen(file_stores: StoreFactory) -> None:
    store = await file_stores.open(segment_bytes=2 * KiB)
    payloads = [b"%05d" % i * 30 for i in range(200)]
    await append_all(store, "t", payloads)
    region = store.regions[0]
    while info_of(store, "t").first_offset < 50:
        await region.delete_segment(min(region.sealed))
    first = info_of(store, "t").first_offset
    await store.close()

    store = await file_stores.open(segment_bytes=2 * KiB)
    assert info_of(store, "t").first_offset == first
    with pytest.raises(OffsetOutOfRangeError):
        await store.create_reader("t", first - 1).next_batch()
    assert_sequence(await read_topic(store, "t"), first, payloads[first:])
    assert await store.append("t", Entry(b"next")) == 200


@pytest.mark.parametrize("seal_before_close", [False, True])
async def test_offset_jump_survives_reopen(
    file_stores: StoreFactory, seal_before_close: bool
) -> None:
    store = await file_stores.open()
    await append_all(store, "t", [b"a", b"b", b"c"])
    info = await store.ensure_topic("t", min_next_offset=100)
    assert (info.first_offset, info.high_watermark) == (0, 100)
    if seal_before_close:
        store.regions[0].rotate()
        await store.advance_time("other")  # lands in the new segment, after the seal
    await store.close()

    store = await file_stores.open()
    info = info_of(store, "t")
    assert (info.first_offset, info.high_watermark) == (0, 100)
    assert await store.append("t", Entry(b"d")) == 100
    got = await read_until(store.create_reader("t", 0), 101)
    assert [(e.offset, e.payload) for e in got] == [(0, b"a"), (1, b"b"), (2, b"c"), (100, b"d")]


async def test_ingest_time_never_decreases_across_reopen(
    file_stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock(1_800_000_000_000)
    monkeypatch.setattr(wal_log, "time", clock)
    start = clock.ms
    store = await file_stores.open()
    await store.append("t", Entry(b"x"))
    clock.ms = start + 500
    await store.advance_time("t")  # only a TIME marker carries start + 500
    await store.close()

    clock.ms = start - 60_000  # the machine restarts with its clock a minute behind
    store = await file_stores.open()
    assert info_of(store, "t").last_ingest_ms == start + 500
    entry = Entry(b"y")
    await store.append("t", entry)
    assert entry.ingest_ms == start + 500


@pytest.mark.parametrize("payload_bytes", [700 * KiB, 3 * 1024 * KiB])
async def test_segment_deleted_under_a_reading_reader(
    file_stores: StoreFactory, payload_bytes: int
) -> None:
    """Regression: the cleaner deleting a segment while a reader's threaded read of it was in
    flight closed the file descriptor under the read (EBADF, or another file's bytes once the
    number was reused), and a frame read in two steps looked like corruption."""
    store = await file_stores.open(
        segment_bytes=1024 * KiB, cache_max_bytes=1024 * KiB, cache_topic_max_bytes=512 * KiB
    )
    payloads = [bytes([i]) * payload_bytes for i in range(8)]
    await append_all(store, "t", payloads)
    region = store.regions[0]

    # One worker thread, held busy: the readers' reads run only after the deletion.
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    gate = threading.Event()
    busy = loop.run_in_executor(None, gate.wait)
    readers = [store.create_reader("t", offset, max_batch=1) for offset in range(4)]
    reading = [asyncio.create_task(reader.next_batch()) for reader in readers]
    await asyncio.sleep(0.01)
    while info_of(store, "t").first_offset < 4:
        await region.delete_segment(min(region.sealed))
    first = info_of(store, "t").first_offset
    gate.set()
    await busy

    results = await within(asyncio.gather(*reading, return_exceptions=True))
    for offset, (reader, got) in enumerate(zip(readers, results, strict=True)):
        if isinstance(got, BaseException):  # the read noticed the deletion
            assert isinstance(got, OffsetOutOfRangeError), repr(got)
        else:  # or completed with the bytes it had started on
            assert_sequence(got, offset, payloads[offset : offset + 1])
        if reader.position < first:
            with pytest.raises(OffsetOutOfRangeError):
                await reader.next_batch()
    assert_sequence(await read_topic(store, "t"), first, payloads[first:])


async def test_corruption_found_by_a_reader_names_the_segment_file(
    file_stores: StoreFactory,
) -> None:
    """The error named ``wal/r0/segment 0``, a file that does not exist."""
    store = await file_stores.open(
        segment_bytes=8 * KiB, cache_max_bytes=KiB, cache_topic_max_bytes=KiB
    )
    await append_all(store, "t", [bytes([i]) * KiB for i in range(24)])
    region = store.regions[0]
    seq = min(region.sealed)
    assert region.region_dir is not None
    path = region.region_dir / f"{seq:020d}.wal"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    reader = store.create_reader("t", 0, max_batch=1)
    with pytest.raises(WalCorruptionError) as caught:
        for _ in range(24):
            await within(reader.next_batch())
    assert caught.value.path == str(path)
    assert str(path) in str(caught.value)


async def test_reader_close_wakes_a_waiting_reader() -> None:
    store = await TopicStore.open(None)
    reader = store.create_reader("/t/close", 0)
    pending = asyncio.ensure_future(reader.next_batch())
    await asyncio.sleep(0.01)
    assert not pending.done()
    reader.close()
    assert await asyncio.wait_for(pending, 1.0) == []
    await store.close()


async def test_awaiting_an_entry_of_a_batch_returns_its_offset() -> None:
    store = await TopicStore.open(None)
    entries = [Entry(b"a"), Entry(b"b")]
    offsets = await store.append_batch("/t/batch", entries)
    assert list(offsets) == [0, 1]
    assert [await entry for entry in entries] == [0, 1]
    await store.close()


async def test_dropped_topic_starts_clean_also_after_reopen(
    file_stores: StoreFactory, tmp_path: Path
) -> None:
    """A dropped (deleted) topic created again starts at offset 0 with none of the old entries,
    also after a restart that recovers the WAL still holding the old incarnation's frames (a
    clean close, and a crash image whose recovery scans the DROP frame); the uploader's object
    of such a segment leaves the dropped frames out."""
    store = await file_stores.open(**OPTIONS)
    for i in range(50):
        await store.append("doomed", Entry(f"old-{i}".encode()))
    region = store._region("doomed")
    old_seq = region.active_seq
    region.rotate()  # the old incarnation's frames in a sealed segment without the DROP
    await store.append("other", Entry(b"kept"))
    assert await store.drop_topic("doomed")
    assert store.info("doomed") is None
    assert not await store.drop_topic("doomed")  # nothing left to drop
    for i in range(3):
        await store.append("doomed", Entry(f"new-{i}".encode()))
    assert [e.payload for e in await read_topic(store, "doomed")] == [b"new-0", b"new-1", b"new-2"]
    assert [e.offset for e in await read_topic(store, "doomed")] == [0, 1, 2]
    dropped = set(region.dropped)
    assert dropped
    data = await region.read(old_seq, 0, region.segment_sizes[old_seq])
    assert (
        "doomed"
        not in build_segment_object(data, key="k", codec="none", dropped=dropped).footer.topics
    )
    data = await region.read(region.active_seq, 0, region.segment_sizes[region.active_seq])
    built = build_segment_object(data, key="k", codec="none", dropped=dropped)
    assert built.footer.topics["doomed"].first_offset == 0
    assert built.footer.topics["doomed"].entries == 3
    assert file_stores.wal_dir is not None
    image = tmp_path / "crash-image"
    shutil.copytree(file_stores.wal_dir, image, ignore=shutil.ignore_patterns("*.tmp"))
    await store.close()

    crashed = await TopicStore.open(image, **OPTIONS)
    try:
        entries = await read_topic(crashed, "doomed")
        assert [(e.offset, e.payload) for e in entries] == [
            (0, b"new-0"),
            (1, b"new-1"),
            (2, b"new-2"),
        ]
        assert set(crashed._region("doomed").dropped) == dropped
    finally:
        await crashed.close()

    store = await file_stores.open(**OPTIONS)
    entries = await read_topic(store, "doomed")
    assert [(e.offset, e.payload) for e in entries] == [(0, b"new-0"), (1, b"new-1"), (2, b"new-2")]
    assert [e.payload for e in await read_topic(store, "other")] == [b"kept"]
    assert set(store._region("doomed").dropped) == dropped
    # Without the drop the uploader would have put the old incarnation into the object too.
    region = store._region("doomed")
    seqs = sorted(region.segment_sizes)
    for seq in seqs:
        data = await region.read(seq, 0, region.segment_sizes[seq])
        built = build_segment_object(data, key="k", codec="none", dropped=region.dropped)
        span = built.footer.topics.get("doomed")
        assert span is None or (span.first_offset, span.entries) == (0, 3)


async def test_incarnations_set_concurrently_all_survive_a_reopen(
    file_stores: StoreFactory,
) -> None:
    """Topics loaded at once (the partitions of one topic) record their incarnations
    concurrently; every one is durable and none of the writes fails."""
    store = await file_stores.open(**OPTIONS)
    names = [f"/default/p-part-{i}" for i in range(8)]
    await asyncio.gather(*(store.set_incarnation(n, 100 + i) for i, n in enumerate(names)))
    await store.close()
    store = await file_stores.open(**OPTIONS)
    assert [store.incarnation(n) for n in names] == [100 + i for i in range(8)]
    assert store.incarnation("/default/other") is None


async def test_a_stored_reader_reads_what_a_decoding_reader_reads(stores: StoreFactory) -> None:
    T = "/default/stored"
    """``stored=True`` (a frame consumer's reader): the same entries from segments and the
    cache, as stored bytes (frames taken over several reads), serving the decoded bytes."""
    rng = random.Random(5)
    store = await stores.open(**OPTIONS)
    for i in range(120):
        batch = [
            Entry(
                rng.randbytes(rng.choice([20, 20, 20, rng.randint(0, 300)])),
                producer_name="p",
                routing_key="k" if i % 2 else None,
                attributes={"i": str(i)} if i % 7 == 0 else None,
            )
            for _ in range(rng.randint(1, 30))
        ]
        await store.append_batch(T, batch)
    end = info_of(store, T).high_watermark
    decoded = {e.offset: e for e in await read_until(store.create_reader(T, 0), end)}
    for start, max_batch in ((0, 7), (5, 256), (end - 3, 2)):
        reader = store.create_reader(T, start, max_batch=max_batch, stored=True)
        seen: list[int] = []
        while reader.position < end:
            batch = await within(reader.next_batch())
            assert isinstance(batch, StoredEntries) and 0 < len(batch) <= max_batch
            want = [decoded[batch.offset_at(i)] for i in range(len(batch))]
            assert batch.block() == served_block(want)
            assert [(e.offset, e.payload, e.attributes) for e in batch] == [
                (e.offset, e.payload, e.attributes) for e in want
            ]
            seen.extend(e.offset for e in want)
        reader.close()
        assert seen == [o for o in sorted(decoded) if o >= start]
