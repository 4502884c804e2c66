"""Tests for danube_ingest.wal.recovery on real region directories written by the store.

A "crash image" is a copy of a region directory taken while its store is open and idle, every
append acknowledged: what the disk holds if the process is killed at that moment (the snapshot
then describes the sealed segments only, and the newest segment is scanned on recovery).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from crc32c import crc32c

from danube_ingest.errors import WalCorruptionError
from danube_ingest.store import TopicStore
from danube_ingest.wal import (
    RegionLog,
    RegionState,
    recover_region,
    recovery,
    repair_region,
    verify_region,
)
from danube_ingest.wal.framing import (
    Entry,
    FrameInfo,
    Kind,
    batch_header,
    checkpoint_frame,
    decode_topic,
    encode_frame,
    messages_frame,
    time_frame,
    topic_frame,
)
from danube_ingest.wal.meta import SNAPSHOT_MAGIC, SNAPSHOT_NAME, Snapshot
from danube_ingest.wal.segment import list_segments, scan, segment_path

OpenLog = Callable[..., Awaitable[RegionLog]]
OpenStore = Callable[..., Awaitable[TopicStore]]
Appended = dict[str, list[Entry]]


@pytest.fixture(autouse=True, params=[recovery.SCAN_WINDOW, 48, 4099], ids=lambda w: f"window{w}")
def scan_window(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Each test runs with the default scan window, with one smaller than almost every frame
    (each frame is then read whole through ``advance``'s ``need``) and with an odd size that
    cuts frames, prefixes and batch headers anywhere."""
    window: int = request.param
    monkeypatch.setattr(recovery, "SCAN_WINDOW", window)
    return window


# -- helpers ---------------------------------------------------------------------------------


def fields(entry: Entry) -> tuple[object, ...]:
    return (
        entry.offset,
        entry.ingest_ms,
        entry.publish_ms,
        entry.producer_name,
        entry.routing_key,
        entry.attributes,
        entry.schema_id,
        entry.schema_version,
        entry.producer_id,
        entry.request_id,
        bytes(entry.payload),
    )


def make_entry(topic: str, i: int) -> Entry:
    return Entry(
        f"{topic}-{i}".encode() * (1 + i % 3),
        publish_ms=1_700_000_000_000 + i,
        producer_name=f"producer-{topic}",
        routing_key=f"key-{i}" if i % 2 else None,
        attributes={"i": str(i), "tópic": topic} if i % 3 == 0 else None,
        schema_id=i if i % 4 == 0 else None,
        schema_version=i % 5,
        producer_id=7,
        request_id=i,
    )


class History:
    """Appends through a store, remembering every acknowledged entry per topic."""

    def __init__(self) -> None:
        self.appended: Appended = {}

    async def add(self, store: TopicStore, topic: str, count: int = 1) -> None:
        """Append ``count`` entries of ``topic`` in one event loop tick (so: one frame)."""
        mine = self.appended.setdefault(topic, [])
        entries = [make_entry(topic, len(mine) + i) for i in range(count)]
        offsets = await asyncio.gather(*(store.append(topic, e) for e in entries))
        assert offsets == list(range(len(mine), len(mine) + count))
        mine.extend(entries)


async def read_all(store: TopicStore, topic: str, start: int = 0) -> list[Entry]:
    """Every entry of ``topic`` from ``start`` up to its high watermark."""
    info = store.info(topic)
    assert info is not None, f"topic {topic} unknown"
    reader = store.create_reader(topic, start)
    out: list[Entry] = []
    while start + len(out) < info.high_watermark:
        batch = await asyncio.wait_for(reader.next_batch(), 5)
        assert batch, f"reader of {topic} ended at {start + len(out)} of {info.high_watermark}"
        out.extend(batch)
    reader.close()
    assert [e.offset for e in out] == list(range(start, info.high_watermark))
    return out


def written_segments(region: Path) -> list[int]:
    """Segments holding bytes: an open log also has the next one pre-created, empty."""
    return [s for s in list_segments(region) if segment_path(region, s).stat().st_size > 0]


def frames(path: Path) -> list[FrameInfo]:
    """The valid frames of a segment file, up to its first damage if any."""
    return scan(path.read_bytes()).frames


def topic_names(region: Path) -> dict[int, str]:
    names = {}
    for seq in list_segments(region):
        for frame in frames(segment_path(region, seq)):
            if frame.kind == Kind.TOPIC:
                topic_id, name = decode_topic(frame.body)
                names[topic_id] = name
    return names


def counts_before(region: Path, stop: tuple[int, int]) -> dict[str, int]:
    """Entries per topic in MESSAGES frames ending at or before (seq, byte position)."""
    names = topic_names(region)
    counts: dict[str, int] = dict.fromkeys(names.values(), 0)
    for seq in list_segments(region):
        for frame in frames(segment_path(region, seq)):
            if (seq, frame.end) > stop:
                break
            if frame.kind == Kind.MESSAGES:
                header = batch_header(frame.body)
                counts[names[header.topic_id]] += header.num_entries
    return counts


