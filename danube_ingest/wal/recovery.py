"""Recovery, verification and repair of a region's segment files.

Recovery loads the RegionMeta snapshot, then scans the segments written after it, verifying
every frame's CRC32C and rebuilding per-topic offsets and the sparse index. Damage in the
newest segment with no valid frame after it is a torn tail (a crash during a write that was
never acknowledged) and is truncated. Any other damage is corruption: recovery refuses to open
and names the file and byte position. ``verify_region`` reports without changing anything;
``repair_region`` truncates at the first damage, moving what it cuts into ``quarantine/``.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from danube_ingest.errors import FrameError, WalCorruptionError
from danube_ingest.wal.framing import (
    FrameInfo,
    Kind,
    batch_header,
    decode_checkpoint,
    decode_time,
    decode_topic,
)
from danube_ingest.wal.meta import TopicMeta, fsync_dir, read_snapshot
from danube_ingest.wal.segment import list_segments, scan, segment_path

log = logging.getLogger(__name__)


@dataclass
class RegionState:
    """Per-topic state rebuilt from a region's snapshot and segments."""

    topics: dict[str, TopicMeta] = field(default_factory=dict)
    next_topic_id: int = 1
    segments: dict[int, int] = field(default_factory=dict)
    """seq -> size in bytes of every segment on disk (all sealed after recovery)."""
    uploaded: set[int] = field(default_factory=set)
    truncated: list[tuple[str, int, int]] = field(default_factory=list)
    """(path, position, bytes removed) for each torn tail that was cut."""
    frames_scanned: int = 0
    bytes_scanned: int = 0
    used_seq: int = 0
    """Sequence numbers below this were used, even if their files are gone (never reuse one:
    a sealed segment may have been uploaded under its number)."""

    @property
    def next_seq(self) -> int:
        return max(self.used_seq, max(self.segments) + 1 if self.segments else 0)


def _apply(
    state: RegionState, seq: int, path: Path, frames: list[FrameInfo], interval: int
) -> None:
    """Fold one segment's frames into ``state``; raise WalCorruptionError on inconsistency."""

    def corrupt(frame: FrameInfo, reason: str) -> WalCorruptionError:
        return WalCorruptionError(str(path), frame.position, reason)

    if not frames:
        return
    if frames[0].kind != Kind.CHECKPOINT:
        raise corrupt(frames[0], "segment does not start with a CHECKPOINT frame")
    by_id = {t.topic_id: t for t in state.topics.values()}
    in_segment: dict[int, TopicMeta] = {}
    for frame in frames:
        kind = frame.kind
        try:
            if kind == Kind.MESSAGES:
                header = batch_header(frame.body)
                topic = in_segment.get(header.topic_id)
                if topic is None:
                    raise corrupt(frame, f"topic id {header.topic_id} used before registration")
                if topic.next_offset < 0:
                    # First frame of a topic unknown to the snapshot: its earlier segments may
                    # have been pruned, so it need not start at offset 0.
                    topic.next_offset = topic.first_offset = header.base_offset
                if header.base_offset != topic.next_offset:
                    raise corrupt(
                        frame,
                        f"offset gap in topic {topic.name}: expected {topic.next_offset}, "
                        f"found {header.base_offset}",
                    )
                topic.note_frame(
                    seq,
                    frame.position,
                    header.base_offset,
                    header.num_entries,
                    header.first_ingest_ms,
                    header.last_ingest_ms,
                    interval,
                )
                topic.next_offset = topic.hwm = header.base_offset + header.num_entries
                topic.last_ingest_ms = max(topic.last_ingest_ms, header.last_ingest_ms)
            elif kind == Kind.TOPIC:
                topic_id, name = decode_topic(frame.body)
                existing = state.topics.get(name)
                if existing is None:
                    if topic_id in by_id:
                        raise corrupt(frame, f"topic id {topic_id} bound to two names")
                    existing = TopicMeta(name, topic_id, next_offset=-1)
                    state.topics[name] = existing
                    by_id[topic_id] = existing
                elif existing.topic_id != topic_id:
                    raise corrupt(frame, f"topic {name} re-registered with id {topic_id}")
                in_segment[topic_id] = existing
                state.next_topic_id = max(state.next_topic_id, topic_id + 1)
            elif kind == Kind.TIME:
                topic_id, next_offset, ingest_ms = decode_time(frame.body)
                topic = in_segment.get(topic_id)
                if topic is None:
                    raise corrupt(frame, f"topic id {topic_id} used before registration")
                if topic.next_offset < 0:
                    topic.next_offset = topic.first_offset = topic.hwm = next_offset
                elif next_offset > topic.next_offset:
                    # An offset jump (a new owner continuing the topic's offsets).
                    if not topic.spans and topic.first_offset == topic.next_offset:
                        topic.first_offset = next_offset
                    topic.next_offset = topic.hwm = next_offset
                topic.last_ingest_ms = max(topic.last_ingest_ms, ingest_ms)
            elif kind == Kind.CHECKPOINT:
                cp_seq, _created, _region = decode_checkpoint(frame.body)
                if frame.position != 0 or cp_seq != seq:
                    raise corrupt(frame, f"unexpected CHECKPOINT for segment {cp_seq}")
        except FrameError as exc:
            raise corrupt(frame, str(exc)) from exc
        state.frames_scanned += 1


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
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
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
    state.uploaded = set(snapshot.uploaded) & present
    state.used_seq = snapshot.next_seq
    return state, snapshot.next_seq


