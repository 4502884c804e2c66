"""Recovery, verification and repair of a region's segment files.

Recovery loads the RegionMeta snapshot, then scans the segments written after it, verifying
every frame's CRC32C and rebuilding per-topic offsets and the sparse index. Damage in the
newest segment with no valid frame after it is a torn tail (a crash during a write that was
never acknowledged) and is truncated. Any other damage is corruption: recovery refuses to open
and names the file and byte position. ``verify_region`` reports without changing anything;
``repair_region`` truncates at the first damage, moving what it cuts into ``quarantine/``.

An offset gap (a topic's frame starting past the offset its previous frame ended at, both
verifying) is not damage: those offsets were assigned and never written, so nothing in them was
acknowledged. Recovery passes over them as over an offset jump (readers skip them), logs and
reports them (``RegionState.gaps``); repair keeps every frame around them.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crc32c import crc32c

from danube_ingest.errors import (
    CorruptFrameError,
    FrameError,
    TruncatedFrameError,
    WalCorruptionError,
)
from danube_ingest.wal.framing import (
    BATCH_HEADER_SIZE,
    FORMAT_VERSION,
    MAX_FRAME_BODY,
    PREFIX_SIZE,
    Kind,
    batch_header,
    decode_checkpoint,
    decode_drop,
    decode_frame,
    decode_time,
    decode_topic,
)
from danube_ingest.wal.meta import ProducerBatch, TopicMeta, fsync_dir, read_snapshot
from danube_ingest.wal.segment import (
    SegmentReader,
    SegmentWindow,
    find_valid_frame,
    list_segments,
    segment_path,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffsetGap:
    """Offsets ``[expected, found)`` of ``topic`` that are in no frame: the frame at ``position``
    of ``path`` starts at ``found`` where the topic's previous frame ended at ``expected``."""

    topic: str
    expected: int
    found: int
    path: str
    position: int

    def __str__(self) -> str:
        return (
            f"offset gap in topic {self.topic}: offsets {self.expected}..{self.found - 1} are in "
            f"no frame ({self.path} at byte {self.position}); never written, so never "
            f"acknowledged; readers skip them"
        )


@dataclass
class RegionState:
    """Per-topic state rebuilt from a region's snapshot and segments."""

    topics: dict[str, TopicMeta] = field(default_factory=dict)
    next_topic_id: int = 1
    segments: dict[int, int] = field(default_factory=dict)
    """seq -> size in bytes of every segment on disk (all sealed after recovery)."""
    uploaded: set[int] = field(default_factory=set)
    dropped: dict[int, int] = field(default_factory=dict)
    """topic id -> seq of the segment holding its DROP frame, while some segment at or below
    that seq may still hold frames of the dropped topic (see ``Kind.DROP``)."""
    truncated: list[tuple[str, int, int]] = field(default_factory=list)
    """(path, position, bytes removed) for each torn tail that was cut."""
    gaps: list[OffsetGap] = field(default_factory=list)
    """Offset gaps passed over (see :class:`OffsetGap`)."""
    frames_scanned: int = 0
    bytes_scanned: int = 0
    used_seq: int = 0
    """Sequence numbers below this were used, even if their files are gone (never reuse one:
    a sealed segment may have been uploaded under its number)."""

    @property
    def next_seq(self) -> int:
        return max(self.used_seq, max(self.segments) + 1 if self.segments else 0)


# The scan of a segment is recovery's hot loop: it verifies and applies each frame in place,
# without building a FrameInfo, a BatchHeader, a body view or a list per frame. It unpacks the
# frame prefix (see the framing module docstring) itself, reading kind and version as one u16
# (kind | version << 8) and skipping the reserved u16 (decode_frame does not check it either),
# with one call together with the batch header that follows it in a MESSAGES frame (all of it
# but first_ingest_ms, which only a topic's first frame in a segment needs).
_PREFIX = struct.Struct("<IH2xII")
_FRAME = struct.Struct("<IH2xII" + "IQI8xq")
_FIRST_MS = struct.Struct("<q")
_FIRST_MS_OFFSET = 16  # of first_ingest_ms in the batch header
assert _PREFIX.size == PREFIX_SIZE and _FRAME.size == PREFIX_SIZE + BATCH_HEADER_SIZE

