"""The ``.bin`` object format.

An object holds runs of WAL frames of one or more topics: the data uploaded from one sealed
WAL segment, or a rolling per-topic object merged from several of them. All integers are
little-endian. An object is::

    header | frames | footer | trailer

Header (8 bytes)::

    offset  size  field
    0       5     magic         b"DNBIN"
    5       1     version       u8, FORMAT_VERSION (1)
    6       2     flags         u16, zero

Frame (20-byte prefix, then the stored bytes)::

    offset  size  field
    0       4     stored_len    u32, number of stored bytes after the prefix
    4       1     codec         u8, index into CODECS: 0 none, 1 zstd, 2 lz4 (block format)
    5       1     reserved      u8, zero
    6       2     reserved      u16, zero
    8       4     raw_len       u32, size of the frame's data once decompressed
    12      4     stored_crc    u32, CRC32C of the stored bytes
    16      4     prefix_crc    u32, CRC32C of bytes 0..16 of this prefix
    20      ...   stored bytes  the data, compressed with ``codec``

The data of a frame is a run of complete WAL frames of ONE topic (see
:mod:`danube_ingest.wal.framing`): MESSAGES frames in increasing offset order, possibly with
TIME frames between them (readers skip those), never other kinds. The WAL ``topic_id`` inside
is meaningless here (it is region-local); the footer names the topic. Every frame holds at least
one entry. ``stored_len <= raw_len <= MAX_RAW_LEN``: a frame that does not compress is stored
with codec ``none``.

Frames are laid out topic by topic: all frames of the first topic, then all of the second, ...
so a topic's data is one byte range, and the frames tile ``[8, footer_position)`` exactly.

Footer (``footer_len`` bytes)::

    u32 topic_count
    topic_count x (u16 name_len | name (utf-8) | u32 frame_count
                   | frame_count x FrameRef record)

    FrameRef record (48 bytes):
    u64 first_offset | u64 last_offset (inclusive) | u32 entries
    | i64 first_ingest_ms | i64 last_ingest_ms | u64 position | u32 length

``position`` is the byte offset of the frame's prefix in the object, ``length`` its prefix plus
stored bytes. Offsets strictly increase from frame to frame of a topic; a frame's offsets may
have gaps (``entries <= last_offset - first_offset + 1``).

Trailer (20 bytes, the last bytes of the object)::

    offset  size  field
    0       4     trailer_crc   u32, CRC32C of bytes 4..20 of the trailer
    4       4     footer_len    u32
    8       4     footer_crc    u32, CRC32C of the footer
    12      8     the header again: magic, version, flags

The trailer repeats the header so that a reader which fetches only the tail of an object knows
its version; its own CRC keeps a damaged ``footer_len`` from sending a reader on a large useless
ranged read. Every byte of an object is covered by a check: the header by its exact value,
frame prefixes, stored bytes, the footer and the trailer by a CRC32C.

This module also holds the format's constants, the footer's data classes and the footer and
trailer codec. :mod:`danube_ingest.objects.binfmt.writer` builds objects and
:mod:`danube_ingest.objects.binfmt.decoder` reads them.
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from crc32c import crc32c

from danube_ingest.errors import ObjectFormatError
from danube_ingest.wal.framing import MAX_FRAME_BODY

FORMAT_VERSION = 1
MAGIC = b"DNBIN"
CODECS = ("none", "zstd", "lz4")
_NONE, _ZSTD, _LZ4 = range(len(CODECS))

_HEADER = struct.Struct("<5sBH")
HEADER_SIZE = _HEADER.size  # 8
HEADER = _HEADER.pack(MAGIC, FORMAT_VERSION, 0)
_FRAME_PREFIX = struct.Struct("<IBBHIII")
FRAME_PREFIX_SIZE = _FRAME_PREFIX.size  # 20
_FRAME_HEAD = struct.Struct("<IBBHII")  # the prefix without its CRC
_FRAME_RECORD = struct.Struct("<QQIqqQI")
_FRAME_RECORD_SIZE = _FRAME_RECORD.size  # 48
_TRAILER = struct.Struct("<III5sBH")
TRAILER_SIZE = _TRAILER.size  # 20
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
#: An object with no topics: header, a footer of topic_count 0, trailer.
MIN_OBJECT_SIZE = HEADER_SIZE + _U32.size + TRAILER_SIZE

#: Upper bound on a frame's decompressed size, so a reader never allocates on a garbage length:
#: one WAL frame of the largest body (a frame is never split) plus room for the small frames
#: (TIME markers, a batch started before it) that may share its object frame.
MAX_RAW_LEN = MAX_FRAME_BODY + (1 << 20)


@dataclass(frozen=True, slots=True)
class FrameRef:
    """One frame of an object, as the footer indexes it."""

    topic: str
    first_offset: int
    last_offset: int
    """Inclusive."""
    entries: int
    first_ingest_ms: int
    last_ingest_ms: int
    position: int
    """Byte offset of the frame's prefix in the object."""
    length: int
    """Prefix plus stored bytes."""