def files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def flip(path: Path, position: int, mask: int = 0x20) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= mask
    path.write_bytes(bytes(data))


def summary(state: RegionState) -> dict[str, object]:
    """What recovery must agree on whether or not it used the snapshot."""
    return {
        "topics": {
            t.name: (
                t.topic_id,
                t.first_offset,
                t.next_offset,
                t.hwm,
                # The index too: where each span's frames sit in its segment file.
                [(s.seq, s.first_offset, s.last_offset, s.index) for s in t.spans],
            )
            for t in state.topics.values()
        },
        "next_topic_id": state.next_topic_id,
        "segments": state.segments,
        "next_seq": state.next_seq,
    }


async def check_store(wal: Path, open_store: OpenStore, expected: Appended) -> None:
    """The store under ``wal`` holds exactly ``expected``; appends continue after it."""
    store = await open_store(wal, cache_topic_max_bytes=1)  # reads come from the segments
    for topic, entries in expected.items():
        if not entries and store.info(topic) is None:
            continue
        assert [fields(e) for e in await read_all(store, topic)] == [fields(e) for e in entries]
        assert await store.append(topic, Entry(b"after")) == len(entries)
    await store.close()


@dataclass
class CrashImage:
    region: Path
    """The copied region directory (``<wal>/r0``); its newest segment was active."""
    appended: Appended
    newest: int


async def crash_image(tmp_path: Path, open_store: OpenStore) -> CrashImage:
    """Two runs: the first closed cleanly, the second copied while open (see module docs)."""
    wal = tmp_path / "live"
    history = History()
    store = await open_store(wal)
    for _ in range(5):
        await history.add(store, "alpha")
    await history.add(store, "beta", 3)
    await store.close()

    store = await open_store(wal)
    await history.add(store, "alpha", 2)
    await history.add(store, "gamma")
    await history.add(store, "beta")
    await store.advance_time("beta")
    await history.add(store, "alpha", 3)
    await history.add(store, "gamma", 2)
    image = tmp_path / "image"
    shutil.copytree(wal, image, ignore=shutil.ignore_patterns("*.tmp"))
    await store.close()
    region = image / "r0"
    assert written_segments(region) == [0, 1]
    # The open log pre-creates its next segment (empty, and maybe not yet when copied); these
    # images are about the written tail, so it is dropped here. A spare beside a torn tail is
    # covered by test_torn_tail_beside_a_precreated_segment.
    for seq in list_segments(region):
        if seq > 1:
            assert segment_path(region, seq).stat().st_size == 0
            segment_path(region, seq).unlink()
    # As after a kill: the snapshot covers the sealed segment, the active one gets scanned.
    assert Snapshot.from_bytes((region / SNAPSHOT_NAME).read_bytes()).next_seq == 1
    return CrashImage(region, history.appended, 1)


# -- (a) torn tails --------------------------------------------------------------------------


async def test_torn_tail_at_every_byte_of_the_newest_segment(
    tmp_path: Path, open_store: OpenStore
) -> None:
    image = await crash_image(tmp_path, open_store)
    newest = segment_path(image.region, image.newest)
    data = newest.read_bytes()
    ends = [f.end for f in frames(newest)]
    gamma_registered_at = next(
        f.end for f in frames(newest) if f.kind == Kind.TOPIC and decode_topic(f.body)[1] == "gamma"
    )
    sealed_size = segment_path(image.region, 0).stat().st_size
    work = tmp_path / "work"
    shutil.copytree(image.region, work)
    path = segment_path(work, image.newest)
    snapshot = (work / SNAPSHOT_NAME).read_bytes()

    counts = {end: counts_before(image.region, (image.newest, end)) for end in [0, *ends]}

    for cut in range(len(data)):
        valid_end = max([0, *(end for end in ends if end <= cut)])
        expected = counts[valid_end]
        for with_snapshot in (True, False):
            path.write_bytes(data[:cut])
            if with_snapshot:
                (work / SNAPSHOT_NAME).write_bytes(snapshot)
            else:
                (work / SNAPSHOT_NAME).unlink()

            state = recover_region(work)

            where = f"cut at {cut}, snapshot {with_snapshot}"
            if cut == valid_end:
                assert state.truncated == [], where
            else:
                assert state.truncated == [(str(path), valid_end, cut - valid_end)], where
            if valid_end == 0:
                assert not path.exists(), where
                assert state.segments == {0: sealed_size}, where
            else:
                assert path.stat().st_size == valid_end, where
                assert state.segments == {0: sealed_size, 1: valid_end}, where
            assert state.next_seq == 2, where
            known = {"alpha", "beta"} | ({"gamma"} if valid_end >= gamma_registered_at else set())
            got = {name: t.next_offset for name, t in state.topics.items()}
            assert got == {n: c for n, c in expected.items() if n in known}, where
            assert all(t.hwm == t.next_offset for t in state.topics.values()), where
            assert all(t.first_offset == 0 for t in state.topics.values()), where
            assert recover_region(work).truncated == [], where  # the cut is durable


