"""Tests for danube_ingest.wal.framing: round-trips, and damage raising only FrameError."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable

import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from danube_ingest.errors import CorruptFrameError, FrameError, TruncatedFrameError
from danube_ingest.wal.framing import (
    BATCH_HEADER_SIZE,
    FORMAT_VERSION,
    MAX_FRAME_BODY,
    PREFIX_SIZE,
    Entry,
    Kind,
    batch_header,
    checkpoint_frame,
    decode_checkpoint,
    decode_drop,
    decode_frame,
    decode_messages,
    decode_time,
    decode_topic,
    drop_frame,
    encode_frame,
    frame_pieces,
    iter_frames,
    messages_frame,
    time_frame,
    topic_frame,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U16 = st.integers(0, 2**16 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
# Full unicode (astral planes included); hypothesis never generates lone surrogates here.
TEXT = st.text(max_size=24)

ENTRIES = st.builds(
    Entry,
    payload=st.binary(max_size=96),
    publish_ms=I64,
    producer_name=TEXT,
    routing_key=st.none() | TEXT,
    attributes=st.none() | st.dictionaries(TEXT, TEXT, max_size=4),
    schema_id=st.none() | U64,
    schema_version=U32,
    producer_id=U64,
    request_id=U64,
    ingest_ms=I64,
)


def fields(entry: Entry) -> tuple[object, ...]:
    """Every field of an entry, exactly (unlike Entry.__eq__, 0 and None differ here)."""
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
        type(entry.payload),
        entry.payload,
    )


def expected_fields(entry: Entry, offset: int) -> tuple[object, ...]:
    """What decoding ``entry`` at ``offset`` must give back."""
    # An empty attribute map and no map are both encoded as attribute_count 0.
    return (
        offset,
        entry.ingest_ms,
        entry.publish_ms,
        entry.producer_name,
        entry.routing_key,
        entry.attributes or None,
        entry.schema_id,
        entry.schema_version,
        entry.producer_id,
        entry.request_id,
        bytes,
        bytes(entry.payload),
    )


def frame_bytes(kind: int, body: bytes) -> bytes:
    return b"".join(frame_pieces(kind, [body]))


def raw_prefix(length: int, kind: int, version: int = FORMAT_VERSION, body_crc: int = 0) -> bytes:
    """A frame prefix with a valid header CRC over arbitrary (possibly invalid) fields."""
    head = struct.pack("<IBBHI", length, kind, version, 0, body_crc)
    return head + crc32c(head).to_bytes(4, "little")


# -- round trips -----------------------------------------------------------------------------


@SETTINGS
@given(
    topic_id=U32,
    base_offset=U64,
    entries=st.lists(ENTRIES, min_size=1, max_size=8),
)
def test_messages_frame_round_trips(topic_id: int, base_offset: int, entries: list[Entry]) -> None:
    frame = b"".join(messages_frame(topic_id, base_offset, entries))

    info = decode_frame(frame)
    assert (info.position, info.kind, info.end) == (0, Kind.MESSAGES, len(frame))
    header, decoded = decode_messages(info.body)

    assert header.topic_id == topic_id
    assert header.base_offset == base_offset
    assert header.num_entries == len(entries)
    assert header.first_ingest_ms == entries[0].ingest_ms
    assert header.last_ingest_ms == entries[-1].ingest_ms
    assert batch_header(info.body) == header
    assert [fields(e) for e in decoded] == [
        expected_fields(e, base_offset + i) for i, e in enumerate(entries)
    ]
    for original, copy in zip(entries, decoded, strict=True):
        original.offset = copy.offset
        assert copy == original


@SETTINGS
@given(
    entries=st.lists(ENTRIES, min_size=1, max_size=8),
    skip=st.integers(-1, 9),
    limit=st.one_of(st.none(), st.integers(-1, 9)),
)
def test_decode_messages_of_a_range_is_that_slice(
    entries: list[Entry], skip: int, limit: int | None
) -> None:
    # The cache decodes only the entries a read asks for; the others are walked over.
    body = decode_frame(b"".join(messages_frame(3, 50, entries))).body
    _, every = decode_messages(body)
    start = min(max(skip, 0), len(every))
    stop = len(every) if limit is None else start + max(limit, 0)
    _, some = decode_messages(bytes(body), skip, limit)
    assert some == every[start:stop]
    assert [e.offset for e in some] == list(range(50 + start, 50 + min(stop, len(every))))
    # A body cut short still fails, whichever part of it is decoded.
    with pytest.raises(CorruptFrameError):
        decode_messages(bytes(body)[:-1], skip, None)


def test_messages_frame_keeps_empty_strings_distinct_from_none() -> None:
    entries = [
        Entry(b"", routing_key="", schema_id=0, producer_name=""),
        Entry(b"", routing_key=None, schema_id=None),
    ]
    frame = b"".join(messages_frame(1, 0, entries))
    _, decoded = decode_messages(decode_frame(frame).body)
    assert (decoded[0].routing_key, decoded[0].schema_id) == ("", 0)
    assert (decoded[1].routing_key, decoded[1].schema_id) == (None, None)
    assert decoded[0].payload == decoded[1].payload == b""


def test_large_frame_round_trips_without_copying_large_payloads() -> None:
    # Over the 1 MiB join limit, parts of 64 KiB or more are passed through as they are.
    big = [bytes([i]) * (96 * 1024) for i in range(12)]
    entries = [Entry(p, producer_name="p", attributes={"i": str(i)}) for i, p in enumerate(big)]
    entries.insert(5, Entry(b"small", routing_key="k"))
    pieces = messages_frame(9, 1000, entries)

    for payload in big:
        assert any(piece is payload for piece in pieces)
    frame = b"".join(pieces)
    info = decode_frame(frame)
    header, decoded = decode_messages(info.body)
    assert header.num_entries == len(entries)
    assert [fields(e) for e in decoded] == [
        expected_fields(e, 1000 + i) for i, e in enumerate(entries)
    ]


def test_frame_body_over_the_maximum_is_refused_before_copying() -> None:
    part = b"\0" * (1024 * 1024)
    parts = [part] * (MAX_FRAME_BODY // len(part) + 1)  # 257 references, one buffer
    with pytest.raises(CorruptFrameError):
        frame_pieces(Kind.MESSAGES, parts)


@SETTINGS
@given(topic_id=U32, name=st.text(max_size=64))
def test_topic_frame_round_trips(topic_id: int, name: str) -> None:
    info = decode_frame(topic_frame(topic_id, name))
    assert info.kind == Kind.TOPIC
    assert decode_topic(info.body) == (topic_id, name)


@SETTINGS
@given(topic_id=U32, next_offset=U64, ingest_ms=I64)
def test_time_frame_round_trips(topic_id: int, next_offset: int, ingest_ms: int) -> None:
    info = decode_frame(time_frame(topic_id, next_offset, ingest_ms))
    assert info.kind == Kind.TIME
    assert decode_time(info.body) == (topic_id, next_offset, ingest_ms)


@SETTINGS
@given(seq=U64, created_ms=I64, region=st.text(max_size=64))
def test_checkpoint_frame_round_trips(seq: int, created_ms: int, region: str) -> None:
    info = decode_frame(checkpoint_frame(seq, created_ms, region))
    assert info.kind == Kind.CHECKPOINT
    assert decode_checkpoint(info.body) == (seq, created_ms, region)


FRAMES = st.one_of(
    st.builds(topic_frame, U32, TEXT),
    st.builds(time_frame, U32, U64, I64),
    st.builds(checkpoint_frame, U64, I64, TEXT),
    st.builds(
        lambda t, b, es: b"".join(messages_frame(t, b, es)),
        U32,
        U64,
        st.lists(ENTRIES, min_size=1, max_size=3),
    ),
    st.builds(encode_frame, st.sampled_from(list(Kind)), st.binary(max_size=64)),
)


@SETTINGS
@given(frames=st.lists(FRAMES, max_size=10), lead=st.binary(max_size=8))
def test_iter_frames_walks_a_concatenation(frames: list[bytes], lead: bytes) -> None:
    buf = lead + b"".join(frames)

    decoded = list(iter_frames(buf, len(lead)))

    assert len(decoded) == len(frames)
    position = len(lead)
    for info, frame in zip(decoded, frames, strict=True):
        assert info.position == position
        assert info.end == position + len(frame)
        assert info.kind == frame[4]
        assert bytes(info.body) == frame[PREFIX_SIZE:]
        assert decode_frame(buf, position) == info
        position = info.end


@SETTINGS
@given(frames=st.lists(FRAMES, min_size=1, max_size=5), data=st.data())
def test_iter_frames_yields_complete_frames_then_raises_truncated(
    frames: list[bytes], data: st.DataObject
) -> None:
    buf = b"".join(frames)
    ends = []
    position = 0
    for frame in frames:
        position += len(frame)
        ends.append(position)
    cut = data.draw(st.integers(1, len(buf) - 1), label="cut")
    complete = [end for end in ends if end <= cut]

    seen = []
    if cut in ends:
        seen = [info.end for info in iter_frames(buf[:cut])]
    else:
        with pytest.raises(TruncatedFrameError) as caught:
            for info in iter_frames(buf[:cut]):
                seen.append(info.end)
        assert caught.value.position == (complete[-1] if complete else 0)
    assert seen == complete


# -- damage ----------------------------------------------------------------------------------

BODY_DECODERS: list[Callable[[bytes | memoryview], object]] = [
    decode_messages,
    decode_topic,
    decode_time,
    decode_checkpoint,
    decode_drop,
    batch_header,
]


def assert_decoders_raise_only_corrupt(body: bytes | memoryview) -> None:
    """Each body decoder either decodes ``body`` or raises CorruptFrameError, nothing else."""
    for decode in BODY_DECODERS:
        with contextlib.suppress(CorruptFrameError):
            decode(body)


def sample_frames() -> list[bytes]:
    """One small frame of every kind; the MESSAGES one uses every optional field."""
    entries = [
        Entry(
            b"payload",
            publish_ms=-5,
            producer_name="pr\u00f6d",
            routing_key="k\u00e9y",
            attributes={"a": "1", "\u00df": "\U0001f600"},
            schema_id=7,
            schema_version=3,
            producer_id=11,
            request_id=12,
            ingest_ms=99,
        ),
        Entry(b"", ingest_ms=100),
    ]
    return [
        b"".join(messages_frame(3, 40, entries)),
        topic_frame(3, "t\u00f6pic"),
        time_frame(3, 42, 1234),
        checkpoint_frame(5, 6789, "r\u00e9gion"),
        drop_frame(3, 42),
    ]


@SETTINGS
@given(buf=st.binary(max_size=300), position=st.integers(0, 320))
def test_arbitrary_bytes_raise_only_frame_errors(buf: bytes, position: int) -> None:
    try:
        info = decode_frame(buf, position)
    except TruncatedFrameError as exc:
        assert exc.position == position
        return
    except CorruptFrameError as exc:
        assert len(buf) - position >= PREFIX_SIZE  # a short buffer is truncated, not corrupt
        assert exc.position == position
        return
    assert_decoders_raise_only_corrupt(info.body)


@SETTINGS
@given(buf=st.binary(max_size=300))
def test_iter_frames_over_arbitrary_bytes_raises_only_frame_errors(buf: bytes) -> None:
    try:
        for info in iter_frames(buf):
            assert_decoders_raise_only_corrupt(info.body)
    except FrameError as exc:
        assert isinstance(exc, TruncatedFrameError | CorruptFrameError)


@SETTINGS
@given(body=st.binary(max_size=400))
def test_body_decoders_on_arbitrary_bodies_raise_only_corrupt(body: bytes) -> None:
    assert_decoders_raise_only_corrupt(body)
    assert_decoders_raise_only_corrupt(memoryview(body))


@SETTINGS
@given(kind=st.sampled_from(list(Kind)), body=st.binary(max_size=200))
def test_crc_valid_frames_with_arbitrary_bodies_decode_or_raise_corrupt(
    kind: Kind, body: bytes
) -> None:
    # Past both CRCs: only the body decoders stand between garbage and the caller.
    info = decode_frame(frame_bytes(kind, body))
    assert bytes(info.body) == body
    assert_decoders_raise_only_corrupt(info.body)


@SETTINGS
@given(frame=st.sampled_from(sample_frames()), data=st.data())
def test_mutated_bodies_decode_or_raise_corrupt(frame: bytes, data: st.DataObject) -> None:
    body = bytearray(frame[PREFIX_SIZE:])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=4))
        body[at : at + len(chunk)] = chunk
    assert_decoders_raise_only_corrupt(bytes(body))


@SETTINGS
@given(
    count=st.sampled_from([0, 1, 2, 1000, 2**31, 2**32 - 1]),
    lengths=st.lists(st.sampled_from([0, 1, 7, 2**15, 2**16 - 1]), min_size=4, max_size=4),
    payload_len=st.sampled_from([0, 1, 7, 2**31, 2**32 - 1]),
    flags=st.integers(0, 255),
    tail=st.binary(max_size=64),
)
def test_messages_body_with_huge_counts_and_lengths_decodes_or_raises_corrupt(
    count: int, lengths: list[int], payload_len: int, flags: int, tail: bytes
) -> None:
    name_len, key_len, attr_count, _ = lengths
    entry = struct.pack(
        "<qqQQQIBHHHI", 1, 2, 3, 4, 5, 6, flags, name_len, key_len, attr_count, payload_len
    )
    body = struct.pack("<IQIqq", 1, 0, count, 0, 0) + entry + tail
    assert_decoders_raise_only_corrupt(body)


def test_messages_body_claiming_four_billion_entries_is_corrupt_at_once() -> None:
    one = b"".join(messages_frame(1, 0, [Entry(b"x")]))[PREFIX_SIZE:]
    body = struct.pack("<IQIqq", 1, 0, 2**32 - 1, 0, 0) + one[BATCH_HEADER_SIZE:]
    with pytest.raises(CorruptFrameError):
        decode_messages(body)


def test_every_single_byte_flip_is_corrupt() -> None:
    lead = topic_frame(1, "lead")  # so that positions are not all zero
    for frame in sample_frames():
        buf = bytearray(lead + frame)
        for at in range(len(lead), len(buf)):
            for mask in (0x01, 0x80, 0xFF):
                buf[at] ^= mask
                with pytest.raises(CorruptFrameError) as caught:
                    decode_frame(buf, len(lead))
                assert caught.value.position == len(lead)
                with pytest.raises(CorruptFrameError):
                    list(iter_frames(buf))
                buf[at] ^= mask
        assert decode_frame(buf, len(lead)).end == len(buf)


def test_truncation_at_every_length_is_truncated() -> None:
    lead = time_frame(1, 2, 3)
    for frame in sample_frames():
        buf = lead + frame
        for end in range(len(lead), len(buf)):
            with pytest.raises(TruncatedFrameError) as caught:
                decode_frame(buf[:end], len(lead))
            assert caught.value.position == len(lead)
            if end == len(lead):
                continue  # the lead frame alone is a complete buffer
            seen = []
            with pytest.raises(TruncatedFrameError):
                for info in iter_frames(buf[:end]):
                    seen.append(info.position)
            assert seen == [0]


def test_every_strict_prefix_or_extension_of_a_body_is_corrupt() -> None:
    decoders = {
        Kind.MESSAGES: decode_messages,
        Kind.TOPIC: decode_topic,
        Kind.TIME: decode_time,
        Kind.CHECKPOINT: decode_checkpoint,
        Kind.DROP: decode_drop,
    }
    for frame in sample_frames():
        info = decode_frame(frame)
        body = bytes(info.body)
        decode = decoders[Kind(info.kind)]
        decode(body)
        for end in range(len(body)):
            with pytest.raises(CorruptFrameError):
                decode(body[:end])
        with pytest.raises(CorruptFrameError):
            decode(body + b"\0")


@pytest.mark.parametrize(
    ("length", "kind", "version"),
    [
        (0, 0, FORMAT_VERSION),
        (0, 6, FORMAT_VERSION),  # the first kind after DROP (5)
        (0, 255, FORMAT_VERSION),
        (0, Kind.TOPIC, 0),
        (0, Kind.TOPIC, FORMAT_VERSION + 1),
        (MAX_FRAME_BODY + 1, Kind.MESSAGES, FORMAT_VERSION),
        (2**32 - 1, Kind.MESSAGES, FORMAT_VERSION),
    ],
)
def test_crc_valid_header_with_invalid_fields_is_corrupt(
    length: int, kind: int, version: int
) -> None:
    buf = raw_prefix(length, kind, version, crc32c(b"")) + b"\0" * 64
    with pytest.raises(CorruptFrameError):
        decode_frame(buf)


def test_crc_valid_header_longer_than_the_buffer_is_truncated() -> None:
    body = b"x" * 100
    buf = raw_prefix(len(body), Kind.TOPIC, body_crc=crc32c(body)) + body[:99]
    with pytest.raises(TruncatedFrameError):
        decode_frame(buf)


def test_short_messages_body_is_corrupt() -> None:
    for size in range(BATCH_HEADER_SIZE):
        with pytest.raises(CorruptFrameError):
            batch_header(b"\0" * size)