@dataclass(frozen=True, slots=True)
class TopicSpan:
    """One topic's part of an object: its frames, which are contiguous in the object."""

    topic: str
    first_offset: int
    last_offset: int
    """Inclusive."""
    entries: int
    first_ingest_ms: int
    last_ingest_ms: int
    position: int
    """Byte offset of the first frame."""
    length: int
    """Bytes of all the topic's frames: its data is ``[position, position + length)``."""
    frames: tuple[FrameRef, ...]

    def frames_from(self, offset: int) -> tuple[FrameRef, ...]:
        """The frames that hold an offset ``>= offset`` (those with ``last_offset >= offset``)."""
        start = bisect_left(self.frames, offset, key=lambda frame: frame.last_offset)
        return self.frames[start:]


@dataclass(frozen=True, slots=True)
class Footer:
    """The index of an object."""

    topics: dict[str, TopicSpan]
    """By topic name, in object order."""
    size: int
    """Total size of the object in bytes."""
    footer_position: int
    """Byte offset of the footer; the frames end there."""


def _span(topic: str, frames: Sequence[FrameRef]) -> TopicSpan:
    first = frames[0]
    last = frames[-1]
    return TopicSpan(
        topic,
        first.first_offset,
        last.last_offset,
        sum(frame.entries for frame in frames),
        first.first_ingest_ms,
        last.last_ingest_ms,
        first.position,
        last.position + last.length - first.position,
        tuple(frames),
    )


def _error(key: str, position: int | None, reason: str) -> ObjectFormatError:
    return ObjectFormatError(key, position, reason)


def _footer_and_trailer(topics: dict[str, TopicSpan]) -> bytes:
    """The footer indexing ``topics`` (in their order), followed by the trailer."""
    footer = bytearray(_U32.pack(len(topics)))
    for name, span in topics.items():
        name_b = name.encode()
        footer += _U16.pack(len(name_b))
        footer += name_b
        footer += _U32.pack(len(span.frames))
        for ref in span.frames:
            footer += _FRAME_RECORD.pack(
                ref.first_offset,
                ref.last_offset,
                ref.entries,
                ref.first_ingest_ms,
                ref.last_ingest_ms,
                ref.position,
                ref.length,
            )
    trailer_body = _TRAILER.pack(0, len(footer), crc32c(footer), MAGIC, FORMAT_VERSION, 0)[4:]
    return b"".join((footer, _U32.pack(crc32c(trailer_body)), trailer_body))


