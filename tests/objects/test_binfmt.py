"""Tests for danube_ingest.objects.binfmt: round trips, the footer, and damage raising only
ObjectFormatError (never a silently different entry)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct

import lz4.block
import pytest
import zstandard
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from danube_ingest.errors import CorruptFrameError, ObjectFormatError
from danube_ingest.objects.binfmt import (
    CODECS,
    FOOTER_GUESS_BYTES,
    FORMAT_VERSION,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAX_RAW_LEN,
    MIN_OBJECT_SIZE,
    TRAILER_SIZE,
    BinWriter,
    Footer,
    FrameRef,
    TopicSpan,
    decode_frame_bytes,
    decode_range,
    parse_object,
    read_footer,
    read_footer_from,
)
from danube_ingest.wal.framing import (
    Entry,
    checkpoint_frame,
    messages_frame,
    time_frame,
    topic_frame,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def entry(offset: int, ingest_ms: int, payload: bytes = b"", **fields: object) -> Entry:
    result = Entry(payload or b"payload-%d" % offset, **fields)  # type: ignore[arg-type]
    result.offset = offset
    result.ingest_ms = ingest_ms
    return result


def run(first: int, count: int, ms: int = 1_000, payload_size: int = 0) -> list[Entry]:
    """``count`` entries from offset ``first``, ingest times from ``ms`` (10 per millisecond)."""
    return [
        entry(o, ms + (o - first) // 10, os.urandom(payload_size) if payload_size else b"")
        for o in range(first, first + count)
    ]


def rich_entries(first: int) -> list[Entry]:
    """Entries using every optional field of the WAL entry encoding."""
    return [
        entry(
            first,
            5,
            b"\x00\xff" * 10,
            producer_name="prod-é",
            routing_key="key-☃",
            attributes={"a": "1", "ключ": "значение", "": ""},
            schema_id=2**64 - 1,
            schema_version=7,
            producer_id=42,
            request_id=2**63,
            publish_ms=-3,
        ),
        entry(first + 1, 6, routing_key="", attributes={}, schema_id=0),
        entry(first + 2, 6, producer_name="🦀" * 50, publish_ms=2**62),
    ]


def fields(e: Entry) -> tuple[object, ...]:
    """Every field of an entry, exactly (unlike Entry.__eq__, 0 and None differ here)."""
    return (
        e.offset,
        e.ingest_ms,
        e.publish_ms,
        e.producer_name,
        e.routing_key,
        e.attributes or None,
        e.schema_id,
        e.schema_version,
        e.producer_id,
        e.request_id,
        bytes(e.payload),
    )


def wal_bytes(entries: list[Entry], batch: int = 100) -> bytes:
    """WAL MESSAGES frames of ``entries`` (consecutive offsets), ``batch`` entries per frame."""
    parts: list[bytes] = []
    for i in range(0, len(entries), batch):
        chunk = entries[i : i + batch]
        parts += messages_frame(7, chunk[0].offset, chunk)
    return b"".join(parts)


def add_wal(writer: BinWriter, topic: str, entries: list[Entry], data: bytes | None = None) -> None:
    writer.add_wal_frames(
        topic,
        wal_bytes(entries) if data is None else data,
        first_offset=entries[0].offset,
        last_offset=entries[-1].offset,
        entries=len(entries),
        first_ingest_ms=entries[0].ingest_ms,
        last_ingest_ms=entries[-1].ingest_ms,
    )


def decode_all(data: bytes, key: str = "k") -> dict[str, list[tuple[object, ...]]]:
    """Every entry of an object by topic, decoding every frame on its own."""
    footer = parse_object(data, key)
    result: dict[str, list[tuple[object, ...]]] = {}
    for name, span in footer.topics.items():
        decoded = result[name] = []
        for ref in span.frames:
            frame = data[ref.position : ref.position + ref.length]
            decoded += [fields(e) for e in decode_frame_bytes(frame, ref, key)]
    return result


def expected(entries: list[Entry]) -> list[tuple[object, ...]]:
    return [fields(e) for e in entries]


def frame_codec(data: bytes, ref: FrameRef) -> str:
    return CODECS[data[ref.position + 4]]


def small_object(codec: str) -> tuple[bytes, dict[str, list[tuple[object, ...]]]]:
    """Two topics, three frames, rich entries and a TIME frame: small enough to damage every
    byte of it."""
    writer = BinWriter(codec, frame_target_bytes=200)
    a = run(10, 6) + rich_entries(16)
    b = run(0, 3, ms=50)
    add_wal(writer, "a", a[:6], wal_bytes(a[:6], batch=3) + time_frame(9, 16, 2_000))
    writer.add_entries("b", b)
    writer.add_entries("a", a[6:])
    data = writer.finish()
    return data, {"a": expected(a), "b": expected(b)}


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_interleaved_topics(codec: str) -> None:
    topics = {"orders": run(0, 3_000), "clicks": run(100, 1_500, ms=7), "ns/τ": rich_entries(0)}
    writer = BinWriter(codec, frame_target_bytes=16 * 1024)
    add_wal(writer, "clicks", topics["clicks"][:700])
    writer.add_entries("orders", topics["orders"][:1_000])
    writer.add_entries("ns/τ", topics["ns/τ"])
    add_wal(writer, "orders", topics["orders"][1_000:2_500])
    writer.add_entries("clicks", topics["clicks"][700:])
    writer.add_entries("orders", topics["orders"][2_500:])
    data = writer.finish()

    footer = parse_object(data, "key")
    assert footer == writer.footer
    assert list(footer.topics) == ["clicks", "orders", "ns/τ"]  # first-added order
    assert decode_all(data) == {name: expected(entries) for name, entries in topics.items()}
    for name, entries in topics.items():
        span = footer.topics[name]
        assert (span.topic, span.first_offset, span.last_offset, span.entries) == (
            name,
            entries[0].offset,
            entries[-1].offset,
            len(entries),
        )
        assert (span.first_ingest_ms, span.last_ingest_ms) == (
            entries[0].ingest_ms,
            entries[-1].ingest_ms,
        )
        assert span.entries == sum(ref.entries for ref in span.frames)
    assert len(footer.topics["orders"].frames) > 5
    if codec != "none":
        assert len(data) < sum(len(wal_bytes(entries)) for entries in topics.values()) / 2


@pytest.mark.parametrize("codec", CODECS)
def test_topics_are_contiguous_byte_ranges(codec: str) -> None:
    writer = BinWriter(codec, frame_target_bytes=4096)
    for i in range(0, 600, 100):  # interleaved calls, several frames per topic
        for topic in ("x", "y", "z"):
            writer.add_entries(topic, run(i, 100, payload_size=20))
    data = writer.finish()
    footer = parse_object(data)
    assert footer.size == len(data)

    position = HEADER_SIZE
    for span in footer.topics.values():
        assert span.position == position
        assert span.length == sum(ref.length for ref in span.frames)
        for ref in span.frames:
            assert ref.topic == span.topic
            assert ref.position == position
            prefix = data[ref.position : ref.position + FRAME_PREFIX_SIZE]
            assert struct.unpack_from("<I", prefix)[0] == ref.length - FRAME_PREFIX_SIZE
            position += ref.length
        # One ranged read of [position, position + length) decodes the whole topic.
        chunk = data[span.position : span.position + span.length]
        decoded = [e for _, es in decode_range(chunk, span, span.position) for e in es]
        assert [e.offset for e in decoded] == list(range(600))
    assert position == footer.footer_position


def test_rich_entries_survive() -> None:
    writer = BinWriter()
    entries = rich_entries(3)
    writer.add_entries("t", entries)
    assert decode_all(writer.finish()) == {"t": expected(entries)}


@pytest.mark.parametrize("codec", CODECS)
def test_large_payloads(codec: str) -> None:
    writer = BinWriter(codec, frame_target_bytes=1 << 20)
    entries = run(0, 12, payload_size=200 * 1024) + run(12, 1, payload_size=3 << 20)
    entries += run(13, 2, payload_size=70 * 1024)
    writer.add_entries("big", entries)
    data = writer.finish()
    span = parse_object(data).topics["big"]
    assert decode_all(data) == {"big": expected(entries)}
    # Frames of about 1 MiB; the 3 MiB entry is a frame of its own.
    assert [ref.entries for ref in span.frames] == [5, 5, 2, 1, 2]
    assert all(frame_codec(data, ref) == "none" for ref in span.frames)  # random payloads


def test_empty_writer() -> None:
    writer = BinWriter()
    data = writer.finish()
    assert len(data) == MIN_OBJECT_SIZE
    footer = parse_object(data)
    assert footer == writer.footer == Footer({}, MIN_OBJECT_SIZE, HEADER_SIZE)
    assert read_footer(data[-TRAILER_SIZE - 4 :], len(data)) == footer


def test_add_entries_of_nothing_adds_no_topic() -> None:
    writer = BinWriter()
    writer.add_entries("t", [])
    parse_object(writer.finish())
    assert writer.footer.topics == {}


def test_time_frames_are_kept_and_skipped() -> None:
    entries = run(0, 10)
    data = time_frame(1, 0, 900) + wal_bytes(entries[:5]) + time_frame(1, 5, 1_000)
    data += wal_bytes(entries[5:]) + time_frame(1, 10, 5_000)
    writer = BinWriter("none")
    add_wal(writer, "t", entries, data)
    obj = writer.finish()
    (ref,) = parse_object(obj).topics["t"].frames
    assert ref.length == FRAME_PREFIX_SIZE + len(data)  # stored as given
    assert decode_all(obj) == {"t": expected(entries)}


def test_offset_gaps_between_batches() -> None:
    entries = [entry(o, 1) for o in (0, 1, 5, 6, 100)]
    writer = BinWriter()
    writer.add_entries("t", entries)
    add_wal(writer, "t", [entry(200, 2)])
    data = writer.finish()
    span = parse_object(data).topics["t"]
    assert (span.first_offset, span.last_offset, span.entries) == (0, 200, 6)
    assert decode_all(data) == {"t": expected([*entries, entry(200, 2)])}


def test_consecutive_calls_share_frames_up_to_the_target() -> None:
    entries = run(0, 2_000)
    writer = BinWriter(frame_target_bytes=32 * 1024)
    for i in range(0, 2_000, 10):
        add_wal(writer, "t", entries[i : i + 10])
    data = writer.finish()
    span = parse_object(data).topics["t"]
    call_size = max(len(wal_bytes(entries[i : i + 10])) for i in range(0, 2_000, 10))
    raw_lens = [struct.unpack_from("<I", data, ref.position + 8)[0] for ref in span.frames]
    assert len(raw_lens) > 1
    assert all(32 * 1024 - call_size < size <= 32 * 1024 for size in raw_lens[:-1])
    assert raw_lens[-1] <= 32 * 1024
    assert decode_all(data) == {"t": expected(entries)}


def test_one_large_call_is_split_at_wal_frame_boundaries() -> None:
    entries = run(0, 5_000)
    writer = BinWriter(frame_target_bytes=16 * 1024)
    add_wal(writer, "t", entries)  # batches of 100 entries, about 4 KiB each
    data = writer.finish()
    span = parse_object(data).topics["t"]
    assert len(span.frames) > 10
    assert all(ref.entries % 100 == 0 for ref in span.frames)
    assert decode_all(data) == {"t": expected(entries)}


def test_add_entries_fills_the_current_frame_first() -> None:
    writer = BinWriter(frame_target_bytes=8 * 1024)
    writer.add_entries("t", run(0, 6, payload_size=1_000))  # about 6 KiB
    writer.add_entries("t", run(6, 6, payload_size=1_000))
    frames = parse_object(writer.finish()).topics["t"].frames
    assert [ref.entries for ref in frames] == [7, 5]


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_frame_that_does_not_compress_is_stored_uncompressed(codec: str) -> None:
    writer = BinWriter(codec, frame_target_bytes=4096)
    writer.add_entries("random", run(0, 3, payload_size=64 * 1024))
    writer.add_entries("zeros", [entry(o, 1, bytes(1_000)) for o in range(20)])
    data = writer.finish()
    footer = parse_object(data)
    assert {frame_codec(data, ref) for ref in footer.topics["random"].frames} == {"none"}
    assert {frame_codec(data, ref) for ref in footer.topics["zeros"].frames} == {codec}
    decode_all(data)


@pytest.mark.parametrize(("codec", "level"), [("zstd", 19), ("lz4", 9)])
def test_compression_levels(codec: str, level: int) -> None:
    writer = BinWriter(codec, level=level)
    entries = run(0, 500)
    writer.add_entries("t", entries)
    assert decode_all(writer.finish()) == {"t": expected(entries)}


# -- writer input validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"first_offset": 1},
        {"last_offset": 8},
        {"entries": 9},
        {"first_ingest_ms": 0},
        {"last_ingest_ms": 10**9},
    ],
)
def test_add_wal_frames_rejects_metadata_that_does_not_match(change: dict[str, int]) -> None:
    entries = run(0, 10)
    metadata = {
        "first_offset": 0,
        "last_offset": 9,
        "entries": 10,
        "first_ingest_ms": entries[0].ingest_ms,
        "last_ingest_ms": entries[-1].ingest_ms,
    }
    writer = BinWriter()
    with pytest.raises(ValueError, match="topic t"):
        writer.add_wal_frames("t", wal_bytes(entries, batch=4), **(metadata | change))
    assert parse_object(writer.finish()).topics == {}  # nothing was added


@pytest.mark.parametrize(
    "data",
    [
        topic_frame(1, "t"),
        checkpoint_frame(1, 2, "region"),
        time_frame(1, 2, 3),  # no entries
        b"",
        wal_bytes(run(0, 3)) + wal_bytes(run(2, 3)),  # offsets do not increase
    ],
)
def test_add_wal_frames_rejects_data_an_object_cannot_hold(data: bytes) -> None:
    writer = BinWriter()
    with pytest.raises(ValueError, match="topic t"):
        writer.add_wal_frames(
            "t", data, first_offset=0, last_offset=4, entries=5, first_ingest_ms=0, last_ingest_ms=0
        )


def test_add_wal_frames_rejects_damaged_wal_frames() -> None:
    data = bytearray(wal_bytes(run(0, 3)))
    data[-1] ^= 1
    with pytest.raises(CorruptFrameError):
        BinWriter().add_wal_frames(
            "t", data, first_offset=0, last_offset=2, entries=3, first_ingest_ms=0, last_ingest_ms=0
        )


def test_offsets_must_increase_across_calls() -> None:
    writer = BinWriter()
    writer.add_entries("t", run(0, 5))
    with pytest.raises(ValueError, match="offset 4 does not follow offset 4"):
        writer.add_entries("t", run(4, 2))
    with pytest.raises(ValueError, match="expected at least one entry from offset 5"):
        add_wal(writer, "t", run(3, 5))
    with pytest.raises(ValueError, match="offset -1"):
        writer.add_entries("u", [Entry(b"unappended")])
    writer.add_entries("t", run(5, 1))
    assert parse_object(writer.finish()).topics["t"].last_offset == 5


def test_writer_arguments_and_lifecycle() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        BinWriter("gzip")
    with pytest.raises(ValueError, match="level"):
        BinWriter("none", level=3)
    with pytest.raises(ValueError, match="frame_target_bytes"):
        BinWriter(frame_target_bytes=0)
    with pytest.raises(ValueError, match="invalid topic name"):
        BinWriter().add_entries("", run(0, 1))
    writer = BinWriter()
    with pytest.raises(RuntimeError, match="after finish"):
        _ = writer.footer
    writer.finish()
    with pytest.raises(RuntimeError, match="already called"):
        writer.finish()
    with pytest.raises(RuntimeError, match="already called"):
        writer.add_entries("t", run(0, 1))


# -- footer reads ------------------------------------------------------------------------------


def many_topics_object(topics: int) -> bytes:
    writer = BinWriter("none")
    for i in range(topics):
        writer.add_entries(f"topic-{i:05}", run(i, 1))
    return writer.finish()


def test_read_footer_from_a_short_tail_returns_the_size_needed() -> None:
    data = many_topics_object(50)
    footer = parse_object(data)
    needed = len(data) - footer.footer_position
    assert read_footer(data[-10:], len(data)) == TRAILER_SIZE
    assert read_footer(data[-TRAILER_SIZE:], len(data)) == needed
    assert read_footer(data[-(needed - 1) :], len(data)) == needed
    assert read_footer(data[-needed:], len(data), "k") == footer
    assert read_footer(memoryview(data)[-needed - 7 :], len(data)) == footer


@pytest.mark.parametrize(("topics", "reads"), [(0, 1), (3, 1), (1_000, 1), (2_000, 2)])
async def test_read_footer_from_reads_at_most_twice(topics: int, reads: int) -> None:
    data = many_topics_object(topics)
    calls: list[tuple[str, int, int]] = []

    async def get_range(key: str, offset: int, size: int) -> bytes:
        calls.append((key, offset, size))
        return data[offset : offset + size]

    assert await read_footer_from(get_range, len(data), "obj") == parse_object(data)
    assert len(calls) == reads
    assert calls[0] == ("obj", max(0, len(data) - FOOTER_GUESS_BYTES), min(len(data), 65536))
    if reads == 2:  # the second read fetches only the missing bytes before the first
        assert calls[1][1] + calls[1][2] == calls[0][1]


async def test_read_footer_from_rejects_short_reads_and_tiny_objects() -> None:
    data = many_topics_object(2)

    async def short(key: str, offset: int, size: int) -> bytes:
        return data[offset : offset + size - 1]

    with pytest.raises(ObjectFormatError, match="returned"):
        await read_footer_from(short, len(data), "k")

    async def unused(key: str, offset: int, size: int) -> bytes:
        raise AssertionError("no read expected")

    with pytest.raises(ObjectFormatError, match="too small"):
        await read_footer_from(unused, MIN_OBJECT_SIZE - 1, "k")


def test_frames_from() -> None:
    writer = BinWriter(frame_target_bytes=1)  # one WAL frame per object frame
    for first in (0, 10, 20, 40):
        add_wal(writer, "t", run(first, 10 if first < 40 else 5))
    span = parse_object(writer.finish()).topics["t"]
    assert [(ref.first_offset, ref.last_offset) for ref in span.frames] == [
        (0, 9),
        (10, 19),
        (20, 29),
        (40, 44),
    ]

    def firsts(offset: int) -> list[int]:
        return [ref.first_offset for ref in span.frames_from(offset)]

    assert firsts(-5) == firsts(0) == [0, 10, 20, 40]
    assert firsts(9) == [0, 10, 20, 40]
    assert firsts(10) == [10, 20, 40]
    assert firsts(29) == [20, 40]
    assert firsts(30) == firsts(44) == [40]
    assert firsts(45) == []


def test_decode_range_from_a_middle_frame() -> None:
    writer = BinWriter(frame_target_bytes=1)
    add_wal(writer, "a", run(0, 3))
    for first in range(0, 50, 10):
        add_wal(writer, "t", run(first, 10))
    add_wal(writer, "z", run(0, 3))
    data = writer.finish()
    span = parse_object(data).topics["t"]
    start = span.frames_from(25)[0].position
    decoded = list(decode_range(data[start:], span, start))  # runs into topic z: ignored
    assert [ref.first_offset for ref, _ in decoded] == [20, 30, 40]
    assert [e.offset for _, es in decoded for e in es] == list(range(20, 50))

    end = span.frames[3].position + 5
    with pytest.raises(ObjectFormatError, match="inside the frame"):
        list(decode_range(data[start:end], span, start))
    with pytest.raises(ObjectFormatError, match="no frame of topic t starts here"):
        list(decode_range(data[start + 1 :], span, start + 1))
    assert list(decode_range(b"", span, start)) == []


# -- damage ------------------------------------------------------------------------------------


def reseal_trailer(data: bytes, *, footer: bytes | None = None, version: int = 1) -> bytes:
    """``data`` with its footer replaced and the trailer rewritten with valid CRCs."""
    footer_len, _ = struct.unpack_from("<II", data, len(data) - 16)
    body = data[: len(data) - TRAILER_SIZE - footer_len]
    if footer is None:
        footer = data[len(body) : len(data) - TRAILER_SIZE]
    trailer = struct.pack("<II5sBH", len(footer), crc32c(footer), b"DNBIN", version, 0)
    return body + footer + struct.pack("<I", crc32c(trailer)) + trailer


def test_unknown_version_is_named() -> None:
    data = BinWriter().finish()
    with pytest.raises(ObjectFormatError, match="unknown format version 2"):
        read_footer(reseal_trailer(data, version=2), len(data))
    header_v2 = data[:5] + bytes([2]) + data[6:]
    with pytest.raises(ObjectFormatError, match="unknown format version 2") as info:
        parse_object(header_v2, "segments/x.bin")
    assert (info.value.key, info.value.position) == ("segments/x.bin", 0)


def test_footer_must_tile_the_frames() -> None:
    data, _ = small_object("none")
    footer_position = parse_object(data).footer_position
    footer = bytearray(data[footer_position:-TRAILER_SIZE])
    # The first frame record's position field follows count, name_len, "a", frame_count.
    struct.pack_into("<Q", footer, 4 + 2 + 1 + 4 + 36, HEADER_SIZE + 1)
    with pytest.raises(ObjectFormatError, match="invalid frame record"):
        parse_object(reseal_trailer(data, footer=bytes(footer)))
    with pytest.raises(ObjectFormatError, match="trailing footer bytes"):
        parse_object(reseal_trailer(data, footer=data[footer_position:-TRAILER_SIZE] + b"\0"))


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_is_detected(codec: str) -> None:
    data, entries = small_object(codec)
    assert decode_all(data) == entries
    for position in range(len(data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[position] ^= mask
            with pytest.raises(ObjectFormatError):
                decode_all(bytes(damaged))


@pytest.mark.parametrize("codec", CODECS)
def test_every_truncation_is_detected(codec: str) -> None:
    data, _ = small_object(codec)
    footer = parse_object(data)
    for size in range(len(data)):
        with pytest.raises(ObjectFormatError):
            parse_object(data[:size])
    for ref in (ref for span in footer.topics.values() for ref in span.frames):
        frame = data[ref.position : ref.position + ref.length]
        for size in range(0, len(frame), 7):
            with pytest.raises(ObjectFormatError):
                decode_frame_bytes(frame[:size], ref)


def test_frame_prefix_is_checked_against_its_footer_record() -> None:
    data, _ = small_object("zstd")
    ref = parse_object(data).topics["a"].frames[0]
    frame = data[ref.position : ref.position + ref.length]
    later = dataclasses.replace(ref, first_offset=ref.first_offset + 1)
    with pytest.raises(ObjectFormatError, match="does not match its footer record"):
        decode_frame_bytes(frame, later)
    with pytest.raises(ObjectFormatError, match="expected"):
        decode_frame_bytes(frame + b"\0", ref)


def make_frame(codec: int, raw_len: int, stored: bytes, reserved: int = 0) -> bytes:
    """A frame with valid CRCs whatever its fields say."""
    head = struct.pack("<IBBHII", len(stored), codec, reserved, 0, raw_len, crc32c(stored))
    return head + struct.pack("<I", crc32c(head)) + stored


def ref_for(frame: bytes, entries: list[Entry], position: int = HEADER_SIZE) -> FrameRef:
    return FrameRef(
        "t",
        entries[0].offset,
        entries[-1].offset,
        len(entries),
        entries[0].ingest_ms,
        entries[-1].ingest_ms,
        position,
        len(frame),
    )


@pytest.mark.parametrize(
    ("codec", "raw_len", "stored", "match"),
    [
        (1, MAX_RAW_LEN + 1, b"x" * 10, "invalid frame prefix"),
        (3, 10, b"x" * 10, "invalid frame prefix"),
        (0, 11, b"x" * 10, "invalid frame prefix"),
        (1, 5, b"x" * 10, "invalid frame prefix"),  # stored larger than raw
        (1, 100, zstandard.ZstdCompressor().compress(b"y" * 99), "content size 99"),
        (1, 2**28, zstandard.ZstdCompressor(write_content_size=False).compress(b"y"), "content"),
        (1, 100, b"\x28\xb5\x2f\xfd" + b"\xff" * 20, "zstd"),
        (2, 100, lz4.block.compress(b"y" * 99, store_size=False), "decompresses to 99"),
        (2, 50, lz4.block.compress(b"y" * 99, store_size=False), "lz4 frame does not decompress"),
        (2, 100, b"\xff" * 30, "lz4 frame does not decompress"),
    ],
)
def test_bad_frames_with_valid_crcs(codec: int, raw_len: int, stored: bytes, match: str) -> None:
    frame = make_frame(codec, raw_len, stored)
    with pytest.raises(ObjectFormatError, match=match):
        decode_frame_bytes(frame, ref_for(frame, run(0, 1)))


def test_bad_wal_content_with_valid_crcs() -> None:
    entries = run(0, 4)
    cases = {
        "kind 2": topic_frame(1, "t") + wal_bytes(entries),
        "do not increase": wal_bytes(entries) + wal_bytes(entries[3:]),
        "does not match": wal_bytes(entries[:3]),
        "frame body CRC": wal_bytes(entries)[:-1] + b"\0",
    }
    for match, raw in cases.items():
        frame = make_frame(0, len(raw), raw)
        with pytest.raises(ObjectFormatError, match=match) as info:
            decode_frame_bytes(frame, ref_for(frame, entries, position=1_000), "key")
        assert info.value.position is not None and info.value.position >= 1_000
    # In a compressed frame the position is the frame's, the reason names the byte inside.
    raw = cases["do not increase"]
    frame = make_frame(1, len(raw), zstandard.ZstdCompressor().compress(raw))
    with pytest.raises(ObjectFormatError, match=r"at byte \d+ of the frame's data") as info:
        decode_frame_bytes(frame, ref_for(frame, entries, position=1_000))
    assert info.value.position == 1_000


# -- fuzzing -----------------------------------------------------------------------------------

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
REFS = st.builds(FrameRef, st.text(max_size=5), U64, U64, U64, I64, I64, U64, U64)


def decodes_or_rejects(data: bytes) -> dict[str, list[tuple[object, ...]]] | None:
    try:
        return decode_all(data)
    except ObjectFormatError:
        return None


@SETTINGS
@given(data=st.binary(max_size=400), size=st.integers(-5, 2**40), ref=REFS)
def test_arbitrary_bytes_raise_only_object_format_error(
    data: bytes, size: int, ref: FrameRef
) -> None:
    decodes_or_rejects(data)
    for tail, object_size in ((data, size), (data, len(data))):
        with contextlib.suppress(ObjectFormatError):
            assert isinstance(read_footer(tail, object_size), Footer | int)
    with pytest.raises(ObjectFormatError):
        decode_frame_bytes(data, ref)
    frame = make_frame(ref.entries % 4, ref.position % 2**32, data)
    with pytest.raises(ObjectFormatError):
        decode_frame_bytes(frame, dataclasses.replace(ref, length=len(frame)))


OBJECTS = {codec: small_object(codec) for codec in CODECS}


@SETTINGS
@given(
    codec=st.sampled_from(CODECS),
    mutations=st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=4),
    cut=st.none() | st.integers(0, 2**16),
    extra=st.binary(max_size=8),
)
def test_mutated_objects_decode_the_same_or_raise(
    codec: str, mutations: list[tuple[int, int]], cut: int | None, extra: bytes
) -> None:
    original, entries = OBJECTS[codec]
    data = bytearray(original)
    for position, value in mutations:
        data[position % len(data)] = value
    if cut is not None:
        position = cut % len(data)
        data[position:position] = extra
    result = decodes_or_rejects(bytes(data))
    if result is not None:
        assert bytes(data) == original
        assert result == entries


@SETTINGS
@given(
    records=st.lists(
        st.tuples(
            st.text(max_size=3),
            st.lists(st.tuples(*[st.integers(0, 3)] * 3, st.integers(0, 60)), max_size=3),
        ),
        max_size=4,
    ),
    garbage=st.binary(max_size=2),
    size_delta=st.sampled_from([0, 0, 0, -1, 1, 10**6]),
)
def test_footers_with_valid_crcs_raise_only_object_format_error(
    records: list[tuple[str, list[tuple[int, int, int, int]]]], garbage: bytes, size_delta: int
) -> None:
    """Footers below the footer CRC (a writer bug, or a crafted object) are still validated."""
    footer = bytearray(struct.pack("<I", len(records)))
    position = HEADER_SIZE
    offset = 0
    for name, frames in records:
        name_b = name.encode()
        footer += struct.pack("<H", len(name_b)) + name_b + struct.pack("<I", len(frames))
        for gap, count, entries, length in frames:
            first = offset + gap
            offset = first + count
            footer += struct.pack("<QQIqqQI", first, offset, entries, 0, 0, position, length)
            position += length
    footer += garbage
    trailer = struct.pack("<II5sBH", len(footer), crc32c(footer), b"DNBIN", FORMAT_VERSION, 0)
    tail = bytes(footer) + struct.pack("<I", crc32c(trailer)) + trailer
    object_size = position + len(tail) + size_delta
    try:
        result = read_footer(tail[-object_size:], object_size)
    except ObjectFormatError:
        return
    assert isinstance(result, Footer)
    assert result.footer_position == position and size_delta == 0 and not garbage
    for span in result.topics.values():
        assert isinstance(span, TopicSpan) and span.frames
        assert span.entries <= span.last_offset - span.first_offset + 1


WAL_RUN = rich_entries(0) + run(3, 20)
WAL = wal_bytes(WAL_RUN, batch=5)


@SETTINGS
@given(
    codec=st.sampled_from([0, 1, 2]),
    mutations=st.lists(st.tuples(st.integers(0, len(WAL) - 1), st.integers(0, 255)), max_size=3),
    raw_delta=st.sampled_from([0, 0, 0, -1, 1, 1000]),
    entries=st.integers(1, len(WAL_RUN)),
)
def test_frames_with_valid_crcs_decode_exactly_or_raise(
    codec: int, mutations: list[tuple[int, int]], raw_delta: int, entries: int
) -> None:
    """Damage below the object CRC (a writer bug, or a crafted object): the WAL CRCs and the
    footer record still keep every decoded entry exact."""
    raw = bytearray(WAL)
    for position, value in mutations:
        raw[position] = value
    if codec == 1:
        stored = zstandard.ZstdCompressor().compress(raw)
    elif codec == 2:
        stored = lz4.block.compress(raw, store_size=False)
    else:
        stored = bytes(raw)
    frame = make_frame(codec, len(raw) + raw_delta, stored)
    ref = ref_for(frame, WAL_RUN[:entries])
    try:
        decoded = decode_frame_bytes(frame, ref)
    except ObjectFormatError:
        return
    assert raw == WAL and raw_delta == 0
    assert [fields(e) for e in decoded] == expected(WAL_RUN)


def _entries_from(start: int, end: int) -> list[Entry]:
    out = []
    for offset in range(start, end):
        entry = Entry(f"m{offset}".encode().ljust(120, b"."), producer_name="p")
        entry.offset = offset
        entry.ingest_ms = 5_000 + offset
        out.append(entry)
    return out


def test_add_frame_copies_frames_as_stored_and_checks_them() -> None:
    source = BinWriter("zstd", frame_target_bytes=1024)
    source.add_entries("/a/t", _entries_from(0, 40))
    data = source.finish()
    span = parse_object(data).topics["/a/t"]
    target = BinWriter("zstd", frame_target_bytes=1 << 20)
    for ref in span.frames:
        target.add_frame("/a/t", data[ref.position : ref.position + ref.length], ref)
    target.add_entries("/a/t", _entries_from(40, 45))  # a new frame after the copied ones
    copy = target.finish()
    copied = parse_object(copy).topics["/a/t"]
    assert len(copied.frames) == len(span.frames) + 1
    decoded = [
        e.offset
        for ref in copied.frames
        for e in decode_frame_bytes(copy[ref.position : ref.position + ref.length], ref)
    ]
    assert decoded == list(range(45))
    stored = [data[r.position : r.position + r.length] for r in span.frames]
    assert [copy[r.position : r.position + r.length] for r in copied.frames[:-1]] == stored

    again = BinWriter("zstd")
    ref = span.frames[0]
    damaged = bytearray(data[ref.position : ref.position + ref.length])
    damaged[-1] ^= 0x01
    with pytest.raises(ObjectFormatError, match="CRC"):
        again.add_frame("/a/t", bytes(damaged), ref)
    again.add_frame("/a/t", data[ref.position : ref.position + ref.length], ref)
    with pytest.raises(ValueError, match="does not follow"):
        again.add_frame("/a/t", data[ref.position : ref.position + ref.length], ref)
