"""Segment files: naming, listing and scanning.

A region's directory ``{wal_dir}/{region}/`` holds segment files ``{seq:020}.wal`` (sequence
numbers grow and are never reused) and the RegionMeta snapshot ``meta.json``. Every segment
starts with a CHECKPOINT frame naming its own sequence number. All segments but the newest are
sealed (fully written and fdatasync'ed, never modified again); only the newest can have a torn
tail.
"""

from __future__ import annotations

import mmap
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
# Populating the page tables when mapping a segment costs less than faulting its pages in one by
# one while scanning it (and reads a segment that is not in the page cache in one go).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


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
    """Gives whole segment files as read-only views, for a front-to-back scan.

    ``open(path)`` is a context manager yielding a view of the file's bytes (as they are when it
    is called) that is valid until the ``with`` block ends; no slice of it may outlive the
    block. With ``use_mmap`` the file is mapped: the scan then reads the page cache directly
    instead of copying every byte into a buffer first (with a warm page cache the copy costs as
    much as computing the CRC32C of every byte). The price of a mapping is that an I/O error
    while reading it, or another process truncating the file meanwhile, kills the process with
    SIGBUS instead of raising :class:`OSError`; segment files are only truncated by recovery
    and repair, which must not run concurrently with anything else on the region. Without
    ``use_mmap``, or when a file cannot be mapped, files are read into one buffer reused from
    file to file.
    """

    def __init__(self, use_mmap: bool = True) -> None:
        self._use_mmap = use_mmap
        self._buf = bytearray()

    @contextmanager
    def open(self, path: Path) -> Iterator[memoryview]:
        mapped: mmap.mmap | None = None
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if self._use_mmap and size > 0:
                try:
                    mapped = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
                except (OSError, ValueError, OverflowError):
                    mapped = None  # a file system that cannot map files: read it instead
            view = memoryview(mapped) if mapped is not None else self._read(fd, size)
        finally:
            os.close(fd)  # a mapping stays valid without its descriptor
        try:
            yield view
        finally:
            try:
                view.release()
                if mapped is not None:
                    mapped.close()
            except BufferError:
                # A slice of the view is still referenced (by a traceback, say): the mapping
                # goes away with the last reference instead.
                pass

    def _read(self, fd: int, size: int) -> memoryview:
        """The bytes of ``fd`` to end of file, in the reused buffer."""
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