def read_footer(tail: bytes | memoryview, object_size: int, key: str = "?") -> Footer | int:
    """Parse the footer from ``tail``, the last ``len(tail)`` bytes of an object.

    Returns the number of tail bytes needed when ``tail`` is too short to hold the whole footer
    (``TRAILER_SIZE`` when it does not even hold the trailer): one more ranged read of that many
    bytes then succeeds. Raises :class:`ObjectFormatError` on any invalid or truncated input and
    on an unknown format version. Does not read the header or the frames.
    """
    view = tail if isinstance(tail, memoryview) else memoryview(tail)
    if object_size < MIN_OBJECT_SIZE:
        raise _error(key, None, f"{object_size} bytes is too small for a .bin object")
    if len(view) > object_size:
        raise _error(key, None, f"tail of {len(view)} bytes is longer than the object")
    if len(view) < TRAILER_SIZE:
        return TRAILER_SIZE
    trailer_position = object_size - TRAILER_SIZE
    trailer = view[len(view) - TRAILER_SIZE :]
    trailer_crc: int
    footer_len: int
    trailer_crc, footer_len, footer_crc, magic, version, flags = _TRAILER.unpack(trailer)
    if magic != MAGIC:
        raise _error(key, trailer_position, "no .bin trailer (not a .bin object, or truncated)")
    if crc32c(trailer[4:]) != trailer_crc:
        raise _error(key, trailer_position, "trailer CRC mismatch")
    if version != FORMAT_VERSION:
        raise _error(
            key, trailer_position, f"unknown format version {version} (expected {FORMAT_VERSION})"
        )
    if flags:
        raise _error(key, trailer_position, f"unknown flags {flags:#x}")
    footer_position = trailer_position - footer_len
    if footer_position < HEADER_SIZE:
        raise _error(key, trailer_position, f"footer of {footer_len} bytes does not fit")
    needed = footer_len + TRAILER_SIZE
    if len(view) < needed:
        return needed
    footer = view[len(view) - needed : len(view) - TRAILER_SIZE]
    if crc32c(footer) != footer_crc:
        raise _error(key, footer_position, "footer CRC mismatch")
    try:
        return _parse_footer(footer, footer_position, object_size, key)
    except (struct.error, UnicodeDecodeError) as exc:
        raise _error(key, footer_position, f"footer does not decode: {exc}") from exc


def _parse_footer(footer: memoryview, footer_position: int, size: int, key: str) -> Footer:
    (count,) = _U32.unpack_from(footer, 0)
    pos = _U32.size
    # The smallest topic record (1-byte name, one frame) bounds the loop on a garbage count.
    if count * (_U16.size + 1 + _U32.size + _FRAME_RECORD_SIZE) > len(footer) - pos:
        raise _error(key, footer_position, f"footer cannot hold {count} topics")
    topics: dict[str, TopicSpan] = {}
    expected_position = HEADER_SIZE
    for _ in range(count):
        (name_len,) = _U16.unpack_from(footer, pos)
        pos += _U16.size
        name = bytes(footer[pos : pos + name_len]).decode()
        pos += name_len
        (frame_count,) = _U32.unpack_from(footer, pos)
        pos += _U32.size
        where = footer_position + pos
        if not name or name in topics:
            raise _error(key, where, f"empty or repeated topic name {name!r}")
        end = pos + frame_count * _FRAME_RECORD_SIZE
        if frame_count == 0 or end > len(footer):
            raise _error(key, where, f"topic {name}: invalid frame count {frame_count}")
        frames: list[FrameRef] = []
        previous = -1
        for record in _FRAME_RECORD.iter_unpack(footer[pos:end]):
            ref = FrameRef(name, *record)
            if not (
                previous < ref.first_offset <= ref.last_offset
                and 1 <= ref.entries <= ref.last_offset - ref.first_offset + 1
                and ref.position == expected_position
                and FRAME_PREFIX_SIZE < ref.length <= FRAME_PREFIX_SIZE + MAX_RAW_LEN
            ):
                raise _error(key, where, f"invalid frame record {ref}")
            frames.append(ref)
            previous = ref.last_offset
            expected_position += ref.length
            where += _FRAME_RECORD_SIZE
        pos = end
        topics[name] = _span(name, frames)
    if pos != len(footer):
        raise _error(key, footer_position + pos, f"{len(footer) - pos} trailing footer bytes")
    if expected_position != footer_position:
        raise _error(
            key, footer_position, f"frames end at byte {expected_position}, not at the footer"
        )
    return Footer(topics, size, footer_position)
