"""Tests for danube_ingest.wal.segment: naming, listing, scanning, and the segment files that
RegionLog writes (rotation by size and by age, every segment self-contained)."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from danube_ingest.errors import CorruptFrameError, TruncatedFrameError, WalCorruptionError
from danube_ingest.wal import RegionLog, recover_region
from danube_ingest.wal.framing import (
    Entry,
    Kind,
    batch_header,
    checkpoint_frame,
    decode_checkpoint,
    decode_messages,
    decode_topic,
    drop_frame,
    iter_frames,
    messages_frame,
    time_frame,
    topic_frame,
)
from danube_ingest.wal.segment import (
    SegmentReader,
    find_valid_frame,
    list_segments,
    scan,
    segment_name,
    segment_path,
)

OpenLog = Callable[..., Awaitable[RegionLog]]


def build_segment(seq: int = 0, payloads: int = 4) -> tuple[bytes, list[int]]:
    """A segment's bytes and the positions of its frames (checkpoint, topic, messages...)."""
    frames = [checkpoint_frame(seq, 1000, "r0"), topic_frame(1, "t")]
    frames += [
        b"".join(messages_frame(1, i, [Entry(f"payload {i}".encode(), ingest_ms=i)]))
        for i in range(payloads)
    ]
    frames.append(time_frame(1, payloads, 2000))
    positions = []
    position = 0
    for frame in frames:
        positions.append(position)
        position += len(frame)
    return b"".join(frames), positions


def check_self_contained(path: Path, seq: int) -> list[tuple[int, int]]:
    """Assert that a segment file decodes on its own; return its (topic id, offset) pairs."""
    frames = list(iter_frames(path.read_bytes()))
    assert frames, f"{path} is empty"
    assert frames[0].kind == Kind.CHECKPOINT
    assert decode_checkpoint(frames[0].body)[0] == seq
    registered: dict[int, str] = {}
    offsets = []
    for frame in frames[1:]:
        assert frame.kind != Kind.CHECKPOINT
        if frame.kind == Kind.TOPIC:
            topic_id, name = decode_topic(frame.body)
            assert topic_id not in registered, f"topic {name} registered twice in {path}"
            registered[topic_id] = name
        elif frame.kind == Kind.MESSAGES:
            header, entries = decode_messages(frame.body)
            assert header.topic_id in registered, f"unregistered topic id in {path}"
            offsets += [(header.topic_id, e.offset) for e in entries]
    return offsets


# -- naming and listing ----------------------------------------------------------------------


def test_segment_names_sort_as_numbers(tmp_path: Path) -> None:
    assert segment_name(0) == "00000000000000000000.wal"
    assert segment_name(2**64 - 1) == "18446744073709551615.wal"
    assert segment_path(tmp_path, 42) == tmp_path / "00000000000000000042.wal"


def test_list_segments_ignores_other_files(tmp_path: Path) -> None:
    assert list_segments(tmp_path / "missing") == []
    for seq in (10, 2, 100, 0):
        segment_path(tmp_path, seq).write_bytes(b"")
    for name in ("meta.json", "meta.json.tmp", "12.wal", "00000000000000000003.wal.tmp"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / segment_name(5)).write_bytes(b"")

    assert list_segments(tmp_path) == [0, 2, 10, 100]


# -- reading ---------------------------------------------------------------------------------


