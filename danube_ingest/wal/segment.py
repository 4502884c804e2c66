"""Segment files: naming, listing, reading and scanning.

A region's directory ``{wal_dir}/{region}/`` holds segment files ``{seq:020}.wal`` (sequence
numbers grow and are never reused) and the RegionMeta snapshot ``meta.json``. Every segment
starts with a CHECKPOINT frame naming its own sequence number. All segments but the newest are
sealed (fully written and fdatasync'ed, never modified again); only the newest can have a torn
tail.

Segments are read with ``read`` system calls, never through a memory mapping: a failed read is
then an :class:`OSError` naming the file, and a file that another process truncates meanwhile is
read as far as it still goes, where touching a mapping past the file's end, or a page the disk
cannot deliver, kills the process with SIGBUS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
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


class SegmentReader:
    """Reads whole segment files, one at a time, into one buffer reused from file to file.

    ``open(path)`` is a context manager yielding a view of the file's bytes, from its start to
    where a read found its end, that is valid until the ``with`` block ends; no slice of it may
    outlive the block (the next file is read into the same buffer). The file is read, never
    mapped (see the module docstring): a failed read raises :class:`OSError` with the errno of
    the failure and the file's path, and a file that another process truncates or extends while
    it is read yields the bytes the reads found.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    @contextmanager
    def open(self, path: Path) -> Iterator[memoryview]:
        fd = os.open(path, os.O_RDONLY)
        try:
            view = self._read(fd, path)
        finally:
            os.close(fd)
        with view:
            yield view

    def _read(self, fd: int, path: Path) -> memoryview:
        """The bytes of ``fd`` to end of file, in the reused buffer."""
        try:
            size = os.fstat(fd).st_size
            buf = self._buf
            if len(buf) <= size:
                # One spare byte at least: a read that fills the buffer may not be at EOF.
                buf = self._buf = bytearray(size + size // 16 + 4096)
            view = memoryview(buf)
            n = 0
            while True:
                got = os.readv(fd, [view[n:]])
                if not got:
                    return view[:n]
                n += got
                if n == len(buf):
                    # The file grew while we read it.
                    bigger = bytearray(2 * n)
                    bigger[:n] = view
                    buf = self._buf = bigger
                    view = memoryview(buf)
        except OSError as exc:
            # The errors of fstat and readv do not name the file.
            reason = f"{exc.strerror or exc} while reading WAL segment"
            raise OSError(exc.errno, reason, str(path)) from exc


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