_MESSAGES = int(Kind.MESSAGES) | FORMAT_VERSION << 8
_TOPIC = int(Kind.TOPIC) | FORMAT_VERSION << 8
_TIME = int(Kind.TIME) | FORMAT_VERSION << 8
_CHECKPOINT = int(Kind.CHECKPOINT) | FORMAT_VERSION << 8
_DROP = int(Kind.DROP) | FORMAT_VERSION << 8
_VALID = frozenset(int(kind) | FORMAT_VERSION << 8 for kind in Kind)
_NOT_CHECKPOINT = "segment does not start with a CHECKPOINT frame"

# An idempotent producer's batch is a frame of its own whose entries carry the producer id
# (bit 63 set) and the batch sequence: recovery reads them from the first entry.
_FIRST_PRODUCER = struct.Struct("<QQ")
_PRODUCER_AT = BATCH_HEADER_SIZE + 16  # the first entry's producer_id in a MESSAGES body
_PRODUCER_BYTE = _PRODUCER_AT + 7  # its most significant byte
_PRODUCER_END = _PRODUCER_AT + _FIRST_PRODUCER.size


def _note_producer(topic: TopicMeta, data: Any, start: int, base: int, count: int) -> None:
    """Rebuild an idempotent producer's record from one of its frames (once per batch)."""
    producer_id, sequence = _FIRST_PRODUCER.unpack_from(data, start + _PRODUCER_AT)
    known = topic.producers.get(producer_id)
    if known and known[-1].base_offset >= base:
        return  # the snapshot has it already
    topic.note_producer_batch(producer_id, ProducerBatch(sequence, base, count))


#: Bytes of a segment read at a time by a scan (a larger frame is read whole). Small enough for
#: what was just read to still be in the CPU cache when its CRCs are computed (on this machine's
#: 4 MiB L2, 256 KiB windows scan 1.3x faster than whole 8 MiB segments); large enough that the
#: per-window cost is small against the frames in it.
SCAN_WINDOW = 256 * 1024


