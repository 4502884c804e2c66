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
from danube_ingest.wal.framing import FrameInfo, Kind, decode_frame

SEGMENT_SUFFIX = ".wal"
_SEGMENT_RE = re.compile(r"^(\d{20})\.wal$")
# A frame prefix carries a kind (any of Kind), version 1 and two zero bytes at offsets 4..8.
# Searching for that pattern finds re-synchronisation candidates at C speed; the header CRC
# confirms them. Built from Kind so a new kind is never missed (a missed one makes damage
# followed only by frames of that kind look like a torn tail, which recovery truncates).
_PREFIX_CANDIDATE = re.compile(
    b"[" + bytes((min(Kind),)) + b"-" + bytes((max(Kind),)) + b"]\x01\x00\x00", re.DOTALL
)


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
    """Reads segment files front to back, one at a time, into one buffer reused from file to file.

    ``open(path, window)`` is a context manager yielding a :class:`SegmentWindow`: a view of the
    file's next bytes, at least ``window`` of them while the file lasts (``window=None``: the
    whole file at once). A scan moves through the file with ``SegmentWindow.advance``; it never
    holds more than the window (or the one frame it is looking at, if that is larger) in memory,
    and each byte is verified while it is still in the CPU cache the read brought it into. The
    views are only valid inside the block (the next file is read into the same buffer). The file
    is read, never mapped (see the module docstring): a failed read raises :class:`OSError` with
    the errno of the failure and the file's path, and a file that another process truncates or
    extends while it is read yields the bytes the reads found.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    @contextmanager
    def open(self, path: Path, window: int | None = None) -> Iterator[SegmentWindow]:
        fd = os.open(path, os.O_RDONLY)
        try:
            segment = SegmentWindow(self, fd, path, window)
            yield segment
        finally:
            os.close(fd)
        segment.view.release()


class SegmentWindow:
    """The part of a segment file read so far and not yet dropped (see :class:`SegmentReader`).

    ``view`` holds the file's bytes ``[base, base + len(view))``; ``eof`` is True once a read
    found the end of the file, so ``view`` then runs to the end and ``total`` is the file's size.
    """

    __slots__ = ("_fd", "_path", "_reader", "_window", "base", "eof", "view")

    def __init__(self, reader: SegmentReader, fd: int, path: Path, window: int | None) -> None:
        self._reader = reader
        self._fd = fd
        self._path = path
        self._window = window
        self.base = 0
        self.eof = False
        self.view = memoryview(reader._buf)[:0]
        if window is None:
            self.rest(0)
        else:
            self.advance(0)

    @property
    def total(self) -> int:
        """Bytes of the file up to the end of the window (its size once ``eof``)."""
        return self.base + len(self.view)

    def advance(self, keep: int, need: int = 0) -> memoryview:
        """Drop the window's bytes before ``keep`` and read on; return the new ``view``.

        Reads a window's worth of bytes more than it keeps, and more if the window must hold
        ``need`` bytes, or until the file ends.
        """
        more = len(self.view) - keep + (self._window or 1)
        return self._move(keep, need if need > more else more, grow=False)

    def rest(self, keep: int) -> memoryview:
        """Like ``advance``, but read the whole rest of the file into the window."""
        try:
            rest = os.fstat(self._fd).st_size - self.total
        except OSError as exc:
            raise _named(exc, self._path) from exc
        # One spare byte at least: a read that fills the buffer may not be at EOF.
        return self._move(keep, len(self.view) - keep + max(rest, 0) + 4096, grow=True)

    def _move(self, keep: int, cap: int, *, grow: bool) -> memoryview:
        old = self.view
        kept = len(old) - keep
        reader = self._reader
        buf = reader._buf
        if len(buf) < cap:
            # Twice the window at least, so that a window plus what it keeps of the last one
            # fits without a new buffer each time.
            window = self._window or 0
            buf = reader._buf = bytearray(max(cap + cap // 16, 2 * window))
        if kept:
            # The source may overlap the destination: copy through bytes unless it lies after.
            buf[:kept] = old[keep:] if keep >= kept or buf is not old.obj else bytes(old[keep:])
        old.release()
        self.base += keep
        n = kept
        fd = self._fd
        view = memoryview(buf)
        try:
            while n < cap:
                got = os.readv(fd, [view[n:cap]])
                if not got:
                    self.eof = True
                    break
                n += got
                if grow and n == cap:
                    # The file grew while we read it.
                    cap = 2 * n
                    if cap > len(buf):
                        bigger = reader._buf = bytearray(cap)
                        bigger[:n] = view[:n]
                        view.release()
                        view, buf = memoryview(bigger), bigger
        except OSError as exc:
            view.release()
            raise _named(exc, self._path) from exc
        self.view = view[:n]
        view.release()
        return self.view


def _named(exc: OSError, path: Path) -> OSError:
    # The errors of fstat and readv do not name the file.
    reason = f"{exc.strerror or exc} while reading WAL segment"
    return OSError(exc.errno, reason, str(path))


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