def test_segment_reader_gives_each_whole_file_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = SegmentReader()
    for i, data in enumerate([os.urandom(5000), b"", os.urandom(100), os.urandom(70_000)]):
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        with reader.open(path) as segment:
            view = segment.view
            assert bytes(view) == data
            assert segment.eof and segment.total == len(data)
        with pytest.raises(ValueError):
            bytes(view)  # released with the block: its bytes belong to the next file

    # A file that another process extends while it is read, past the reused buffer's end.
    path = tmp_path / "growing"
    path.write_bytes(b"a" * 1000)
    real = os.readv
    grown: list[int] = []

    def readv(fd: int, buffers: list[memoryview]) -> int:
        if not grown:
            with path.open("ab") as f:
                grown.append(f.write(b"b" * 200_000))
        return real(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    with reader.open(path) as segment:
        assert bytes(segment.view) == b"a" * 1000 + b"b" * 200_000


@pytest.mark.parametrize("window", [1, 7, 4096, 65536])
def test_segment_window_moves_through_the_file(tmp_path: Path, window: int) -> None:
    # A scan's moves: keep an arbitrary tail of the window, sometimes ask for a larger piece
    # (a frame bigger than the window), sometimes for all the rest (damage). The view always
    # holds exactly the file's bytes [base, base + len(view)), one reused buffer serves every
    # file, and what a move keeps may overlap where it goes.
    rng = random.Random(window)
    reader = SegmentReader()
    for size in (0, 1, 5000, 300_000 if window > 1000 else 20_000):
        data = rng.randbytes(size)
        path = tmp_path / f"w{window}-{size}"
        path.write_bytes(data)
        with reader.open(path, window) as segment:
            base = 0
            while True:
                view = segment.view
                assert segment.base == base
                assert bytes(view) == data[base : segment.total]
                if segment.eof:
                    break
                assert len(view) >= min(window, size - segment.base)
                keep = rng.randrange(len(view) + 1)
                if rng.random() < 0.02:
                    segment.rest(keep)
                    assert segment.eof
                elif rng.random() < 0.2:
                    need = rng.randrange(1, 3 * window + 2)
                    segment.advance(keep, need)
                    assert len(segment.view) >= min(need, size - segment.base)
                else:
                    segment.advance(keep)
                base += keep
            assert segment.total == size and bytes(segment.view) == data[segment.base :]


# -- scanning --------------------------------------------------------------------------------


def test_scan_of_an_intact_segment() -> None:
    data, positions = build_segment()

    result = scan(data)

    assert [f.position for f in result.frames] == positions
    assert (result.valid_end, result.error, result.resync_position) == (len(data), None, None)
    later = scan(data, positions[2])
    assert [f.position for f in later.frames] == positions[2:]
    assert scan(b"").frames == []


def test_scan_stops_at_a_torn_tail_without_resync() -> None:
    data, positions = build_segment()
    for end in range(positions[-1] + 1, len(data)):
        result = scan(data[:end])
        assert [f.position for f in result.frames] == positions[:-1]
        assert result.valid_end == positions[-1]
        assert isinstance(result.error, TruncatedFrameError)
        assert result.resync_position is None


def test_scan_finds_the_next_frame_after_damage() -> None:
    data, positions = build_segment()
    damaged_at, after = positions[3], positions[4]
    for at in range(damaged_at, after):
        buf = bytearray(data)
        buf[at] ^= 0x40
        result = scan(bytes(buf))
        assert [f.position for f in result.frames] == positions[:3]
        assert result.valid_end == damaged_at
        assert isinstance(result.error, CorruptFrameError)
        assert result.resync_position == after


def test_scan_resyncs_over_inserted_garbage() -> None:
    data, positions = build_segment()
    # Garbage that looks like the start of a prefix (kind 1, version 1, zero reserved bytes).
    junk = b"\x05\x00\x00\x00\x01\x01\x00\x00" * 3
    buf = data[: positions[2]] + junk + data[positions[2] :]
    result = scan(buf)
    assert result.valid_end == positions[2]
    assert result.resync_position == positions[2] + len(junk)


def test_find_valid_frame() -> None:
    data, positions = build_segment()
    assert find_valid_frame(data, 0) == 0
    assert find_valid_frame(data, 1) == positions[1]
    assert find_valid_frame(data, positions[3]) == positions[3]
    assert find_valid_frame(data, positions[-1] + 1) is None
    assert find_valid_frame(b"\x01\x01\x00\x00" * 64, 0) is None
    assert find_valid_frame(b"", 0) is None


def test_torn_frame_whose_payload_holds_a_frame_image_is_a_torn_tail() -> None:
    # Regression: scan used to look for a valid frame inside the incomplete last frame, found
    # the frame image a producer had put in its payload, and so reported corruption (recovery
    # refused to open) after an ordinary crash during a write.
    data, _ = build_segment()
    inner = topic_frame(7, "inner") + b"".join(messages_frame(7, 0, [Entry(b"inner")]))
    last = b"".join(messages_frame(1, 4, [Entry(b"<" + inner + b">")]))
    for end in range(len(data) + 1, len(data) + len(last)):
        result = scan(data + last[: end - len(data)])
        assert result.valid_end == len(data)
        assert isinstance(result.error, TruncatedFrameError)
        assert result.resync_position is None, f"cut at {end}"
    # The image really is a valid frame, past the start of the torn one.
    assert find_valid_frame(data + last[:-1], len(data) + 1) is not None


# -- segments written by RegionLog -----------------------------------------------------------


async def test_rotation_by_size_writes_self_contained_segments(
    tmp_path: Path, open_log: OpenLog
) -> None:
    region = tmp_path / "r0"
    log = await open_log(region, segment_bytes=512, segment_seconds=3600)
    topics = ["alpha", "beta", "gamma"]
    for i in range(60):
        await log.stage(topics[i % 3], Entry(b"x" * 40, producer_name="p"))
    await asyncio.gather(*(log.stage("delta", Entry(bytes([i]) * 9)) for i in range(5)))
    await log.close()

    seqs = list_segments(region)
    assert len(seqs) >= 8
    assert seqs == list(range(len(seqs)))
    per_topic: dict[int, list[int]] = {}
    for seq in seqs:
        path = segment_path(region, seq)
        for topic_id, offset in check_self_contained(path, seq):
            per_topic.setdefault(topic_id, []).append(offset)
        if seq != seqs[-1]:
            # A segment is sealed once a handoff finds it at or past segment_bytes.
            assert path.stat().st_size >= 512
    assert sorted(len(v) for v in per_topic.values()) == [5, 20, 20, 20]
    for offsets in per_topic.values():
        assert offsets == list(range(len(offsets)))
    state = recover_region(region)
    assert {t.name: t.next_offset for t in state.topics.values()} == {
        "alpha": 20,
        "beta": 20,
        "gamma": 20,
        "delta": 5,
    }


async def test_rotation_by_age_seals_idle_segments_holding_data(
    tmp_path: Path, open_log: OpenLog
) -> None:
    region = tmp_path / "r0"
    log = await open_log(region, segment_bytes=1 << 30, segment_seconds=0.2)
    for i in range(3):
        await log.stage("t", Entry(b"%d" % i))
        await asyncio.sleep(0.5)
    # The segment opened by the last rotation holds no data: idling must not rotate it.
    await asyncio.sleep(0.5)
    assert log.active_seq == 3
    assert log.sealed == {0, 1, 2}
    await log.close()

    assert list_segments(region) == [0, 1, 2, 3]
    for seq in range(3):
        assert check_self_contained(segment_path(region, seq), seq) == [(1, seq)]
    frames = list(iter_frames(segment_path(region, 3).read_bytes()))
    assert [f.kind for f in frames] == [Kind.CHECKPOINT]


async def test_empty_stage_batch_neither_writes_nor_stalls(
    tmp_path: Path, open_log: OpenLog
) -> None:
    # Regression: stage_batch(name, []) queued an empty group; the handoff then failed with
    # IndexError, dropping every entry staged in the same tick and leaving their futures (and
    # close()) waiting forever.
    region = tmp_path / "r0"
    log = await open_log(region)
    other = Entry(b"other")
    staged = log.stage("a", other)
    empty = log.stage_batch("b", [])
    await asyncio.wait_for(asyncio.gather(staged, empty), 5)
    await asyncio.wait_for(log.stage("a", Entry(b"next")), 5)
    await asyncio.wait_for(log.close(), 5)

    frames = list(iter_frames(segment_path(region, 0).read_bytes()))
    batches = [batch_header(f.body) for f in frames if f.kind == Kind.MESSAGES]
    assert [(b.base_offset, b.num_entries) for b in batches] == [(0, 1), (1, 1)]
    assert other.offset == 0


async def test_reopen_seals_the_previous_segment_as_it_is(
    tmp_path: Path, open_log: OpenLog
) -> None:
    region = tmp_path / "r0"
    log = await open_log(region)
    await log.stage("t", Entry(b"one"))
    await log.close()
    before = segment_path(region, 0).read_bytes()

    log = await open_log(region)
    await log.stage("t", Entry(b"two"))
    assert log.sealed == {0}
    assert log.active_seq == 1
    await log.close()

    assert segment_path(region, 0).read_bytes() == before
    assert check_self_contained(segment_path(region, 1), 1) == [(1, 1)]


def test_damage_followed_only_by_a_drop_frame_is_not_a_torn_tail(tmp_path: Path) -> None:
    """Found by tests/fuzz/test_wal.py: re-synchronisation looked for kinds 1..4 only, so damage
    followed by nothing but a (valid, durable) DROP frame was taken for a torn tail and
    recovery truncated the DROP away (the deleted topic came back)."""
    head = checkpoint_frame(0, 1_000, "r") + topic_frame(1, "/default/t")
    damaged = bytearray(b"".join(messages_frame(1, 0, [Entry(b"x", ingest_ms=1_000)])))
    damaged[-1] ^= 0xFF  # the body CRC no longer matches
    data = head + bytes(damaged) + drop_frame(1, 1)
    assert scan(data).resync_position == len(head) + len(damaged)
    region = tmp_path / "r"
    region.mkdir()
    segment_path(region, 0).write_bytes(data)
    with pytest.raises(WalCorruptionError):
        recover_region(region)
    assert segment_path(region, 0).read_bytes() == data
