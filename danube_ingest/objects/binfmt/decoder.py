"""Reading ``.bin`` objects: the header and footer, frames, ranges of a topic's frames.

The byte layout is described in :mod:`danube_ingest.objects.binfmt.layout`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator

import lz4.block
import zstandard
from crc32c import crc32c

from danube_ingest.errors import CorruptFrameError, FrameError, ObjectFormatError
from danube_ingest.objects.binfmt.layout import (
    _FRAME_PREFIX,
    _HEADER,
    _NONE,
    _ZSTD,
    CODECS,
    FORMAT_VERSION,
    FRAME_PREFIX_SIZE,
    MAGIC,
    MAX_RAW_LEN,
    MIN_OBJECT_SIZE,
    Footer,
    FrameRef,
    TopicSpan,
    _error,
    read_footer,
)
from danube_ingest.wal.framing import (
    BatchHeader,
    Entry,
    Kind,
    batch_header,
    decode_frame,
    decode_messages,
    decode_time,
)
from danube_ingest.wal.stored import StoredEntries

#: How many bytes a reader fetches first from the end of an object: the trailer and, for all but
#: huge footers (about 1300 frames), the whole footer.
FOOTER_GUESS_BYTES = 64 * 1024

GetRange = Callable[[str, int, int], Awaitable[bytes]]
"""``await get_range(key, offset, size)``: ``size`` bytes of object ``key`` from ``offset``."""


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


def _frame_data(
    data: bytes | memoryview, ref: FrameRef, key: str
) -> tuple[bytes | memoryview, int]:
    """The decompressed data of the frame ``ref`` and its codec, after checking both CRCs."""
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
    return _decompress(codec, stored, raw_len, key, position), codec


def decode_frame_bytes(data: bytes | memoryview, ref: FrameRef, key: str = "?") -> list[Entry]:
    """The entries of the frame ``ref``; ``data`` is exactly its bytes (``ref.length``).

    Returns entries with offsets from ``ref.first_offset`` to ``ref.last_offset``, in order,
    after checking both CRCs and that the frame holds exactly what ``ref`` says. Raises
    :class:`ObjectFormatError` otherwise. However damaged ``data`` is, it never decompresses
    more than the frame's ``raw_len`` (at most ``MAX_RAW_LEN``) bytes.
    """
    raw, codec = _frame_data(data, ref, key)
    # WAL positions map to object positions only in an uncompressed frame.
    base = ref.position + FRAME_PREFIX_SIZE if codec == _NONE else None
    return _decode_wal_frames(raw, ref, key, base)


def frame_wal_bytes(data: bytes | memoryview, ref: FrameRef, key: str = "?") -> bytes | memoryview:
    """The WAL frames the frame ``ref`` stores, decompressed; ``data`` is exactly its bytes.

    Both CRCs of the object frame are checked (:class:`ObjectFormatError` otherwise), the WAL
    frames inside are not: give them to :meth:`BinWriter.add_wal_frames`, which checks them
    against ``ref``'s offsets, entries and times. For copying frames into another object
    without decoding their entries. An uncompressed frame comes back as a view of ``data``.
    """
    return _frame_data(data, ref, key)[0]


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


def stored_frame_bytes(data: bytes | memoryview, ref: FrameRef, key: str = "?") -> StoredEntries:
    """:func:`decode_frame_bytes` without building an ``Entry`` per message: the frame's
    MESSAGES bodies with their entries' bounds (:class:`StoredEntries`), after the same checks
    (both object frame CRCs, every WAL frame's CRC, that the entries tile each body, and that
    the frame holds exactly what ``ref`` says). Raises :class:`ObjectFormatError` otherwise."""
    raw, codec = _frame_data(data, ref, key)
    base = ref.position + FRAME_PREFIX_SIZE if codec == _NONE else None
    parts: list[StoredEntries] = []
    _walk_wal_frames(raw, ref, key, base, lambda body: _stored_part(body, parts))
    return StoredEntries.join(parts)


def _stored_part(body: memoryview, parts: list[StoredEntries]) -> BatchHeader:
    stored = bytes(body)
    header = batch_header(stored)
    parts.append(StoredEntries.of_body(stored))
    return header


def _decode_wal_frames(
    raw: bytes | memoryview, ref: FrameRef, key: str, base: int | None
) -> list[Entry]:
    result: list[Entry] = []

    def decode(body: memoryview) -> BatchHeader:
        header, entries = decode_messages(body)
        result.extend(entries)
        return header

    _walk_wal_frames(raw, ref, key, base, decode)
    return result


def _walk_wal_frames(
    raw: bytes | memoryview,
    ref: FrameRef,
    key: str,
    base: int | None,
    messages: Callable[[memoryview], BatchHeader],
) -> None:
    """Walk the WAL frames of an object frame's data, giving each MESSAGES body to
    ``messages``; check that they hold exactly what ``ref`` says."""
    view = raw if isinstance(raw, memoryview) else memoryview(raw)
    first = last = None
    count = 0
    position = 0
    while position < len(view):
        try:
            frame = decode_frame(view, position)
            if frame.kind == Kind.TIME:
                decode_time(frame.body)
            elif frame.kind == Kind.MESSAGES:
                header = messages(frame.body)
                if not header.num_entries or (
                    last is not None
                    and header.base_offset <= last.base_offset + last.num_entries - 1
                ):
                    raise CorruptFrameError("MESSAGES offsets do not increase")
                first = first or header
                last = header
                count += header.num_entries
            else:
                raise CorruptFrameError(f"WAL frame of kind {frame.kind}")
        except FrameError as exc:
            raise _bad_wal(key, ref, base, position, str(exc)) from exc
        position = frame.end
    if (
        first is None
        or last is None
        or (first.base_offset, first.first_ingest_ms) != (ref.first_offset, ref.first_ingest_ms)
        or (last.base_offset + last.num_entries - 1, last.last_ingest_ms)
        != (ref.last_offset, ref.last_ingest_ms)
        or count != ref.entries
    ):
        raise _bad_wal(key, ref, base, 0, "frame content does not match its footer record")


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