def recover_region(region_dir: Path, index_interval: int = 64 * 1024) -> RegionState:
    """Rebuild a region's state; truncate a torn tail of its newest segment.

    Raises :class:`WalCorruptionError` when a segment is damaged anywhere but its torn tail.
    """
    seqs = list_segments(region_dir)
    state, start_seq = _load_snapshot(region_dir, seqs)
    # repair_region moved these out (and removed the snapshot that knew their numbers).
    for seq in list_segments(region_dir / "quarantine"):
        state.used_seq = max(state.used_seq, seq + 1)
    for seq in seqs:
        path = segment_path(region_dir, seq)
        size = path.stat().st_size
        state.segments[seq] = size
        if seq < start_seq:
            continue
        data = path.read_bytes()
        state.bytes_scanned += len(data)
        result = scan(data)
        if result.error is not None:
            newest = seq == seqs[-1]
            if not newest or result.resync_position is not None:
                where = "" if newest else " (a sealed segment)"
                raise WalCorruptionError(str(path), result.valid_end, f"{result.error}{where}")
            _truncate(path, result.valid_end)
            removed = len(data) - result.valid_end
            state.truncated.append((str(path), result.valid_end, removed))
            state.segments[seq] = result.valid_end
            log.warning(
                "wal torn tail truncated path=%s position=%d removed_bytes=%d",
                path,
                result.valid_end,
                removed,
            )
        _apply(state, seq, path, result.frames, index_interval)
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

    @property
    def ok(self) -> bool:
        return self.corruption is None


def verify_region(region_dir: Path, index_interval: int = 64 * 1024) -> VerifyReport:
    """Scan every segment of a region, changing nothing."""
    report = VerifyReport(str(region_dir))
    state = RegionState()
    seqs = list_segments(region_dir)
    for seq in seqs:
        path = segment_path(region_dir, seq)
        data = path.read_bytes()
        report.segments += 1
        report.bytes += len(data)
        result = scan(data)
        try:
            _apply(state, seq, path, result.frames, index_interval)
        except WalCorruptionError as exc:
            report.corruption = exc
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
    report.frames = state.frames_scanned
    report.topics = {t.name: (t.first_offset, t.next_offset) for t in state.topics.values()}
    return report


def repair_region(region_dir: Path) -> list[str]:
    """Truncate the region at its first damage; return what was moved to ``quarantine/``.

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
            dst = quarantine / src.name
            shutil.move(src, dst)
            moved.append(str(dst))
    (region_dir / "meta.json").unlink(missing_ok=True)
    fsync_dir(quarantine)
    fsync_dir(region_dir)
    return moved
