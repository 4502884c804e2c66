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
"""

from __future__ import annotations

import struct
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import lz4.block
import zstandard
from crc32c import crc32c

from danube_ingest.errors import CorruptFrameError, FrameError, ObjectFormatError
from danube_ingest.wal.framing import (
    MAX_FRAME_BODY,
    BatchHeader,
    Entry,
    Kind,
    batch_header,
    decode_frame,
    decode_messages,
    decode_time,
    iter_frames,
    messages_frame,
)

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

#: Largest ``frame_target_bytes``: a reader decodes a whole frame to read one entry of it, and
#: frames beyond a few MiB no longer compress better.
MAX_FRAME_TARGET = 64 << 20

#: How many bytes a reader fetches first from the end of an object: the trailer and, for all but
#: huge footers (about 1300 frames), the whole footer.
FOOTER_GUESS_BYTES = 64 * 1024

#: Bytes of a MESSAGES entry besides its strings and payload (``framing._ENTRY``), used only to
#: size batches in :meth:`BinWriter.add_entries`.
_ENTRY_OVERHEAD = 48

GetRange = Callable[[str, int, int], Awaitable[bytes]]
"""``await get_range(key, offset, size)``: ``size`` bytes of object ``key`` from ``offset``."""


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


class _Topic:
    """A topic's frames in a writer: finished ones, and the raw data of the one being filled."""

    __slots__ = (
        "entries",
        "first_ms",
        "first_offset",
        "frames",
        "last_ms",
        "last_offset",
        "raw",
    )

    def __init__(self) -> None:
        self.frames: list[tuple[tuple[int, int, int, int, int], bytes, bytes]] = []
        """(first offset, last offset, entries, first ms, last ms), prefix, stored bytes."""
        self.raw = bytearray()
        self.entries = 0
        self.first_offset = 0
        self.last_offset = -1
        """Last offset added (in a finished frame or ``raw``)."""
        self.first_ms = 0
        self.last_ms = 0