async def test_store_after_torn_tail_reads_survivors_and_continues(
    tmp_path: Path, open_store: OpenStore
) -> None:
    image = await crash_image(tmp_path, open_store)
    newest = segment_path(image.region, image.newest)
    data = newest.read_bytes()
    found = frames(newest)
    positions = [f.position for f in found]
    # test_torn_tail_at_every_byte_of_the_newest_segment recovers every cut; opening a store
    # costs more, so here: every byte of the last frame, each frame boundary and its
    # neighbours, and each frame's middle.
    cuts = set(range(positions[-1], len(data)))
    cuts |= {p + d for p in positions for d in (-1, 0, 1) if 0 <= p + d < len(data)}
    cuts |= {(f.position + f.end) // 2 for f in found}

    for cut in sorted(cuts):
        wal = tmp_path / f"cut-{cut}"
        shutil.copytree(image.region.parent, wal)
        region = wal / "r0"
        segment_path(region, image.newest).write_bytes(data[:cut])
        counts = counts_before(image.region, (image.newest, cut))
        expected = {t: entries[: counts.get(t, 0)] for t, entries in image.appended.items()}

        store = await open_store(wal, cache_topic_max_bytes=1)
        assert len(store.regions[0].recovered.truncated) == (0 if cut in positions else 1)
        continued: dict[str, list[tuple[int, bytes]]] = {}
        for topic, entries in expected.items():
            info = store.info(topic)
            if info is None:
                assert not entries, f"cut at {cut}: {topic} lost"
                continue
            assert info.high_watermark == len(entries)
            got = await read_all(store, topic)
            assert [fields(e) for e in got] == [fields(e) for e in entries], f"cut at {cut}"
            assert await store.append(topic, Entry(b"new")) == len(entries)
            continued[topic] = [(e.offset, e.payload) for e in entries] + [(len(entries), b"new")]
        await store.close()

        store = await open_store(wal)
        for topic, kept in continued.items():
            assert [(e.offset, e.payload) for e in await read_all(store, topic)] == kept
        await store.close()
        shutil.rmtree(wal)


async def test_torn_frame_whose_payload_holds_a_frame_image_recovers(
    tmp_path: Path, open_store: OpenStore
) -> None:
    # Regression: recovery mistook the frame image inside the torn frame's payload for a valid
    # frame after the damage, called the torn tail corruption and refused to open.
    wal = tmp_path / "wal"
    store = await open_store(wal)
    assert await store.append("t", Entry(b"first")) == 0
    inner = topic_frame(9, "x") + b"".join(messages_frame(9, 0, [Entry(b"inner")]))
    assert await store.append("t", Entry(b"[" + inner + b"]")) == 1
    await store.close()
    region = wal / "r0"
    path = segment_path(region, 0)
    last = frames(path)[-1]
    (region / SNAPSHOT_NAME).unlink()
    path.write_bytes(path.read_bytes()[: last.end - 3])

    state = recover_region(region)

    assert state.truncated == [(str(path), last.position, last.end - 3 - last.position)]
    assert state.topics["t"].next_offset == 1


# -- (b) corruption --------------------------------------------------------------------------


async def rotated_region(tmp_path: Path, open_store: OpenStore) -> tuple[Path, Appended]:
    """A cleanly closed region of several size-rotated segments, three topics interleaved."""
    wal = tmp_path / "wal"
    history = History()
    store = await open_store(wal, segment_bytes=600, segment_seconds=3600)
    for i in range(36):
        await history.add(store, ("red", "green", "blue")[i % 3], 1 + i % 2)
    await store.close()
    region = wal / "r0"
    assert len(list_segments(region)) >= 5
    return region, history.appended


def pick_frames(path: Path) -> list[FrameInfo]:
    """The CHECKPOINT, the first TOPIC and a MESSAGES frame in the middle of a segment."""
    found = frames(path)
    middle = [f for f in found[len(found) // 2 :] if f.kind == Kind.MESSAGES]
    topic = [f for f in found if f.kind == Kind.TOPIC]
    assert found[0].kind == Kind.CHECKPOINT and middle and topic
    assert middle[0].end < len(path.read_bytes()), "need valid frames after the damage"
    return [found[0], topic[0], middle[0]]


@pytest.mark.parametrize("which", ["sealed", "newest"])
async def test_flipped_byte_is_corruption_naming_file_and_frame(
    tmp_path: Path, open_store: OpenStore, which: str
) -> None:
    region, _ = await rotated_region(tmp_path, open_store)
    # Without the snapshot every segment is scanned (with it, sealed segments are trusted: see
    # test_snapshot_trusts_sealed_segments_but_reads_and_verify_detect_damage).
    (region / SNAPSHOT_NAME).unlink()
    seqs = list_segments(region)
    seq = seqs[1] if which == "sealed" else seqs[-1]
    path = segment_path(region, seq)
    original = path.read_bytes()

    for frame in pick_frames(path):
        for position in range(frame.position, frame.end):
            flip(path, position)
            before = files(region)

            report = verify_region(region)
            assert files(region) == before
            assert not report.ok
            assert report.torn_tail is None
            assert report.corruption is not None
            assert (report.corruption.path, report.corruption.position) == (
                str(path),
                frame.position,
            ), f"flip at {position}"

            with pytest.raises(WalCorruptionError) as caught:
                recover_region(region)
            assert (caught.value.path, caught.value.position) == (str(path), frame.position)
            assert str(frame.position) in str(caught.value) and str(path) in str(caught.value)
            assert ("sealed segment" in caught.value.reason) == (which == "sealed")
            assert files(region) == before, "a refused recovery must not change anything"
            path.write_bytes(original)

    assert verify_region(region).ok
    flip(path, pick_frames(path)[2].position + 20)
    before = files(region)
    with pytest.raises(WalCorruptionError):
        await open_store(region.parent)
    assert files(region) == before, "a store that refuses to open writes nothing"


async def test_snapshot_trusts_sealed_segments_but_reads_and_verify_detect_damage(
    tmp_path: Path, open_store: OpenStore
) -> None:
    region, appended = await rotated_region(tmp_path, open_store)
    path = segment_path(region, 1)
    damaged = pick_frames(path)[2]
    topic = topic_names(region)[batch_header(damaged.body).topic_id]
    flip(path, damaged.position + 40)

    report = verify_region(region)
    assert report.corruption is not None
    assert (report.corruption.path, report.corruption.position) == (str(path), damaged.position)

    store = await open_store(region.parent, cache_topic_max_bytes=1)
    reader = store.create_reader(topic, 0, max_batch=1)
    seen = []
    with pytest.raises(WalCorruptionError):
        while True:
            seen += await asyncio.wait_for(reader.next_batch(), 5)
    assert [fields(e) for e in seen] == [fields(e) for e in appended[topic][: len(seen)]]
    assert len(seen) == batch_header(damaged.body).base_offset


# -- (c) verify and repair -------------------------------------------------------------------


async def test_verify_reports_an_intact_region_and_changes_nothing(
    tmp_path: Path, open_store: OpenStore
) -> None:
    region, appended = await rotated_region(tmp_path, open_store)
    before = files(region)

    report = verify_region(region)

    assert files(region) == before
    assert report.ok
    assert (report.torn_tail, report.corruption) == (None, None)
    seqs = list_segments(region)
    assert report.segments == len(seqs)
    assert report.frames == sum(len(frames(segment_path(region, s))) for s in seqs)
    assert report.bytes == sum(segment_path(region, s).stat().st_size for s in seqs)
    assert report.topics == {t: (0, len(entries)) for t, entries in appended.items()}
    assert repair_region(region) == []
    assert files(region) == before
    assert not (region / "quarantine").exists()


async def test_verify_reports_a_torn_tail_and_repair_cuts_it(
    tmp_path: Path, open_store: OpenStore
) -> None:
    image = await crash_image(tmp_path, open_store)
    region = image.region
    path = segment_path(region, image.newest)
    data = path.read_bytes()
    last = frames(path)[-1]
    cut = last.position + 7
    path.write_bytes(data[:cut])
    before = files(region)

    report = verify_region(region)

    assert files(region) == before
    assert report.ok
    assert report.torn_tail == (str(path), last.position)
    assert report.corruption is None
    counts = counts_before(region, (image.newest, last.position))
    assert report.topics == {t: (0, n) for t, n in counts.items()}

    moved = repair_region(region)

    quarantined = region / "quarantine" / f"{path.name}.from-{last.position}"
    assert moved == [str(quarantined)]
    assert quarantined.read_bytes() == data[last.position : cut]
    assert path.read_bytes() == data[: last.position]
    assert not (region / SNAPSHOT_NAME).exists()
    after = verify_region(region)
    assert after.ok and after.torn_tail is None
    assert recover_region(region).truncated == []
    expected = {t: entries[: counts.get(t, 0)] for t, entries in image.appended.items()}
    await check_store(region.parent, open_store, expected)


@pytest.mark.parametrize("where", ["sealed", "newest"])
async def test_repair_quarantines_from_the_damage_on_and_offsets_continue(
    tmp_path: Path, open_store: OpenStore, where: str
) -> None:
    region, appended = await rotated_region(tmp_path, open_store)
    seqs = list_segments(region)
    seq = seqs[2] if where == "sealed" else seqs[-1]
    path = segment_path(region, seq)
    damaged = pick_frames(path)[2]
    counts = counts_before(region, (seq, damaged.position))
    flip(path, damaged.end - 1)
    original = {s: segment_path(region, s).read_bytes() for s in seqs}
    assert verify_region(region).corruption is not None

    moved = repair_region(region)

    quarantine = region / "quarantine"
    later = [s for s in seqs if s > seq]
    assert moved == [
        str(quarantine / f"{path.name}.from-{damaged.position}"),
        *(str(quarantine / segment_path(region, s).name) for s in later),
    ]
    assert Path(moved[0]).read_bytes() == original[seq][damaged.position :]
    for s in later:
        assert (quarantine / segment_path(region, s).name).read_bytes() == original[s]
    assert list_segments(region) == [s for s in seqs if s <= seq]
    assert path.read_bytes() == original[seq][: damaged.position]
    assert not (region / SNAPSHOT_NAME).exists()
    report = verify_region(region)
    assert report.ok and report.torn_tail is None
    assert report.topics == {t: (0, n) for t, n in counts.items()}

    expected = {t: entries[: counts[t]] for t, entries in appended.items()}
    await check_store(region.parent, open_store, expected)
    assert recover_region(region).next_seq > max(seqs), "quarantined numbers are not reused"


# -- inconsistent segments -------------------------------------------------------------------


def msgs(topic_id: int, base: int, count: int = 1) -> bytes:
    return b"".join(messages_frame(topic_id, base, [Entry(b"m")] * count))


@pytest.mark.parametrize(
    ("name", "segment", "bad_frame"),
    [
        ("no checkpoint", [topic_frame(1, "a"), msgs(1, 0)], 0),
        ("checkpoint of another segment", [checkpoint_frame(3, 0, "r0"), topic_frame(1, "a")], 0),
        ("unregistered topic", [checkpoint_frame(0, 0, "r0"), msgs(1, 0)], 1),
        ("unregistered time", [checkpoint_frame(0, 0, "r0"), time_frame(1, 0, 0)], 1),
        (
            # (An offset gap is not corruption: see test_bad_entries.py.)
            "offsets going back",
            [checkpoint_frame(0, 0, "r0"), topic_frame(1, "a"), msgs(1, 0, 2), msgs(1, 1)],
            3,
        ),
        (
            "id bound to two names",
            [checkpoint_frame(0, 0, "r0"), topic_frame(1, "a"), topic_frame(1, "b")],
            2,
        ),
        (
            "name bound to two ids",
            [checkpoint_frame(0, 0, "r0"), topic_frame(1, "a"), topic_frame(2, "a")],
            2,
        ),
        (
            "second checkpoint",
            [checkpoint_frame(0, 0, "r0"), topic_frame(1, "a"), checkpoint_frame(0, 0, "r0")],
            2,
        ),
        (
            "undecodable topic body",  # valid CRCs, but the name is 9 bytes long, not 2
            [checkpoint_frame(0, 0, "r0"), encode_frame(Kind.TOPIC, b"\1\0\0\0\x09\0ab")],
            1,
        ),
    ],
)
def test_inconsistent_segment_is_corruption(
    tmp_path: Path, name: str, segment: list[bytes], bad_frame: int
) -> None:
    region = tmp_path / "r0"
    region.mkdir()
    path = segment_path(region, 0)
    path.write_bytes(b"".join(segment))
    position = sum(len(f) for f in segment[:bad_frame])
    before = files(region)

    with pytest.raises(WalCorruptionError) as caught:
        recover_region(region)
    assert (caught.value.path, caught.value.position) == (str(path), position)
    report = verify_region(region)
    assert report.corruption is not None
    assert (report.corruption.path, report.corruption.position) == (str(path), position)
    assert files(region) == before

    repair_region(region)
    assert path.stat().st_size == position, name
    state = recover_region(region)
    assert path.exists() == (position > 0)
    assert state.next_seq == 1


# -- (d) the snapshot ------------------------------------------------------------------------


async def history_with_snapshot(
    tmp_path: Path, open_store: OpenStore, open_log: OpenLog
) -> tuple[Path, Appended]:
    """Three runs with rotation; the two oldest segments pruned by the cleaner, the first
    through the log (the snapshot knows), the second behind the snapshot's back."""
    wal = tmp_path / "wal"
    history = History()
    for run in range(3):
        store = await open_store(wal, segment_bytes=700, segment_seconds=3600)
        for i in range(12):
            await history.add(store, ("a", "b", "c")[(i + run) % 3], 1 + i % 3)
        if run == 1:
            await store.advance_time("c")
        await store.close()
    region = wal / "r0"
    log = await open_log(region)
    await log.delete_segment(0)
    await log.close()
    segment_path(region, 1).unlink()
    assert list_segments(region)[0] == 2
    return region, history.appended


async def test_recovery_with_and_without_snapshot_agrees(
    tmp_path: Path, open_store: OpenStore, open_log: OpenLog
) -> None:
    region, appended = await history_with_snapshot(tmp_path, open_store, open_log)
    without = tmp_path / "without" / "r0"
    shutil.copytree(region, without)
    (without / SNAPSHOT_NAME).unlink()

    fast = recover_region(region)
    full = recover_region(without)

    assert summary(fast) == summary(full)
    assert fast.bytes_scanned < full.bytes_scanned  # the snapshot really was used
    first = {t: fast.topics[t].first_offset for t in appended}
    assert all(f > 0 for f in first.values()), "pruning must have removed offsets"

    contents = []
    for wal in (region.parent, without.parent):
        store = await open_store(wal, cache_topic_max_bytes=1)
        got = {}
        for topic, entries in appended.items():
            info = store.info(topic)
            assert info is not None
            assert (info.first_offset, info.high_watermark) == (first[topic], len(entries))
            got[topic] = [fields(e) for e in await read_all(store, topic, info.first_offset)]
            assert got[topic] == [fields(e) for e in entries[first[topic] :]]
        await store.close()
        contents.append(got)
    assert contents[0] == contents[1]


def framed(body: bytes) -> bytes:
    """A snapshot file with a correct header (CRC and length) around ``body``."""
    return f"{SNAPSHOT_MAGIC} {crc32c(body):08x} {len(body)}\n".encode() + body


def corrupt_snapshots(good: bytes) -> list[tuple[str, bytes]]:
    body = good.partition(b"\n")[2]
    doc = json.loads(body)
    shapes = [
        ("garbage", b"\xff\xfe not json"),
        ("list", b"[]"),
        ("null", b"null"),
        ("number", b"1"),
        ("string", b'"meta"'),
        ("empty object", b"{}"),
        ("future version", json.dumps({**doc, "version": 99}).encode()),
        ("topics not a list", json.dumps({**doc, "topics": 5}).encode()),
        ("topic not an object", json.dumps({**doc, "topics": [[1, 2]]}).encode()),
    ]
    for key in ("name", "id", "next_offset", "first_offset", "spans"):
        topics = [{k: v for k, v in t.items() if k != key} for t in doc["topics"]]
        shapes.append((f"topic without {key}", json.dumps({**doc, "topics": topics}).encode()))
    bad_spans = [{**t, "spans": [[1, 2]]} for t in doc["topics"]]
    shapes.append(("short span", json.dumps({**doc, "topics": bad_spans}).encode()))
    bad_ids = [{**t, "id": "one"} for t in doc["topics"]]
    shapes.append(("id not a number", json.dumps({**doc, "topics": bad_ids}).encode()))
    # Wrong shapes behind a valid header reach the structural checks; the same bytes without
    # a header, or behind a stale CRC, are rejected before parsing.
    cases = [(name, framed(data)) for name, data in shapes]
    cases += [(f"{name} (no header)", data) for name, data in shapes]
    cases.append(("empty", b""))
    flipped = bytearray(good)
    flipped[-2] ^= 0x01  # still parses, but the CRC no longer matches
    cases.append(("flipped byte, stale CRC", bytes(flipped)))
    # Every strict prefix is invalid (length mismatch); a sample of them suffices.
    cases += [(f"cut at {n}", good[:n]) for n in [*range(0, len(good), 7), len(good) - 1]]
    return cases


async def test_corrupt_snapshot_is_ignored(
    tmp_path: Path, open_store: OpenStore, open_log: OpenLog
) -> None:
    region, appended = await history_with_snapshot(tmp_path, open_store, open_log)
    good = (region / SNAPSHOT_NAME).read_bytes()
    without = tmp_path / "without" / "r0"
    shutil.copytree(region, without)
    (without / SNAPSHOT_NAME).unlink()
    full = summary(recover_region(without))
    segments = files(without)

    for name, data in corrupt_snapshots(good):
        (without / SNAPSHOT_NAME).write_bytes(data)
        state = recover_region(without)
        assert summary(state) == full, name
        assert state.bytes_scanned == sum(len(b) for b in segments.values()), name

    (without / SNAPSHOT_NAME).write_bytes(b'{"version": 1, "topics": [')
    store = await open_store(without.parent)
    for topic, entries in appended.items():
        info = store.info(topic)
        assert info is not None and info.high_watermark == len(entries)
        assert await store.append(topic, Entry(b"more")) == len(entries)
    await store.close()


async def test_next_seq_never_reuses_a_number(tmp_path: Path, open_store: OpenStore) -> None:
    # Regression: next_seq came from the segment files alone. With every sealed segment gone
    # (uploaded, then deleted by the cleaner) and the active one lost before its first write,
    # recovery restarted at 0 and new segments took numbers already used in object storage.
    wal = tmp_path / "wal"
    store = await open_store(wal)
    await store.append("t", Entry(b"x"))
    await store.close()
    store = await open_store(wal)
    await store.append("t", Entry(b"y"))
    await store.close()
    region = wal / "r0"
    assert list_segments(region) == [0, 1]
    assert Snapshot.from_bytes((region / SNAPSHOT_NAME).read_bytes()).next_seq == 2
    for seq in (0, 1):
        segment_path(region, seq).unlink()
    segment_path(region, 2).write_bytes(b"")  # created, then the crash

    state = recover_region(region)

    assert state.segments == {}
    assert not segment_path(region, 2).exists()
    assert state.next_seq == 3
    assert state.topics["t"].next_offset == 2
    (region / SNAPSHOT_NAME).unlink()
    segment_path(region, 7).write_bytes(b"")
    assert recover_region(region).next_seq == 8


# -- (e) close and reopen --------------------------------------------------------------------


async def test_offsets_continue_across_reopen_cycles(tmp_path: Path, open_store: OpenStore) -> None:
    wal = tmp_path / "wal"
    region = wal / "r0"
    history = History()
    sealed_bytes: dict[int, bytes] = {}
    for cycle in range(5):
        store = await open_store(wal)
        log = store.regions[0]
        assert log.active_seq == cycle, "each open starts a new segment"
        assert log.sealed == set(range(cycle))
        for topic, entries in history.appended.items():
            info = store.info(topic)
            assert info is not None and info.high_watermark == len(entries)
        await history.add(store, "t", 2)
        assert written_segments(region) == list(range(cycle + 1))
        for seq, data in sealed_bytes.items():
            assert segment_path(region, seq).read_bytes() == data
        await history.add(store, "t")
        if cycle >= 2:
            await history.add(store, "late")
        await store.close()
        sealed_bytes[cycle] = segment_path(region, cycle).read_bytes()

    assert recover_region(region).segments.keys() == set(range(5))
    await check_store(wal, open_store, history.appended)
    assert [e.offset for e in history.appended["t"]] == list(range(15))


async def test_torn_tail_beside_a_precreated_segment(tmp_path: Path, open_store: OpenStore) -> None:
    image = await crash_image(tmp_path, open_store)
    region = image.region
    newest = segment_path(region, image.newest)
    data = newest.read_bytes()
    last = frames(newest)[-1]
    newest.write_bytes(data[: last.end - 3])  # torn inside its last frame
    spare = segment_path(region, image.newest + 1)
    spare.write_bytes(b"")  # the writer's pre-created next segment

    state = recover_region(region)

    # The written segment before the empty spare is still the one with the torn tail.
    assert state.truncated == [(str(newest), last.position, last.end - 3 - last.position)]
    assert not spare.exists()
    assert state.segments == {0: segment_path(region, 0).stat().st_size, 1: last.position}
    assert state.next_seq == image.newest + 2  # the spare's number is not reused
    report = verify_region(region)
    assert report.ok and report.torn_tail is None


# -- (f) failed reads and files changed while recovery reads them ----------------------------

Readv = Callable[[int, list[memoryview]], int]


def intercept_reads(
    monkeypatch: pytest.MonkeyPatch, path: Path, read: Callable[[Readv, int, list[memoryview]], int]
) -> None:
    """Route every ``os.readv`` of the file at ``path`` through ``read(real_readv, fd, buffers)``
    (recovery reads segment files with ``os.readv``)."""
    real: Readv = os.readv
    identity = (path.stat().st_dev, path.stat().st_ino)

    def readv(fd: int, buffers: list[memoryview]) -> int:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == identity:
            return read(real, fd, buffers)
        return real(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)


@pytest.mark.parametrize("which", ["sealed", "newest"])
async def test_read_error_is_an_oserror_naming_the_file_and_changes_nothing(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    # A disk error while a segment is read must surface as an exception (a mapped segment
    # would have killed the process with SIGBUS), and must not pass for a torn tail: a short
    # read of the newest segment followed by the error, taken for its end, would get it cut.
    region, _ = await rotated_region(tmp_path, open_store)
    (region / SNAPSHOT_NAME).unlink()  # every segment is read
    seqs = list_segments(region)
    path = segment_path(region, seqs[1] if which == "sealed" else seqs[-1])
    before = files(region)
    reads: list[int] = []

    def failing(real: Readv, fd: int, buffers: list[memoryview]) -> int:
        reads.append(fd)
        if len(reads) == 1:  # part of the file, then the error
            return real(fd, [buffers[0][:100]])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    intercept_reads(monkeypatch, path, failing)

    for check in (recover_region, verify_region):
        reads.clear()
        with pytest.raises(OSError) as caught:
            check(region)
        assert caught.value.errno == errno.EIO, check
        assert caught.value.filename == str(path), check
        assert os.strerror(errno.EIO) in str(caught.value) and str(path) in str(caught.value)
        assert len(reads) == 2, "the error came from the intercepted reads"
        assert files(region) == before, "a failed read must not change anything"
    reads.clear()
    with pytest.raises(OSError) as caught:
        await open_store(region.parent)
    assert (caught.value.errno, caught.value.filename) == (errno.EIO, str(path))
    assert files(region) == before, "a store that fails to open writes nothing"

    monkeypatch.undo()
    assert recover_region(region).truncated == []


def truncate_when_read(monkeypatch: pytest.MonkeyPatch, path: Path, size: int) -> list[int]:
    """Truncate the file at ``path`` to ``size`` bytes just before its first read, as another
    process could after recovery listed and opened it; returns ``[size]`` once it has."""
    done: list[int] = []

    def truncating(real: Readv, fd: int, buffers: list[memoryview]) -> int:
        if not done:
            os.truncate(path, size)
            done.append(size)
        return real(fd, buffers)

    intercept_reads(monkeypatch, path, truncating)
    return done


@pytest.mark.parametrize("into_frame", [0, 10])
async def test_newest_segment_truncated_while_recovery_reads_it_is_read_as_it_is_now(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch, into_frame: int
) -> None:
    # Touching a mapping past the file's new end would have raised SIGBUS. Reading, recovery
    # sees a shorter segment: at a frame boundary an intact one, inside a frame a torn tail.
    region, appended = await rotated_region(tmp_path, open_store)
    (region / SNAPSHOT_NAME).unlink()
    seq = list_segments(region)[-1]
    path = segment_path(region, seq)
    frame = pick_frames(path)[2]
    counts = counts_before(region, (seq, frame.position))
    truncated = truncate_when_read(monkeypatch, path, frame.position + into_frame)

    state = recover_region(region)

    assert truncated == [frame.position + into_frame]
    if into_frame:
        assert state.truncated == [(str(path), frame.position, into_frame)]
    else:
        assert state.truncated == []
    assert path.stat().st_size == frame.position
    assert state.segments[seq] == frame.position, "the size read, not the size listed"
    assert state.bytes_scanned == sum(state.segments.values()) + into_frame  # + the torn tail
    assert {name: t.next_offset for name, t in state.topics.items()} == counts
    monkeypatch.undo()
    expected = {t: entries[: counts[t]] for t, entries in appended.items()}
    await check_store(region.parent, open_store, expected)


async def test_sealed_segment_truncated_while_recovery_reads_it_is_corruption(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    region, _ = await rotated_region(tmp_path, open_store)
    (region / SNAPSHOT_NAME).unlink()
    path = segment_path(region, list_segments(region)[1])
    frame = pick_frames(path)[2]
    cut = frame.position + 10
    before = {**files(region), str(path.relative_to(region)): path.read_bytes()[:cut]}
    truncated = truncate_when_read(monkeypatch, path, cut)

    with pytest.raises(WalCorruptionError) as caught:
        recover_region(region)

    assert truncated == [cut]
    assert (caught.value.path, caught.value.position) == (str(path), frame.position)
    assert "sealed segment" in caught.value.reason
    assert files(region) == before, "only the other process changed anything"


@pytest.mark.parametrize(
    "change",
    [
        {"dropped": 0},  # Snapshot.from_bytes raised AttributeError
        {"next_seq": float("inf")},  # ... OverflowError
        {"topics": [{"name": "/default/t", "id": 1, "next_offset": float("inf")}]},  # TopicMeta
    ],
)
def test_snapshot_with_fields_of_the_wrong_type_is_ignored(
    tmp_path: Path, change: dict[str, object]
) -> None:
    """Found by tests/fuzz/test_wal.py: a CRC-valid snapshot whose fields have the wrong type
    made recovery fail with AttributeError/OverflowError instead of ignoring the snapshot and
    rebuilding the state from the segments."""
    doc = {
        "version": 1,
        "region": "r",
        "next_seq": 1,
        "next_topic_id": 2,
        "uploaded": [],
        "dropped": {},
        "topics": [],
        **change,
    }
    body = json.dumps(doc).encode()
    (tmp_path / SNAPSHOT_NAME).write_bytes(
        f"{SNAPSHOT_MAGIC} {crc32c(body):08x} {len(body)}\n".encode() + body
    )
    frames = [checkpoint_frame(0, 1_000, "r"), topic_frame(1, "/default/t")]
    frames += messages_frame(1, 0, [Entry(b"x", ingest_ms=1_000)])
    segment_path(tmp_path, 0).write_bytes(b"".join(frames))
    state = recover_region(tmp_path)
    assert state.topics["/default/t"].next_offset == 1