class _Inconsistent(Exception):
    """A frame whose CRCs are valid but whose content contradicts the region's state."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _Scanned:
    """What scanning one segment found (positions are byte offsets in the file)."""

    frames: int
    """Number of valid frames (both CRCs and the prefix fields check) before ``valid_end``."""
    valid_end: int
    """Byte position just past the last valid frame."""
    error: FrameError | None
    """Why the frame at ``valid_end`` does not decode, if the segment does not end there."""
    resync_position: int | None
    """Position of a valid frame after the damage: if set, the damage is not a torn tail."""
    inconsistency: WalCorruptionError | None
    """The first valid frame that contradicts the state; neither it nor any later frame of the
    segment was applied."""


def _backwards(topic: TopicMeta, expected: int, found: int) -> _Inconsistent:
    return _Inconsistent(
        f"offsets go back in topic {topic.name}: expected {expected}, found {found}"
    )


def _note_gap(state: RegionState, topic: TopicMeta, base: int, path: Path, position: int) -> None:
    """Pass over offsets ``[topic.next_offset, base)`` (in no frame) as over an offset jump."""
    gap = OffsetGap(topic.name, topic.next_offset, base, str(path), position)
    state.gaps.append(gap)
    log.warning(
        "wal offset gap topic=%s expected=%d found=%d path=%s position=%d",
        gap.topic,
        gap.expected,
        gap.found,
        gap.path,
        gap.position,
    )
    if not topic.spans and topic.first_offset == topic.next_offset:
        topic.first_offset = base


def _prefix_verifies(data: memoryview, position: int) -> bool:
    """Whether the frame prefix at ``position`` is whole and valid (its length can be trusted)."""
    if len(data) - position < PREFIX_SIZE:
        return False
    length, kv, _body_crc, header_crc = _PREFIX.unpack_from(data, position)
    return (
        kv in _VALID
        and length <= MAX_FRAME_BODY
        and crc32c(data[position : position + 12]) == header_crc
    )


def _frame_end(data: memoryview, position: int) -> int:
    """End of the valid frame at ``position`` of ``data``, or -1 when it does not decode.

    The checks of decode_frame (which explains a failure: see _frame_error), as in the loop of
    _scan_segment.
    """
    if not _prefix_verifies(data, position):
        return -1
    length, _kv, body_crc, _header_crc = _PREFIX.unpack_from(data, position)
    start = position + PREFIX_SIZE
    stop: int = start + length
    if stop > len(data) or crc32c(data[start:stop]) != body_crc:
        return -1
    return stop


def _frame_error(data: memoryview, position: int) -> FrameError:
    """The error decode_frame reports for the frame at ``position`` (which does not decode)."""
    try:
        decode_frame(data, position)
    except FrameError as exc:
        # Without its traceback, whose frames reference slices of ``data``.
        return exc.with_traceback(None)
    return CorruptFrameError("frame does not verify", position)  # pragma: no cover


def _scan_segment(
    state: RegionState, seq: int, path: Path, segment: SegmentWindow, interval: int
) -> _Scanned:
    """Verify every frame of one segment's bytes and fold them into ``state``, in one pass.

    Every frame's header CRC and body CRC32C is checked before anything in it is used. The
    scan stops at the first frame that does not decode (``error``); nothing from there on is
    applied, as if the segment ended there. A valid frame that contradicts the state
    (``inconsistency``) is not applied either, nor is any later frame, but the rest of the
    segment is still verified, so that the caller can tell a torn tail from corruption just as
    when nothing is inconsistent. ``state.frames_scanned`` counts the frames applied.

    The file is read through a window that moves on whenever its next frame is not all in it
    (``data`` holds the file's bytes from ``wbase`` on; ``position`` and ``stop`` are relative
    to it), so each frame is verified while the read has just brought it into the CPU cache. A
    frame larger than the window is read whole, once its prefix verifies; anything else that
    does not decode is examined with the whole rest of the file in the window.
    """
    topics = state.topics
    by_id = {t.topic_id: t for t in topics.values()}
    in_segment: dict[int, TopicMeta] = {}  # the topics registered in the segment so far
    # Locals for the globals used for every frame (LOAD_FAST is the cheapest load).
    unpack_frame = _FRAME.unpack_from
    crc = crc32c
    valid = _VALID
    messages = _MESSAGES
    prefix_size = PREFIX_SIZE
    batch_header_size = BATCH_HEADER_SIZE
    data = segment.view
    wbase = 0
    end = len(data)
    # A frame that ends within a window of at most MAX_FRAME_BODY bytes after its prefix
    # cannot be longer than MAX_FRAME_BODY: only longer windows need that check.
    check_max = end > MAX_FRAME_BODY + PREFIX_SIZE
    position = stop = frames = kv = 0
    inconsistency: WalCorruptionError | None = None
    try:
        # Keep the checks in step with _frame_end.
        while True:
            if end - position < prefix_size:
                # Not even a frame prefix left in the window (at the end of the file: the
                # segment ends here, or in a torn prefix).
                if segment.eof:
                    break
                data = segment.advance(position)
                wbase, position, end = segment.base, 0, len(data)
                check_max = end > MAX_FRAME_BODY + PREFIX_SIZE
                continue
            try:
                (
                    length,
                    kv,
                    body_crc,
                    header_crc,
                    topic_id,
                    base,
                    count,
                    last_ms,
                ) = unpack_frame(data, position)
            except struct.error:
                # Fewer bytes left than a prefix and a batch header: no MESSAGES frame fits.
                length, kv, body_crc, header_crc = _PREFIX.unpack_from(data, position)
                topic_id = base = count = last_ms = 0
            start = position + prefix_size
            stop = start + length
            if (
                kv not in valid
                or stop > end
                or (check_max and length > MAX_FRAME_BODY)
                or crc(data[position : position + 12]) != header_crc
                or crc(data[start:stop]) != body_crc
            ):
                if segment.eof:
                    break
                if stop > end and _prefix_verifies(data, position):
                    data = segment.advance(position, prefix_size + length)  # the frame, whole
                else:
                    data = segment.rest(position)  # all that follows the damage
                wbase, position, end = segment.base, 0, len(data)
                check_max = end > MAX_FRAME_BODY + PREFIX_SIZE
                continue
            if kv == messages:
                if length < batch_header_size:
                    batch_header(data[start:stop])  # raises its CorruptFrameError
                try:
                    topic = in_segment[topic_id]
                except KeyError:
                    raise _Inconsistent(f"topic id {topic_id} used before registration") from None
                if base != topic.next_offset:
                    if base < topic.next_offset:
                        raise _backwards(topic, topic.next_offset, base)
                    if topic.next_offset >= 0:
                        _note_gap(state, topic, base, path, wbase + position)
                    else:
                        # First frame of a topic unknown to the snapshot: its earlier segments
                        # may have been pruned, so it need not start at offset 0.
                        topic.next_offset = topic.first_offset = base
                # topic.note_frame(seq, at, base, count, first_ms, last_ms, interval), with its
                # common case inlined: the frame continues the topic's span in this segment.
                at = wbase + position
                spans = topic.spans
                if spans and (span := spans[-1]).seq == seq:
                    span.last_offset = base + count - 1
                    span.last_ingest_ms = last_ms
                    if at - topic.last_index_pos >= interval:
                        span.index.append((base, at))
                        topic.last_index_pos = at
                else:
                    (first_ms,) = _FIRST_MS.unpack_from(data, start + _FIRST_MS_OFFSET)
                    topic.note_frame(seq, at, base, count, first_ms, last_ms, interval)
                topic.next_offset = topic.hwm = base + count
                if data[start + _PRODUCER_BYTE] & 0x80 and length > _PRODUCER_END:
                    _note_producer(topic, data, start, base, count)
                if last_ms > topic.last_ingest_ms:
                    topic.last_ingest_ms = last_ms
            elif kv == _TOPIC:
                if wbase + position == 0:
                    raise _Inconsistent(_NOT_CHECKPOINT)
                topic_id, name = decode_topic(data[start:stop])
                existing = topics.get(name)
                if existing is None:
                    if topic_id in by_id:
                        raise _Inconsistent(f"topic id {topic_id} bound to two names")
                    existing = TopicMeta(name, topic_id, next_offset=-1)
                    topics[name] = existing
                    by_id[topic_id] = existing
                elif existing.topic_id != topic_id:
                    raise _Inconsistent(f"topic {name} re-registered with id {topic_id}")
                in_segment[topic_id] = existing
                state.next_topic_id = max(state.next_topic_id, topic_id + 1)
            elif kv == _TIME:
                if wbase + position == 0:
                    raise _Inconsistent(_NOT_CHECKPOINT)
                topic_id, next_offset, ingest_ms = decode_time(data[start:stop])
                try:
                    topic = in_segment[topic_id]
                except KeyError:
                    raise _Inconsistent(f"topic id {topic_id} used before registration") from None
                if topic.next_offset < 0:
                    topic.next_offset = topic.first_offset = topic.hwm = next_offset
                elif next_offset > topic.next_offset:
                    # An offset jump (a new owner continuing the topic's offsets).
                    if not topic.spans and topic.first_offset == topic.next_offset:
                        topic.first_offset = next_offset
                    topic.next_offset = topic.hwm = next_offset
                topic.last_ingest_ms = max(topic.last_ingest_ms, ingest_ms)
            elif kv == _DROP:
                if wbase + position == 0:
                    raise _Inconsistent(_NOT_CHECKPOINT)
                topic_id, _next = decode_drop(data[start:stop])
                # Everything of this incarnation is forgotten; its id is never used again.
                dropped = by_id.get(topic_id)
                if dropped is not None and topics.get(dropped.name) is dropped:
                    del topics[dropped.name]
                in_segment.pop(topic_id, None)
                state.dropped[topic_id] = seq
                state.next_topic_id = max(state.next_topic_id, topic_id + 1)
            else:  # CHECKPOINT
                cp_seq, _created, _region = decode_checkpoint(data[start:stop])
                if wbase + position != 0 or cp_seq != seq:
                    raise _Inconsistent(f"unexpected CHECKPOINT for segment {cp_seq}")
            frames += 1
            position = stop
    except (_Inconsistent, FrameError) as exc:
        # (A FrameError here is a body that does not decode despite valid CRCs.)
        reason = exc.reason if isinstance(exc, _Inconsistent) else str(exc)
        if wbase + position == 0 and kv != _CHECKPOINT:
            reason = _NOT_CHECKPOINT
        inconsistency = WalCorruptionError(str(path), wbase + position, reason)
        applied = frames
        frames += 1
        position = stop
        if not segment.eof:
            data = segment.rest(position)
            wbase, position, end = segment.base, 0, len(data)
        while position < end:
            stop = _frame_end(data, position)
            if stop < 0:
                break
            frames += 1
            position = stop
    else:
        applied = frames
    state.frames_scanned += applied
    if position >= end:
        return _Scanned(frames, wbase + position, None, None, inconsistency)
    error = _frame_error(data, position)
    error.position += wbase
    # A TruncatedFrameError means fewer bytes than a prefix are left, or the prefix passed its
    # CRC and its length runs past the end: all that follows is one incomplete frame (a torn
    # tail). A "valid frame" found inside it would be a payload's bytes, not a frame boundary.
    resync = (
        None if isinstance(error, TruncatedFrameError) else find_valid_frame(data, position + 1)
    )
    return _Scanned(
        frames, wbase + position, error, None if resync is None else wbase + resync, inconsistency
    )


def _settle(state: RegionState) -> None:
    """Topics registered but never written start at offset 0."""
    for topic in state.topics.values():
        if topic.next_offset < 0:
            topic.next_offset = topic.first_offset = topic.hwm = 0


def _load_snapshot(region_dir: Path, seqs: list[int]) -> tuple[RegionState, int]:
    state = RegionState()
    snapshot = read_snapshot(region_dir)
    topics: list[TopicMeta] = []
    if snapshot is not None:
        try:
            topics = [TopicMeta.from_json(data) for data in snapshot.topics]
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            log.warning("wal snapshot ignored region_dir=%s error=%r", region_dir, exc)
            snapshot = None
    if snapshot is None:
        return state, (seqs[0] if seqs else 0)
    present = set(seqs)
    for topic in topics:
        # Segments deleted by the cleaner after the snapshot was written.
        kept = [span for span in topic.spans if span.seq in present]
        if len(kept) != len(topic.spans):
            topic.spans = kept
            topic.first_offset = kept[0].first_offset if kept else topic.next_offset
        topic.hwm = topic.next_offset
        state.topics[topic.name] = topic
    state.next_topic_id = snapshot.next_topic_id
    oldest = min(present, default=None)
    state.dropped = {
        tid: seq for tid, seq in snapshot.dropped.items() if oldest is not None and oldest <= seq
    }
    state.uploaded = set(snapshot.uploaded) & present
    state.used_seq = snapshot.next_seq
    return state, snapshot.next_seq


def _empty_tail(region_dir: Path, seqs: list[int]) -> list[int]:
    """The zero-length segments after the last one holding any bytes, ascending."""
    tail: list[int] = []
    for seq in reversed(seqs):
        if segment_path(region_dir, seq).stat().st_size != 0:
            break
        tail.append(seq)
    tail.reverse()
    return tail


def recover_region(region_dir: Path, index_interval: int = 64 * 1024) -> RegionState:
    """Rebuild a region's state; truncate a torn tail of its newest segment.

    Raises :class:`WalCorruptionError` when a segment is damaged anywhere but its torn tail.
    """
    seqs = list_segments(region_dir)
    # Empty files after the last written segment: segments created in advance (the writer
    # pre-creates the next one) or created just before a crash. They hold nothing.
    empty_tail = _empty_tail(region_dir, seqs)
    for seq in empty_tail:
        segment_path(region_dir, seq).unlink()
    if empty_tail:
        fsync_dir(region_dir)
        seqs = seqs[: len(seqs) - len(empty_tail)]
    state, start_seq = _load_snapshot(region_dir, seqs)
    for seq in empty_tail:
        state.used_seq = max(state.used_seq, seq + 1)
    # repair_region moved these out (and removed the snapshot that knew their numbers).
    for seq in list_segments(region_dir / "quarantine"):
        state.used_seq = max(state.used_seq, seq + 1)
    reader = SegmentReader()
    for seq in seqs:
        path = segment_path(region_dir, seq)
        if seq < start_seq:
            state.segments[seq] = path.stat().st_size
            continue
        with reader.open(path, SCAN_WINDOW) as segment:
            result = _scan_segment(state, seq, path, segment, index_interval)
            # The size scanned, which another process may have changed since the listing.
            read = state.segments[seq] = segment.total
        state.bytes_scanned += read
        if result.error is not None:
            newest = seq == seqs[-1]
            if not newest or result.resync_position is not None:
                where = "" if newest else " (a sealed segment)"
                raise WalCorruptionError(str(path), result.valid_end, f"{result.error}{where}")
            _truncate(path, result.valid_end)
            removed = read - result.valid_end
            state.truncated.append((str(path), result.valid_end, removed))
            state.segments[seq] = result.valid_end
            log.warning(
                "wal torn tail truncated path=%s position=%d removed_bytes=%d",
                path,
                result.valid_end,
                removed,
            )
        if result.inconsistency is not None:
            raise result.inconsistency
        if not result.frames:
            # Created but nothing durable in it: remove it; sequence numbers are not reused.
            path.unlink()
            fsync_dir(region_dir)
            del state.segments[seq]
            state.used_seq = max(state.used_seq, seq + 1)
    _settle(state)
    return state


def _truncate(path: Path, position: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, position)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class VerifyReport:
    """What ``verify_region`` found; ``ok`` is False when recovery would refuse to open."""

    region_dir: str
    segments: int = 0
    frames: int = 0
    bytes: int = 0
    topics: dict[str, tuple[int, int]] = field(default_factory=dict)
    """topic -> (first offset, next offset) found in the segments."""
    torn_tail: tuple[str, int] | None = None
    corruption: WalCorruptionError | None = None
    gaps: list[OffsetGap] = field(default_factory=list)
    """Offset gaps: reported, not damage (recovery passes over them, repair keeps them)."""

    @property
    def ok(self) -> bool:
        return self.corruption is None


def verify_region(region_dir: Path, index_interval: int = 64 * 1024) -> VerifyReport:
    """Scan every segment of a region, changing nothing."""
    report = VerifyReport(str(region_dir))
    state = RegionState()
    seqs = list_segments(region_dir)
    empty_tail = _empty_tail(region_dir, seqs)
    seqs = seqs[: len(seqs) - len(empty_tail)]
    reader = SegmentReader()
    for seq in seqs:
        path = segment_path(region_dir, seq)
        with reader.open(path, SCAN_WINDOW) as segment:
            result = _scan_segment(state, seq, path, segment, index_interval)
            report.segments += 1
            report.bytes += segment.total
        if result.inconsistency is not None:
            report.corruption = result.inconsistency
            break
        if result.error is not None:
            if seq == seqs[-1] and result.resync_position is None:
                report.torn_tail = (str(path), result.valid_end)
            else:
                report.corruption = WalCorruptionError(
                    str(path), result.valid_end, str(result.error)
                )
                break
    _settle(state)
    report.gaps = state.gaps
    report.frames = state.frames_scanned
    report.topics = {t.name: (t.first_offset, t.next_offset) for t in state.topics.values()}
    return report


def repair_region(region_dir: Path) -> list[str]:
    """Truncate the region at its first damage; return what was moved to ``quarantine/``.

    Damage is a frame that does not verify, or one that contradicts the frames before it; an
    offset gap is not damage, so no frame is moved for it.

    Everything from the damaged byte on (the rest of that segment and every later segment) is
    moved, not deleted, so that it can be inspected. The snapshot is removed so the next open
    rebuilds state from the remaining segments.
    """
    report = verify_region(region_dir)
    damage = report.corruption
    if damage is None and report.torn_tail is None:
        return []
    path_s, position = (
        (damage.path, damage.position) if damage is not None else report.torn_tail  # type: ignore[misc]
    )
    path = Path(path_s)
    quarantine = region_dir / "quarantine"
    quarantine.mkdir(exist_ok=True)
    moved: list[str] = []
    data = path.read_bytes()
    cut = quarantine / f"{path.name}.from-{position}"
    cut.write_bytes(data[position:])
    moved.append(str(cut))
    _truncate(path, position)
    damaged_seq = int(path.name.split(".")[0])
    for seq in list_segments(region_dir):
        if seq > damaged_seq:
            src = segment_path(region_dir, seq)
            if src.stat().st_size == 0:
                src.unlink()  # a pre-created, never written segment: nothing to keep
                continue
            dst = quarantine / src.name
            shutil.move(src, dst)
            moved.append(str(dst))
    (region_dir / "meta.json").unlink(missing_ok=True)
    fsync_dir(quarantine)
    fsync_dir(region_dir)
    return moved