class BinWriter:
    """Builds one ``.bin`` object in memory.

    Topics are laid out in the order they were first added, each contiguously, whatever the
    order of the ``add_*`` calls. A topic's data is cut into frames of about
    ``frame_target_bytes`` (uncompressed) at WAL frame boundaries: consecutive additions to a
    topic share a frame up to that size, and a larger addition is split.
    """

    def __init__(
        self, codec: str = "zstd", *, level: int | None = None, frame_target_bytes: int = 1 << 20
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        if level is not None and codec == "none":
            raise ValueError("codec 'none' takes no compression level")
        if not 1 <= frame_target_bytes <= MAX_FRAME_TARGET:
            raise ValueError(
                f"frame_target_bytes must be between 1 and {MAX_FRAME_TARGET}, "
                f"got {frame_target_bytes}"
            )
        self._codec = CODECS.index(codec)
        self._level = level
        self._zstd = zstandard.ZstdCompressor(level=3 if level is None else level)
        self._target = frame_target_bytes
        self._topics: dict[str, _Topic] = {}
        self._footer: Footer | None = None

    @property
    def footer(self) -> Footer:
        """The footer of the finished object."""
        if self._footer is None:
            raise RuntimeError("BinWriter.footer is only known after finish()")
        return self._footer

    def add_wal_frames(
        self,
        topic: str,
        data: bytes | memoryview,
        *,
        first_offset: int,
        last_offset: int,
        entries: int,
        first_ingest_ms: int,
        last_ingest_ms: int,
    ) -> None:
        """Add whole WAL frames of ``topic``: MESSAGES frames (and optionally TIME frames).

        ``data`` is copied. The metadata describes its MESSAGES frames: offsets of the first and
        last entry, number of entries, ingest times of the first and last entry; offsets must be
        above those already added for ``topic``. Raises :class:`ValueError` if the metadata does
        not match ``data`` (nothing is added then) and :class:`FrameError` if ``data`` is not a
        sequence of whole, valid WAL frames.
        """
        state = self._topic(topic)
        parts: list[tuple[memoryview, BatchHeader | None]] = []
        next_offset = state.last_offset + 1
        count = 0
        first_ms = last_ms = 0
        whole = data if isinstance(data, memoryview) else memoryview(data)
        for frame in iter_frames(whole):
            view = whole[frame.position : frame.end]
            if frame.kind == Kind.TIME:
                decode_time(frame.body)
                parts.append((view, None))
                continue
            if frame.kind != Kind.MESSAGES:
                raise ValueError(
                    f"topic {topic}: WAL frame at byte {frame.position} is of kind "
                    f"{Kind(frame.kind).name}; an object holds only MESSAGES and TIME frames"
                )
            batch = batch_header(frame.body)
            if batch.num_entries == 0 or batch.base_offset < next_offset:
                raise ValueError(
                    f"topic {topic}: WAL frame at byte {frame.position} holds offsets from "
                    f"{batch.base_offset} ({batch.num_entries} entries); expected at least one "
                    f"entry from offset {next_offset} on"
                )
            if count == 0:
                first_ms = batch.first_ingest_ms
                if batch.base_offset != first_offset:
                    raise ValueError(
                        f"topic {topic}: first_offset is {first_offset} "
                        f"but the data starts at offset {batch.base_offset}"
                    )
            next_offset = batch.base_offset + batch.num_entries
            last_ms = batch.last_ingest_ms
            count += batch.num_entries
            parts.append((view, batch))
        actual = (next_offset - 1, count, first_ms, last_ms)
        claimed = (last_offset, entries, first_ingest_ms, last_ingest_ms)
        if count == 0 or actual != claimed:
            raise ValueError(
                f"topic {topic}: metadata (last_offset, entries, first_ingest_ms, "
                f"last_ingest_ms) = {claimed} does not match the data: {actual}"
            )
        for view, header in parts:
            self._add(topic, state, (view,), len(view), header)

    def add_entries(self, topic: str, entries: Sequence[Entry]) -> None:
        """Add entries of ``topic``; their ``offset`` and ``ingest_ms`` must be set.

        Offsets must increase, and be above those already added for ``topic``.
        """
        state = self._topic(topic)
        batch: list[Entry] = []
        size = 0
        budget = self._target - len(state.raw) if state.entries else self._target
        previous = state.last_offset
        for entry in entries:
            offset = entry.offset
            if offset <= previous:
                raise ValueError(
                    f"topic {topic}: entry offset {offset} does not follow offset {previous}"
                )
            entry_size = _ENTRY_OVERHEAD + len(entry.payload) + len(entry.producer_name)
            if entry.routing_key is not None:
                entry_size += len(entry.routing_key)
            if entry.attributes:
                entry_size += sum(6 + len(k) + len(v) for k, v in entry.attributes.items())
            if batch and (offset != previous + 1 or size + entry_size > budget):
                self._add_batch(topic, state, batch)
                batch = []
                size = 0
                budget = self._target
            batch.append(entry)
            size += entry_size
            previous = offset
        if batch:
            self._add_batch(topic, state, batch)

    def finish(self) -> bytes:
        """The whole object. The writer cannot be used to add data afterwards."""
        if self._footer is not None:
            raise RuntimeError("BinWriter.finish() was already called")
        pieces = [HEADER]
        footer = bytearray(_U32.pack(len(self._topics)))
        spans: dict[str, TopicSpan] = {}
        position = HEADER_SIZE
        for name, state in self._topics.items():
            self._flush(state)
            refs: list[FrameRef] = []
            name_b = name.encode()
            footer += _U16.pack(len(name_b))
            footer += name_b
            footer += _U32.pack(len(state.frames))
            for meta, prefix, stored in state.frames:
                length = len(prefix) + len(stored)
                footer += _FRAME_RECORD.pack(*meta, position, length)
                refs.append(FrameRef(name, *meta, position, length))
                pieces += (prefix, stored)
                position += length
            spans[name] = _span(name, refs)
        self._topics = {}
        footer_position = position
        trailer_body = _TRAILER.pack(0, len(footer), crc32c(footer), MAGIC, FORMAT_VERSION, 0)[4:]
        pieces += (bytes(footer), _U32.pack(crc32c(trailer_body)), trailer_body)
        data = b"".join(pieces)
        self._footer = Footer(spans, len(data), footer_position)
        return data

    def _compress(self, raw: bytearray) -> bytes:
        if self._codec == _ZSTD:
            return self._zstd.compress(raw)
        if self._level is None:
            compressed: bytes = lz4.block.compress(raw, store_size=False)
        else:
            compressed = lz4.block.compress(
                raw, store_size=False, mode="high_compression", compression=self._level
            )
        return compressed

    def _topic(self, topic: str) -> _Topic:
        if self._footer is not None:
            raise RuntimeError("BinWriter.finish() was already called")
        state = self._topics.get(topic)
        if state is None:
            if not topic or len(topic.encode()) > 0xFFFF:
                raise ValueError(f"invalid topic name {topic!r}")
            state = _Topic()  # registered by _add: a failed or empty call adds no topic
        return state

    def _add_batch(self, topic: str, state: _Topic, batch: list[Entry]) -> None:
        first = batch[0]
        last = batch[-1]
        pieces = messages_frame(0, first.offset, batch)
        header = BatchHeader(0, first.offset, len(batch), first.ingest_ms, last.ingest_ms)
        self._add(topic, state, pieces, sum(len(piece) for piece in pieces), header)

    def _add(
        self,
        topic: str,
        state: _Topic,
        pieces: Sequence[bytes | memoryview],
        size: int,
        batch: BatchHeader | None,
    ) -> None:
        """Append one WAL frame (given as pieces) to ``topic``'s frame being filled."""
        self._topics.setdefault(topic, state)
        if batch is not None:
            if state.entries and len(state.raw) + size > self._target:
                self._flush(state)
            if not state.entries:
                state.first_offset = batch.base_offset
                state.first_ms = batch.first_ingest_ms
            state.entries += batch.num_entries
            state.last_offset = batch.base_offset + batch.num_entries - 1
            state.last_ms = batch.last_ingest_ms
        if len(state.raw) + size > MAX_RAW_LEN:
            raise ValueError(f"topic {topic}: a frame would exceed {MAX_RAW_LEN} bytes")
        for piece in pieces:
            state.raw += piece

    def _flush(self, state: _Topic) -> None:
        """Compress the frame being filled and append it to the topic's finished frames."""
        if not state.entries:
            return
        raw = state.raw
        codec = self._codec
        stored = b"" if codec == _NONE else self._compress(raw)
        if codec == _NONE or len(stored) >= len(raw):
            codec = _NONE
            stored = bytes(raw)
        head = _FRAME_HEAD.pack(len(stored), codec, 0, 0, len(raw), crc32c(stored))
        meta = (state.first_offset, state.last_offset, state.entries, state.first_ms, state.last_ms)
        state.frames.append((meta, head + _U32.pack(crc32c(head)), stored))
        state.raw = bytearray()
        state.entries = 0


def _error(key: str, position: int | None, reason: str) -> ObjectFormatError:
    return ObjectFormatError(key, position, reason)


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


def parse_object(data: bytes | memoryview, key: str = "?") -> Footer:
    """The footer of a whole object held in memory, after checking its header.

    Raises :class:`ObjectFormatError` if the header, footer or trailer is invalid. Frames are
    checked when decoded (:func:`decode_frame_bytes`).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    if len(view) < MIN_OBJECT_SIZE:
        raise _error(key, None, f"{len(view)} bytes is too small for a .bin object")
    magic, version, flags = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise _error(key, 0, "no .bin header (not a .bin object)")
    if version != FORMAT_VERSION:
        raise _error(key, 0, f"unknown format version {version} (expected {FORMAT_VERSION})")
    if flags:
        raise _error(key, 0, f"unknown flags {flags:#x}")
    footer = read_footer(view, len(view), key)
    assert not isinstance(footer, int)  # the tail is the whole object
    return footer


def decode_frame_bytes(data: bytes | memoryview, ref: FrameRef, key: str = "?") -> list[Entry]:
    """The entries of the frame ``ref``; ``data`` is exactly its bytes (``ref.length``).

    Returns entries with offsets from ``ref.first_offset`` to ``ref.last_offset``, in order,
    after checking both CRCs and that the frame holds exactly what ``ref`` says. Raises
    :class:`ObjectFormatError` otherwise. However damaged ``data`` is, it never decompresses
    more than the frame's ``raw_len`` (at most ``MAX_RAW_LEN``) bytes.
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    position = ref.position
    if len(view) != ref.length or len(view) < FRAME_PREFIX_SIZE:
        raise _error(key, position, f"frame of {len(view)} bytes, expected {ref.length}")
    stored_len, codec, reserved8, reserved16, raw_len, stored_crc, prefix_crc = (
        _FRAME_PREFIX.unpack_from(view, 0)
    )
    if crc32c(view[: FRAME_PREFIX_SIZE - 4]) != prefix_crc:
        raise _error(key, position, "frame prefix CRC mismatch")
    if (
        reserved8
        or reserved16
        or codec >= len(CODECS)
        or stored_len != len(view) - FRAME_PREFIX_SIZE
        or not stored_len <= raw_len <= MAX_RAW_LEN
        or (codec == _NONE and stored_len != raw_len)
    ):
        raise _error(
            key,
            position,
            f"invalid frame prefix (codec {codec}, stored {stored_len}, raw {raw_len} bytes)",
        )
    stored = view[FRAME_PREFIX_SIZE:]
    if crc32c(stored) != stored_crc:
        raise _error(key, position, "frame CRC mismatch")
    raw = _decompress(codec, stored, raw_len, key, position)
    # WAL positions map to object positions only in an uncompressed frame.
    base = position + FRAME_PREFIX_SIZE if codec == _NONE else None
    return _decode_wal_frames(raw, ref, key, base)


def _decompress(codec: int, stored: memoryview, raw_len: int, key: str, position: int) -> bytes:
    try:
        if codec == _NONE:
            return stored  # type: ignore[return-value]
        if codec == _ZSTD:
            # The zstd frame header's content size decides the allocation: check it first.
            content_size = zstandard.frame_content_size(stored)
            if content_size != raw_len:
                raise _error(key, position, f"zstd content size {content_size} != {raw_len}")
            raw: bytes = zstandard.ZstdDecompressor().decompress(
                stored, max_output_size=raw_len, allow_extra_data=False
            )
        else:
            raw = lz4.block.decompress(stored, uncompressed_size=raw_len)
    except (zstandard.ZstdError, lz4.block.LZ4BlockError) as exc:
        raise _error(key, position, f"{CODECS[codec]} frame does not decompress: {exc}") from exc
    if len(raw) != raw_len:
        raise _error(key, position, f"frame decompresses to {len(raw)} bytes, not {raw_len}")
    return raw


def _decode_wal_frames(
    raw: bytes | memoryview, ref: FrameRef, key: str, base: int | None
) -> list[Entry]:
    view = raw if isinstance(raw, memoryview) else memoryview(raw)
    result: list[Entry] = []
    first = last = None
    position = 0
    while position < len(view):
        try:
            frame = decode_frame(view, position)
            if frame.kind == Kind.TIME:
                decode_time(frame.body)
            elif frame.kind == Kind.MESSAGES:
                last, entries = decode_messages(frame.body)
                if not entries or (result and last.base_offset <= result[-1].offset):
                    raise CorruptFrameError("MESSAGES offsets do not increase")
                first = first or last
                result += entries
            else:
                raise CorruptFrameError(f"WAL frame of kind {frame.kind}")
        except FrameError as exc:
            raise _bad_wal(key, ref, base, position, str(exc)) from exc
        position = frame.end
    if (
        first is None
        or last is None
        or (first.base_offset, first.first_ingest_ms) != (ref.first_offset, ref.first_ingest_ms)
        or (result[-1].offset, last.last_ingest_ms) != (ref.last_offset, ref.last_ingest_ms)
        or len(result) != ref.entries
    ):
        raise _bad_wal(key, ref, base, 0, "frame content does not match its footer record")
    return result


def _bad_wal(
    key: str, ref: FrameRef, base: int | None, wal_position: int, reason: str
) -> ObjectFormatError:
    if base is None:
        return _error(key, ref.position, f"at byte {wal_position} of the frame's data: {reason}")
    return _error(key, base + wal_position, reason)


def decode_range(
    data: bytes | memoryview, span: TopicSpan, start_position: int, key: str = "?"
) -> Iterator[tuple[FrameRef, list[Entry]]]:
    """Decode the frames of ``span`` in ``data``, the object's bytes from ``start_position``.

    ``start_position`` must be the position of one of the span's frames; the frames are yielded
    in order up to the end of ``data`` (bytes past the span are ignored). Raises
    :class:`ObjectFormatError` (when iterated) if ``data`` ends inside a frame or a frame does
    not decode.
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    frames = span.frames
    index = bisect_left(frames, start_position, key=lambda frame: frame.position)
    if index == len(frames) or frames[index].position != start_position:
        raise _error(key, start_position, f"no frame of topic {span.topic} starts here")
    end = start_position + len(view)
    for ref in frames[index:]:
        if ref.position >= end:
            return
        if ref.position + ref.length > end:
            raise _error(key, end, f"range ends inside the frame at byte {ref.position}")
        start = ref.position - start_position
        yield ref, decode_frame_bytes(view[start : start + ref.length], ref, key)


async def read_footer_from(get_range: GetRange, size: int, key: str) -> Footer:
    """Read the footer of the ``size``-byte object ``key`` with one ranged read (two when the
    footer is larger than about ``FOOTER_GUESS_BYTES``)."""
    if size < MIN_OBJECT_SIZE:
        raise _error(key, None, f"{size} bytes is too small for a .bin object")
    guess = min(size, FOOTER_GUESS_BYTES)
    tail = await _read(get_range, key, size - guess, guess)
    footer = read_footer(tail, size, key)
    if isinstance(footer, int):
        head = await _read(get_range, key, size - footer, footer - len(tail))
        footer = read_footer(head + tail, size, key)
        if isinstance(footer, int):
            raise _error(key, None, "footer size changed between two reads")
    return footer


async def _read(get_range: GetRange, key: str, offset: int, size: int) -> bytes:
    data = bytes(await get_range(key, offset, size))
    if len(data) != size:
        raise _error(key, offset, f"ranged read returned {len(data)} bytes, expected {size}")
    return data
