"""Segment files: naming, listing and scanning.

A region's directory ``{wal_dir}/{region}/`` holds segment files ``{seq:020}.wal`` (sequence
numbers grow and are never reused) and the RegionMeta snapshot ``meta.json``. Every segment
starts with a CHECKPOINT frame naming its own sequence number. All segments but the newest are
sealed (fully written and fdatasync'ed, never modified again); only the newest can have a torn
tail.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from danube_ingest.errors import FrameError, TruncatedFrameError
from danube_ingest.wal.framing import FrameInfo, decode_frame

SEGMENT_SUFFIX = ".wal"
_SEGMENT_RE = re.compile(r"^(\d{20})\.wal$")
# A frame prefix carries kind 1..4, version 1 and two zero bytes at offsets 4..8. Searching for
# that pattern finds re-synchronisation candidates at C speed; the header CRC confirms them.
_PREFIX_CANDIDATE = re.compile(rb"[\x01-\x04]\x01\x00\x00", re.DOTALL)


def segment_name(seq: int) -> str:
    return f"{seq:020d}{SEGMENT_SUFFIX}"


def segment_path(region_dir: Path, seq: int) -> Path:
    return region_dir / segment_name(seq)


def list_segments(region_dir: Path) -> list[int]:
    """Sequence numbers of the region's segment files, ascending."""
    if not region_dir.is_dir():
        return []
    seqs = []
    for name in os.listdir(region_dir):
        match = _SEGMENT_RE.match(name)
        if match:
            seqs.append(int(match.group(1)))
    seqs.sort()
    return seqs


@dataclass(slots=True)
class ScanResult:
    """What scanning a segment's bytes found."""

    frames: list[FrameInfo]
    valid_end: int
    """Byte position just past the last valid frame."""
    error: FrameError | None
    """The error of the first frame that did not decode (at ``valid_end``), if any."""
    resync_position: int | None
    """Position of a valid frame after the damage: if set, the damage is not a torn tail."""


def find_valid_frame(data: bytes | memoryview, start: int) -> int | None:
    """Position of the first complete, CRC-valid frame at or after ``start``, if any."""
    view = memoryview(data)
    raw = data if isinstance(data, bytes) else bytes(data)
    for match in _PREFIX_CANDIDATE.finditer(raw, start + 4):
        position = match.start() - 4
        if position < start:
            continue
        try:
            decode_frame(view, position)
        except FrameError:
            continue
        return position
    return None


def scan(data: bytes, start: int = 0) -> ScanResult:
    """Decode every frame of ``data`` from ``start``; stop at the first damaged frame."""
    view = memoryview(data)
    frames: list[FrameInfo] = []
    position = start
    end = len(data)
    while position < end:
        try:
            frame = decode_frame(view, position)
        except TruncatedFrameError as exc:
            # Fewer bytes than a prefix are left, or the prefix passed its CRC and its length
            # runs past the end: all that follows is one incomplete frame (a torn tail). A
            # "valid frame" found inside it would be a payload's bytes, not a frame boundary.
            return ScanResult(frames, position, exc, None)
        except FrameError as exc:
            return ScanResult(frames, position, exc, find_valid_frame(data, position + 1))
        frames.append(frame)
        position = frame.end
    return ScanResult(frames, position, None, None)
