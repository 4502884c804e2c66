"""Fuzzing the WAL's decoders: frames, frame bodies, segment scans, recovery, entry blocks and
the region snapshot.

Properties, for arbitrary bytes and for mutations of valid frames (bit flips, truncations,
inserted bytes, a length field that lies under a valid header CRC): every decoder either
returns what was written or raises our error class (``FrameError`` for frames,
``InvalidEntryError`` for entry blocks, ``WalCorruptionError`` for a region), never another
exception type; damage followed by an intact frame is told from a torn tail; a snapshot that
does not decode is ignored, never an exception. Inputs are at most ``MAX_INPUT`` bytes, so a
length field is the only way to ask for a large allocation, and the decoders must refuse it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from danube_ingest.errors import (
    CorruptFrameError,
    FrameError,
    InvalidEntryError,
    WalCorruptionError,
)
from danube_ingest.wal import recover_region, verify_region
from danube_ingest.wal.block import BlockLimits, check_block, encode_block
from danube_ingest.wal.framing import (
    PREFIX_SIZE,
    Entry,
    Kind,
    checkpoint_frame,
    decode_checkpoint,
    decode_drop,
    decode_frame,
    decode_messages,
    decode_time,
    decode_topic,
    drop_frame,
    iter_frames,
    messages_frame,
    time_frame,
    topic_frame,
)
from danube_ingest.wal.meta import SNAPSHOT_MAGIC, SNAPSHOT_NAME, read_snapshot
from danube_ingest.wal.segment import scan, segment_path

from .support import MAX_INPUT, budget, json_values

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

BODY_DECODERS: dict[int, Callable[[Any], Any]] = {
    Kind.MESSAGES: decode_messages,
    Kind.TOPIC: decode_topic,
    Kind.TIME: decode_time,
    Kind.CHECKPOINT: decode_checkpoint,
    Kind.DROP: decode_drop,
}

u32 = st.integers(0, (1 << 32) - 1)
u64 = st.integers(0, (1 << 64) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
#: Entry counts at the edges of the u32 field, and a few plausible ones.
edge_counts = st.sampled_from([-1, 0, 1, 2, 3, 4, 5, 1000, (1 << 32) - 1, 1 << 32])
short_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    return Entry(
        draw(st.binary(max_size=64)),
        publish_ms=draw(i64),
        producer_name=draw(short_text),
        routing_key=draw(st.none() | short_text),
        attributes=draw(st.none() | st.dictionaries(short_text, short_text, max_size=3)) or None,
        schema_id=draw(st.none() | u64),
        schema_version=draw(u32),
        producer_id=draw(u64),
        request_id=draw(u64),
        ingest_ms=draw(i64),
    )


def _frame_bytes(pieces: list[bytes] | bytes) -> bytes:
    return pieces if isinstance(pieces, bytes) else b"".join(pieces)


@st.composite
def frames(draw: st.DrawFn) -> tuple[int, bytes, Any]:
    """One valid frame: ``(kind, bytes, what its body decodes to)``."""
    kind = draw(st.sampled_from(list(Kind)))
    if kind == Kind.MESSAGES:
        batch = draw(st.lists(entries(), min_size=1, max_size=4))
        base = draw(st.integers(0, 1 << 40))
        for i, entry in enumerate(batch):
            entry.offset = base + i
        return kind, _frame_bytes(messages_frame(draw(u32), base, batch)), batch
    if kind == Kind.TOPIC:
        value: tuple[Any, ...] = (draw(u32), "/default/" + draw(short_text))
        return kind, topic_frame(*value), value
    if kind == Kind.TIME:
        value = (draw(u32), draw(u64), draw(i64))
        return kind, time_frame(*value), value
    if kind == Kind.CHECKPOINT:
        value = (draw(u64), draw(i64), draw(short_text))
        return kind, checkpoint_frame(*value), value
    value = (draw(u32), draw(u64))
    return kind, drop_frame(*value), value


def decoded(kind: int, body: Any) -> Any:
    value = BODY_DECODERS[kind](body)
    return value[1] if kind == Kind.MESSAGES else value


def only(errors: tuple[type[BaseException], ...], call: Callable[[], Any]) -> Any:
    """``call()``; an exception other than ``errors`` fails the test (pytest shows it)."""
    try:
        return call()
    except errors:
        return None


@st.composite
def mutations(draw: st.DrawFn, data: bytes, framed: bool = True) -> tuple[str, bytes, int]:
    """``(how, mutated data, first damaged byte)``; ``framed``: ``data`` is WAL frames (a
    frame's length field may then lie)."""
    how = draw(st.sampled_from(["flip", "truncate", "insert", "length"][: 4 if framed else 3]))
    at = draw(st.integers(0, len(data) - 1))
    if how == "flip":
        out = bytearray(data)
        out[at] ^= 1 << draw(st.integers(0, 7))
        return how, bytes(out), at
    if how == "truncate":
        return how, data[:at], at
    if how == "insert":
        junk = draw(st.binary(min_size=1, max_size=32))
        return how, data[:at] + junk + data[at:], at
    # A lying length under a valid header CRC: the check a garbage length would pass 2**-32 of
    # the time, forced. The frame at ``at`` (rounded down to a frame start) gets the new length.
    starts = [f.position for f in iter_frames(data)]
    at = max(s for s in starts if s <= at)
    length = draw(st.sampled_from([0, 1, 15, 1 << 20, (1 << 28) + 1, (1 << 32) - 1]) | u32)
    out = bytearray(data)
    struct.pack_into("<I", out, at, length)
    struct.pack_into("<I", out, at + 12, crc32c(bytes(out[at : at + 12])))
    return how, bytes(out), at


# -- arbitrary bytes --------------------------------------------------------------------------


@budget(300)
@given(data=st.binary(max_size=MAX_INPUT), position=st.integers(0, 64))
def test_arbitrary_bytes_raise_only_frame_errors(data: bytes, position: int) -> None:
    only((FrameError,), lambda: decode_frame(data, min(position, len(data))))
    only((FrameError,), lambda: list(iter_frames(data)))
    result = scan(data)
    assert result.valid_end <= len(data)
    assert (result.error is None) == (result.valid_end == len(data))


@budget(300)
@given(kind=st.sampled_from(list(Kind)), body=st.binary(max_size=MAX_INPUT))
def test_arbitrary_bodies_raise_only_corrupt_frame(kind: int, body: bytes) -> None:
    only((CorruptFrameError,), lambda: BODY_DECODERS[kind](body))


@budget(200)
@given(
    header=st.tuples(u32, u64, u32, i64, i64),
    tail=st.binary(max_size=MAX_INPUT),
    skip=st.integers(-2, 8),
    limit=st.none() | st.integers(-2, 8),
)
def test_messages_bodies_with_lying_counts(
    header: tuple[int, int, int, int, int], tail: bytes, skip: int, limit: int | None
) -> None:
    """A MESSAGES body whose entry count and entry lengths lie (a CRC-valid body from a buggy
    writer): CorruptFrameError or entries that lie inside the body."""
    body = struct.pack("<IQIqq", *header) + tail
    result = only((CorruptFrameError,), lambda: decode_messages(body, skip, limit))
    if result is not None:
        assert sum(len(e.payload) for e in result[1]) <= len(tail)


# -- mutations of valid frames ------------------------------------------------------------------


@budget(300)
@given(written=st.lists(frames(), min_size=1, max_size=5), data=st.data())
def test_mutated_frames_decode_as_written_or_raise(
    written: list[tuple[int, bytes, Any]], data: st.DataObject
) -> None:
    original = b"".join(raw for _, raw, _ in written)
    starts: dict[int, tuple[int, bytes, Any]] = {}
    position = 0
    for frame in written:
        starts[position] = frame
        position += len(frame[1])
    how, damaged, at = data.draw(mutations(original))

    result = scan(damaged)
    for frame in result.frames:
        kind, raw, value = starts[frame.position]
        # Every frame that decodes is one that was written, whole, at that position.
        assert (frame.kind, bytes(frame.body)) == (kind, raw[PREFIX_SIZE:])
        assert decoded(frame.kind, frame.body) == value
    assert result.valid_end <= at or damaged == original

    # The first damaged frame, if not the last, is followed by an intact one that a re-sync
    # finds: damage in the middle is never taken for a torn tail.
    damaged_start = max(s for s in starts if s <= at)
    following = [s for s in starts if s > damaged_start]
    if how == "flip" and following and result.error is not None:
        assert result.resync_position == following[0], (how, at, [k for k, _, _ in written])


# -- recovery of a whole segment ----------------------------------------------------------------


@st.composite
def segments(draw: st.DrawFn) -> tuple[bytes, dict[str, int]]:
    """A segment as the log writes it, and each topic's next offset (a dropped topic's too:
    damage may cut its DROP frame off)."""
    out = [checkpoint_frame(0, 1_000, "r")]
    next_offsets: dict[str, int] = {}
    for topic_id in range(1, draw(st.integers(1, 3)) + 1):
        name = f"/default/t{topic_id}"
        out.append(topic_frame(topic_id, name))
        offset = 0
        for _ in range(draw(st.integers(0, 3))):
            batch = draw(st.lists(entries(), min_size=1, max_size=3))
            for entry in batch:
                entry.ingest_ms = 1_000
            out.append(_frame_bytes(messages_frame(topic_id, offset, batch)))
            offset += len(batch)
            if draw(st.booleans()):
                out.append(time_frame(topic_id, offset, 1_000))
        next_offsets[name] = offset
        if draw(st.booleans()):
            out.append(drop_frame(topic_id, offset))
    return b"".join(out), next_offsets


@pytest.fixture(scope="module")
def region_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("regions")


@budget(150)
@given(segment=segments(), data=st.data())
def test_recovery_of_a_damaged_segment(
    region_root: Path, segment: tuple[bytes, dict[str, int]], data: st.DataObject
) -> None:
    """A region whose only segment is damaged: ``verify_region`` reports, ``recover_region``
    recovers a prefix of what was written or raises WalCorruptionError; nothing else."""
    original, next_offsets = segment
    _how, damaged, _at = data.draw(mutations(original))
    region = region_root / "r"
    shutil.rmtree(region, ignore_errors=True)
    region.mkdir()
    segment_path(region, 0).write_bytes(damaged)
    report = verify_region(region)
    for topic, (_first, nxt) in report.topics.items():
        assert topic in next_offsets and nxt <= next_offsets[topic]
    try:
        state = recover_region(region)
    except WalCorruptionError:
        assert not report.ok or report.torn_tail is None
        return
    for name, topic in state.topics.items():
        assert name in next_offsets and topic.next_offset <= next_offsets[name]


#: What a snapshot's fields may hold: right-looking values and odd ones.
snapshot_values = (
    st.sampled_from([0, 1, -1, "r", [], {}, [0], {"1": 0}, {"x": "y"}, float("inf"), 1.5])
    | json_values
)


@st.composite
def topic_docs(draw: st.DrawFn) -> Any:
    """A snapshot's topic entry (``TopicMeta.to_json``) with odd values in some fields."""
    doc: dict[str, Any] = {
        "name": "/default/t",
        "id": 1,
        "next_offset": 3,
        "first_offset": 0,
        "last_ingest_ms": 1_000,
        "prune_mark": None,
        "spans": [[0, 0, 2, 1_000, 1_000, [[0, 35]]]],
        "producers": {},
    }
    for name in draw(st.lists(st.sampled_from(sorted(doc)), min_size=1, max_size=2)):
        doc[name] = draw(snapshot_values)
    return doc


@st.composite
def snapshot_docs(draw: st.DrawFn) -> Any:
    """A snapshot document: our fields, some of them odd or missing, or any JSON."""
    if draw(st.integers(0, 4)) == 0:
        return draw(json_values)
    doc: dict[str, Any] = {
        "version": 1,
        "region": "r",
        "next_seq": 1,
        "next_topic_id": 2,
        "uploaded": [],
        "dropped": {},
        "topics": draw(st.lists(topic_docs(), min_size=1, max_size=2)),
    }
    for name in draw(st.lists(st.sampled_from(sorted(doc)), max_size=2)):
        if draw(st.booleans()):
            doc[name] = draw(snapshot_values)
        else:
            doc.pop(name, None)
    return doc


@budget(200)
@given(doc=snapshot_docs(), good_crc=st.booleans(), raw=st.binary(max_size=64))
def test_snapshot_that_does_not_decode_is_ignored(
    region_root: Path, doc: Any, good_crc: bool, raw: bytes
) -> None:
    """``read_snapshot`` returns a snapshot or None for any file (a CRC-valid snapshot whose
    JSON is not ours included), and recovery of a region with that snapshot raises nothing
    but our errors."""
    region = region_root / "s"
    shutil.rmtree(region, ignore_errors=True)
    region.mkdir()
    body = raw if len(raw) % 4 == 1 else json.dumps(doc).encode()
    crc = crc32c(body) if good_crc else crc32c(body) ^ 1
    header = f"{SNAPSHOT_MAGIC} {crc:08x} {len(body)}\n".encode()
    (region / SNAPSHOT_NAME).write_bytes(header + body)
    segment_path(region, 0).write_bytes(
        checkpoint_frame(0, 1_000, "r") + topic_frame(1, "/default/t")
    )
    read_snapshot(region)
    only((WalCorruptionError,), lambda: recover_region(region))


# -- entry blocks (the batch path's input) ------------------------------------------------------

LIMITS = BlockLimits(max_payload_bytes=1024, max_attributes=4)


@budget(200)
@given(block=st.binary(max_size=MAX_INPUT), sizes=st.binary(max_size=64), count=edge_counts)
def test_arbitrary_blocks_raise_only_invalid_entry(block: bytes, sizes: bytes, count: int) -> None:
    only((InvalidEntryError,), lambda: check_block(bytearray(block), sizes, count, LIMITS))


@budget(300)
@given(batch=st.lists(entries(), min_size=1, max_size=4), data=st.data())
def test_mutated_blocks_decode_as_checked_or_raise(batch: list[Entry], data: st.DataObject) -> None:
    """A block (or its size table) with bytes flipped, cut or inserted: check_block refuses it
    with InvalidEntryError, or accepts it and then it decodes into exactly ``count`` entries."""
    block, sizes = encode_block(batch)
    target = data.draw(st.sampled_from(["block", "sizes", "count"]))
    count = len(batch)
    if target == "block":
        block = data.draw(mutations(block, framed=False))[1]
    elif target == "sizes":
        sizes = data.draw(mutations(sizes, framed=False))[1]
    else:
        count = data.draw(edge_counts)
    checked = only(
        (InvalidEntryError,), lambda: check_block(bytearray(block), sizes, count, LIMITS)
    )
    if checked is not None:
        body = struct.pack("<IQIqq", 1, 0, count, 0, 0) + bytes(checked.data)
        assert len(decode_messages(body)[1]) == count
