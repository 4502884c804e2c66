"""WAL frame format.

A WAL segment file is a sequence of frames. All integers are little-endian.

Frame (16-byte prefix, then the body)::

    offset  size  field
    0       4     length        u32, number of body bytes after the prefix
    4       1     kind          u8, one of Kind
    5       1     version       u8, FORMAT_VERSION (1)
    6       2     reserved      u16, zero
    8       4     body_crc      u32, CRC32C of the body
    12      4     header_crc    u32, CRC32C of bytes 0..12 of this prefix
    16      ...   body

Why a header CRC rather than 8-byte alignment (etcd's choice): alignment keeps a length field
from straddling a sector, so it relies on the device writing sectors atomically and still cannot
tell a zeroed or garbage length from a real one. A CRC over the prefix rejects any damaged length
before we trust it to skip ahead, costs one 12-byte CRC per frame and no padding, and makes
re-synchronisation after damage reliable: a random position passes the check with probability
2**-32. Recovery uses that to tell a torn tail (no valid frame after the damage) from corruption
in the middle of a segment (a valid frame after the damage).

Bodies by kind:

``MESSAGES`` (1): one topic's batch of consecutive offsets (as Kafka's record batches, so one
CRC covers many small entries and recovery verifies a batch with one call)::

    u32 topic_id | u64 base_offset | u32 count | i64 first_ingest_ms | i64 last_ingest_ms
    then `count` entries, entry i having offset base_offset + i:
    i64 ingest_ms | i64 publish_ms | u64 producer_id | u64 request_id | u64 schema_id
    | u32 schema_version | u8 flags (1: has schema, 2: has routing key)
    | u16 producer_name_len | u16 routing_key_len | u16 attribute_count | u32 payload_len
    | producer_name (utf-8) | routing_key (utf-8)
    | attribute_count x (u16 key_len | u32 value_len | key (utf-8) | value (utf-8))
    | payload

What an entry may hold follows from these widths (``entry_size`` checks it before the log
assigns an offset, so an entry that cannot be framed is refused, never half-staged): producer
name, routing key and each attribute key at most ``MAX_SHORT_FIELD`` (65,535) UTF-8 bytes, at
most 65,535 attributes, an attribute value or payload below 4 GiB, and the whole entry within
``MAX_ENTRY_BODY``; ``publish_ms`` fits an i64, the ids a u64, ``schema_version`` a u32.

``TOPIC`` (2): ``u32 topic_id | u16 name_len | name (utf-8)``. Binds a region-wide topic id to
its name. Written in every segment before the topic's first MESSAGES frame there, so each
segment (and the object uploaded from it) decodes on its own.

``TIME`` (3): ``u32 topic_id | u64 next_offset | i64 ingest_ms``. A time-advance marker: the
topic will never receive an entry with an ingest time below ``ingest_ms``.

``CHECKPOINT`` (4): ``u64 segment_seq | i64 created_ms | u16 region_len | region (utf-8)``.
The first frame of every segment.

``DROP`` (5): ``u32 topic_id | u64 next_offset``. The topic was deleted (its owner fenced it):
every frame of ``topic_id`` before this one belongs to a deleted incarnation and is forgotten
(recovery drops the topic's state, the uploader skips its frames, the cleaner no longer keeps
segments for it). Topic ids are never reused in a region, so a topic created again with the
same name is registered under a new id and starts clean. ``next_offset`` is the offset the
dropped incarnation had reached (for diagnostics).
"""

from __future__ import annotations

import struct
from collections.abc import Generator, Iterator, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from crc32c import crc32c

from danube_ingest.errors import CorruptFrameError, InvalidEntryError, TruncatedFrameError

FORMAT_VERSION = 1

#: Upper bound on one frame's body. Protects readers from allocating on a garbage length that
#: happens to pass the header CRC; also the largest batch a single append call may produce.
MAX_FRAME_BODY = 256 * 1024 * 1024

#: Longest producer name, routing key, attribute key or topic name in UTF-8 bytes, and most
#: attributes on one entry: their lengths (and the count) are u16 fields.
MAX_SHORT_FIELD = 0xFFFF
#: Largest attribute value or payload (u32 length fields).
MAX_LONG_FIELD = 0xFFFF_FFFF
_MAX_U64 = 0xFFFF_FFFF_FFFF_FFFF
_MAX_U32 = 0xFFFF_FFFF
_MIN_I64 = -(1 << 63)
_MAX_I64 = (1 << 63) - 1

#: Parts (payloads) of at least this many bytes stay separate buffers instead of being copied
#: into the frame body; smaller ones are cheaper to copy than to CRC and write one by one.
_LARGE_PAYLOAD = 64 * 1024


class Kind(IntEnum):
    MESSAGES = 1
    TOPIC = 2
    TIME = 3
    CHECKPOINT = 4
    DROP = 5


_PREFIX = struct.Struct("<IBBHII")
_PREFIX_HEAD = struct.Struct("<IBBHI")
PREFIX_SIZE = _PREFIX.size  # 16
_BATCH = struct.Struct("<IQIqq")
BATCH_HEADER_SIZE = _BATCH.size  # 32
_ENTRY = struct.Struct("<qqQQQIBHHHI")
#: An entry's fixed header, and where its four length fields (name, routing key, attribute
#: count, payload: ``ENTRY_LENGTHS``) start in it; readers that walk stored entries without
#: decoding them (``wal.stored``) use these rather than a second copy of the layout.
ENTRY_HEADER_SIZE = _ENTRY.size  # 55
ENTRY_LENGTHS_AT = struct.calcsize(_ENTRY.format[: -len("HHHI")])  # 45
ENTRY_LENGTHS = struct.Struct("<HHHI")
_ATTR = struct.Struct("<HI")
_TOPIC = struct.Struct("<IH")
_TIME = struct.Struct("<IQq")
_CHECKPOINT = struct.Struct("<QqH")
_DROP = struct.Struct("<IQ")

#: Largest encoded entry: one alone must fit a MESSAGES frame after its batch header.
MAX_ENTRY_BODY = MAX_FRAME_BODY - BATCH_HEADER_SIZE

_HAS_SCHEMA = 1
_HAS_KEY = 2
_KINDS = frozenset(int(k) for k in Kind)


#: The message fields of an Entry (what equality compares).
_FIELDS = (
    "attributes",
    "ingest_ms",
    "offset",
    "payload",
    "producer_id",
    "producer_name",
    "publish_ms",
    "request_id",
    "routing_key",
    "schema_id",
    "schema_version",
)


class Entry:
    """One stored message.

    The caller fills the message fields; the store assigns ``offset`` and ``ingest_ms`` when the
    entry is appended and owns the object from then on (it is shared with readers, do not mutate
    it after appending).
    """

    __slots__ = ("_batch", "_end", "_src", "_start", *_FIELDS)

    def __init__(
        self,
        payload: bytes,
        *,
        publish_ms: int = 0,
        producer_name: str = "",
        routing_key: str | None = None,
        attributes: dict[str, str] | None = None,
        schema_id: int | None = None,
        schema_version: int = 0,
        producer_id: int = 0,
        request_id: int = 0,
        offset: int = -1,
        ingest_ms: int = 0,
    ) -> None:
        self.payload = payload
        self.publish_ms = publish_ms
        self.producer_name = producer_name
        self.routing_key = routing_key
        self.attributes = attributes
        self.schema_id = schema_id
        self.schema_version = schema_version
        self.producer_id = producer_id
        self.request_id = request_id
        self.offset = offset
        self.ingest_ms = ingest_ms
        self._batch: Any = None
        # Decoded entries: the body they were decoded from and their span in it (the stored
        # bytes, served again without re-encoding: see ``wal.block.served_block``).
        self._src: bytes | None = None
        self._start = 0
        self._end = 0

    def __await__(self) -> Generator[Any, None, int]:
        """Wait until the store made this (appended) entry durable; return its offset."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("entry was not appended to a store")
        if not batch._done:
            batch._asyncio_future_blocking = True
            yield batch
        if batch._exception is not None:
            raise batch._exception
        return self.offset

    def _key(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) or None for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.offset, self.payload))

    def __repr__(self) -> str:
        return (
            f"Entry(offset={self.offset}, ingest_ms={self.ingest_ms}, "
            f"producer_name={self.producer_name!r}, payload={self.payload[:32]!r})"
        )


class FrameInfo(NamedTuple):
    """A decoded frame: where it starts, what it is, and its body."""

    position: int
    """Byte offset of the frame's prefix in the buffer or file."""
    kind: int
    """One of :class:`Kind`."""
    body: memoryview
    """The frame body (a view into the decoded buffer)."""
    end: int
    """Byte offset just past the frame."""


class BatchHeader(NamedTuple):
    topic_id: int
    base_offset: int
    num_entries: int
    first_ingest_ms: int
    last_ingest_ms: int


def utf8_len(value: str) -> int:
    """Length of ``value`` in UTF-8 bytes; ValueError (a UnicodeEncodeError) for a string that
    has no UTF-8 form (a lone surrogate). Free for ASCII strings."""
    if value.isascii():
        return len(value)
    return len(value.encode())


def _short_field(what: str, value: str) -> int:
    try:
        size = utf8_len(value)
    except UnicodeEncodeError:
        raise InvalidEntryError(f"{what} is not valid unicode (a lone surrogate)") from None
    if size > MAX_SHORT_FIELD:
        raise InvalidEntryError(f"{what} of {size} UTF-8 bytes exceeds {MAX_SHORT_FIELD}")
    return size


def _integer(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidEntryError(f"{what} {value} is outside [{low}, {high}]")


def entry_size(entry: Entry) -> int:
    """Bytes ``entry`` takes in a MESSAGES body, once it is checked to be framable.

    Raises :class:`InvalidEntryError` naming the first field the frame cannot hold (see the
    module docstring), so that a caller can refuse the entry before giving it an offset:
    ``messages_frame`` cannot fail on an entry that passed.
    """
    name = entry.producer_name
    if name.isascii() and len(name) <= MAX_SHORT_FIELD:
        size = _ENTRY.size + len(name)
    else:
        size = _ENTRY.size + _short_field("producer name", name)
    key = entry.routing_key
    if key is not None:
        size += _short_field("routing key", key)
    attrs = entry.attributes
    if attrs:
        if len(attrs) > MAX_SHORT_FIELD:
            raise InvalidEntryError(f"{len(attrs)} attributes exceed {MAX_SHORT_FIELD}")
        for akey, value in attrs.items():
            size += _ATTR.size + _short_field("attribute key", akey)
            try:
                vlen = utf8_len(value)
            except UnicodeEncodeError:
                raise InvalidEntryError(
                    "attribute value is not valid unicode (a lone surrogate)"
                ) from None
            if vlen > MAX_LONG_FIELD:
                raise InvalidEntryError(f"attribute value of {vlen} bytes exceeds {MAX_LONG_FIELD}")
            size += vlen
    payload_len = len(entry.payload)
    size += payload_len
    if size > MAX_ENTRY_BODY:
        raise InvalidEntryError(f"entry of {size} encoded bytes exceeds {MAX_ENTRY_BODY}")
    schema_id = entry.schema_id
    if not (
        _MIN_I64 <= entry.publish_ms <= _MAX_I64
        and 0 <= entry.producer_id <= _MAX_U64
        and 0 <= entry.request_id <= _MAX_U64
        and 0 <= entry.schema_version <= _MAX_U32
        and (schema_id is None or 0 <= schema_id <= _MAX_U64)
    ):
        # (One comparison chain on the common path; name the field only when one is wrong.)
        _integer("publish_ms", entry.publish_ms, _MIN_I64, _MAX_I64)
        _integer("producer_id", entry.producer_id, 0, _MAX_U64)
        _integer("request_id", entry.request_id, 0, _MAX_U64)
        _integer("schema_version", entry.schema_version, 0, _MAX_U32)
        _integer("schema_id", schema_id or 0, 0, _MAX_U64)
    return size


def check_topic_name(name: str) -> None:
    """Raise :class:`InvalidEntryError` unless ``name`` fits a TOPIC frame."""
    shown = repr(name) if len(name) <= 64 else f"{name[:64]!r}..."
    _short_field(f"topic name {shown}", name)


def _frame(kind: int, pieces: list[bytes | bytearray]) -> list[bytes]:
    """Prefix ``pieces`` (the body, in order) with the frame header; CRC'd in place, no copy."""
    total = 0
    crc = 0
    for piece in pieces:
        total += len(piece)
    if total > MAX_FRAME_BODY:
        raise CorruptFrameError(f"frame body of {total} bytes exceeds {MAX_FRAME_BODY}")
    for piece in pieces:
        crc = crc32c(piece, crc)
    head = _PREFIX_HEAD.pack(total, kind, FORMAT_VERSION, 0, crc)
    return [head + crc32c(head).to_bytes(4, "little"), *pieces]  # type: ignore[list-item]


def frame_pieces(kind: int, body_parts: Sequence[bytes]) -> list[bytes]:
    """Frame a body given as parts; returns buffers whose concatenation is the frame.

    Parts of at least ``_LARGE_PAYLOAD`` bytes are kept as they are (a large payload is never
    copied here); runs of smaller parts between them are joined, so a small body is one buffer.
    """
    pieces: list[bytes | bytearray] = []
    run: list[bytes] = []
    for part in body_parts:
        if len(part) < _LARGE_PAYLOAD:
            run.append(part)
            continue
        if run:
            pieces.append(b"".join(run))
            run = []
        pieces.append(part)
    if run or not pieces:
        pieces.append(b"".join(run))
    return _frame(kind, pieces)


def encode_frame(kind: int, body: bytes) -> bytes:
    """Frame one body: the prefix followed by ``body``."""
    return b"".join(frame_pieces(kind, (body,)))


def messages_frame(topic_id: int, base_offset: int, entries: Sequence[Entry]) -> list[bytes]:
    """Frame a batch of one topic's entries with consecutive offsets from ``base_offset``.

    Returns buffers whose concatenation is the frame. Small entries are packed into one
    growing buffer (one CRC call for all of them); a payload of at least ``_LARGE_PAYLOAD``
    bytes stays a separate buffer, so a large payload is never copied here.
    """
    pack = _ENTRY.pack
    buf = bytearray(BATCH_HEADER_SIZE)
    pieces: list[bytes | bytearray] = []
    last_name: str | None = None
    name_b = b""
    name_len = 0
    for entry in entries:
        name = entry.producer_name
        if name is not last_name:
            name_b = name.encode()
            name_len = len(name_b)
            last_name = name
        key = entry.routing_key
        schema_id = entry.schema_id
        attrs = entry.attributes
        payload = entry.payload
        payload_len = len(payload)
        if key is None and schema_id is None and not attrs:
            buf += pack(
                entry.ingest_ms,
                entry.publish_ms,
                entry.producer_id,
                entry.request_id,
                0,
                entry.schema_version,
                0,
                name_len,
                0,
                0,
                payload_len,
            )
            if name_len:
                buf += name_b
        else:
            flags = 0
            key_b = b""
            if key is not None:
                flags = _HAS_KEY
                key_b = key.encode()
            if schema_id is not None:
                flags |= _HAS_SCHEMA
            else:
                schema_id = 0
            buf += pack(
                entry.ingest_ms,
                entry.publish_ms,
                entry.producer_id,
                entry.request_id,
                schema_id,
                entry.schema_version,
                flags,
                name_len,
                len(key_b),
                len(attrs) if attrs else 0,
                payload_len,
            )
            buf += name_b
            buf += key_b
            if attrs:
                for akey, value in attrs.items():
                    kb = akey.encode()
                    vb = value.encode()
                    buf += _ATTR.pack(len(kb), len(vb))
                    buf += kb
                    buf += vb
        if payload_len >= _LARGE_PAYLOAD:
            pieces.append(buf)
            pieces.append(payload)
            buf = bytearray()
        else:
            buf += payload
    if buf or not pieces:
        pieces.append(buf)
    first = pieces[0]
    assert isinstance(first, bytearray)
    _BATCH.pack_into(
        first, 0, topic_id, base_offset, len(entries), entries[0].ingest_ms, entries[-1].ingest_ms
    )
    return _frame(Kind.MESSAGES, pieces)


def topic_frame(topic_id: int, name: str) -> bytes:
    name_b = name.encode()
    return encode_frame(Kind.TOPIC, _TOPIC.pack(topic_id, len(name_b)) + name_b)


def time_frame(topic_id: int, next_offset: int, ingest_ms: int) -> bytes:
    return encode_frame(Kind.TIME, _TIME.pack(topic_id, next_offset, ingest_ms))


def drop_frame(topic_id: int, next_offset: int) -> bytes:
    return encode_frame(Kind.DROP, _DROP.pack(topic_id, next_offset))


def checkpoint_frame(segment_seq: int, created_ms: int, region: str) -> bytes:
    region_b = region.encode()
    return encode_frame(
        Kind.CHECKPOINT, _CHECKPOINT.pack(segment_seq, created_ms, len(region_b)) + region_b
    )


def decode_frame(buf: bytes | bytearray | memoryview, position: int = 0) -> FrameInfo:
    """Decode the frame starting at ``position`` of ``buf``.

    Raises :class:`TruncatedFrameError` when ``buf`` ends inside the frame (a torn tail) and
    :class:`CorruptFrameError` when a CRC, the version, the kind or the length is wrong.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    available = len(view) - position
    if available < PREFIX_SIZE:
        raise TruncatedFrameError(
            f"frame prefix needs {PREFIX_SIZE} bytes, {available} left", position
        )
    length, kind, version, _reserved, body_crc, header_crc = _PREFIX.unpack_from(view, position)
    if crc32c(view[position : position + 12]) != header_crc:
        raise CorruptFrameError("frame header CRC mismatch", position)
    if version != FORMAT_VERSION or kind not in _KINDS or length > MAX_FRAME_BODY:
        raise CorruptFrameError(
            f"invalid frame header (version {version}, kind {kind}, length {length})", position
        )
    start = position + PREFIX_SIZE
    end = start + length
    if end > len(view):
        raise TruncatedFrameError(
            f"frame body needs {length} bytes, {len(view) - start} left", position
        )
    body = view[start:end]
    if crc32c(body) != body_crc:
        raise CorruptFrameError("frame body CRC mismatch", position)
    return FrameInfo(position, kind, body, end)


def iter_frames(buf: bytes | bytearray | memoryview, position: int = 0) -> Iterator[FrameInfo]:
    """Yield every frame of ``buf`` from ``position`` to its end, verifying each CRC.

    Raises the :class:`FrameError` of the first frame that does not decode; the frames before it
    have been yielded.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    end = len(view)
    while position < end:
        frame = decode_frame(view, position)
        yield frame
        position = frame.end


def batch_header(body: memoryview | bytes) -> BatchHeader:
    """The header of a MESSAGES body, without decoding its entries."""
    if len(body) < BATCH_HEADER_SIZE:
        raise CorruptFrameError(f"MESSAGES body of {len(body)} bytes is too short")
    return BatchHeader._make(_BATCH.unpack_from(body, 0))


def decode_messages(
    body: memoryview | bytes,
    skip: int = 0,
    limit: int | None = None,
    *,
    resume: tuple[int, int] | None = None,
) -> tuple[BatchHeader, list[Entry]]:
    """Decode a MESSAGES body into its header and entries (offsets filled in).

    With ``skip`` and ``limit``, only entries ``[skip, skip + limit)`` are built (the ones
    skipped are only walked over; the body's end is checked only when the last entry is
    decoded). ``resume=(i, pos)``: entry ``i`` starts at byte ``pos`` of ``body`` (the ``_end``
    of entry ``i - 1`` from an earlier decode of the same body), so the walk to ``skip`` starts
    there (ignored unless ``0 < i <= skip``). The hot loop of every catch-up read: entries are
    built without a keyword call, and a producer name equal to the previous entry's is not
    decoded again.
    """
    header = batch_header(body)
    data = bytes(body)
    entries: list[Entry] = []
    append = entries.append
    pos = BATCH_HEADER_SIZE
    unpack = _ENTRY.unpack_from
    entry_size = _ENTRY.size
    attr_unpack = _ATTR.unpack_from
    attr_size = _ATTR.size
    skip = min(max(skip, 0), header.num_entries)
    walk = skip
    if resume is not None and 0 < resume[0] <= skip:
        walk = skip - resume[0]
        pos = resume[1]
    count = header.num_entries - skip
    if limit is not None and limit < count:
        count = max(limit, 0)
    offset = header.base_offset + skip
    new = Entry.__new__
    last_name_b = b""
    last_name = ""
    try:
        for _ in range(walk):
            *_fields, name_len, key_len, attr_count, payload_len = unpack(data, pos)
            pos += entry_size + name_len + key_len
            for _a in range(attr_count):
                klen, vlen = attr_unpack(data, pos)
                pos += attr_size + klen + vlen
            pos += payload_len
        for _ in range(count):
            start = pos
            (
                ingest_ms,
                publish_ms,
                producer_id,
                request_id,
                schema_id,
                schema_version,
                flags,
                name_len,
                key_len,
                attr_count,
                payload_len,
            ) = unpack(data, pos)
            pos += entry_size
            name = ""
            if name_len:
                end = pos + name_len
                if name_len == len(last_name_b) and data.startswith(last_name_b, pos):
                    name = last_name
                else:
                    last_name_b = data[pos:end]
                    name = last_name = last_name_b.decode()
                pos = end
            key: str | None = None
            if flags & _HAS_KEY:
                key = data[pos : pos + key_len].decode()
            pos += key_len
            attrs: dict[str, str] | None = None
            if attr_count:
                attrs = {}
                for _a in range(attr_count):
                    klen, vlen = attr_unpack(data, pos)
                    pos += attr_size
                    akey = data[pos : pos + klen].decode()
                    pos += klen
                    attrs[akey] = data[pos : pos + vlen].decode()
                    pos += vlen
            end = pos + payload_len
            if end > len(data):
                raise CorruptFrameError("MESSAGES entry runs past the end of its body")
            entry = new(Entry)
            entry.payload = data[pos:end]
            entry.publish_ms = publish_ms
            entry.producer_name = name
            entry.routing_key = key
            entry.attributes = attrs
            entry.schema_id = schema_id if flags & _HAS_SCHEMA else None
            entry.schema_version = schema_version
            entry.producer_id = producer_id
            entry.request_id = request_id
            entry.offset = offset
            entry.ingest_ms = ingest_ms
            entry._batch = None
            entry._src = data
            entry._start = start
            entry._end = end
            append(entry)
            pos = end
            offset += 1
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptFrameError(f"MESSAGES body does not decode: {exc}") from exc
    if skip + count == header.num_entries and pos != len(data):
        raise CorruptFrameError(f"MESSAGES body has {len(data) - pos} trailing bytes")
    return header, entries


def decode_topic(body: memoryview | bytes) -> tuple[int, str]:
    try:
        topic_id, name_len = _TOPIC.unpack_from(body, 0)
        name_b = bytes(body[_TOPIC.size : _TOPIC.size + name_len])
        if len(name_b) != name_len or len(body) != _TOPIC.size + name_len:
            raise CorruptFrameError("TOPIC body length mismatch")
        return topic_id, name_b.decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptFrameError(f"TOPIC body does not decode: {exc}") from exc


def decode_time(body: memoryview | bytes) -> tuple[int, int, int]:
    if len(body) != _TIME.size:
        raise CorruptFrameError(f"TIME body has {len(body)} bytes, expected {_TIME.size}")
    topic_id, next_offset, ingest_ms = _TIME.unpack_from(body, 0)
    return topic_id, next_offset, ingest_ms


def decode_checkpoint(body: memoryview | bytes) -> tuple[int, int, str]:
    try:
        seq, created_ms, region_len = _CHECKPOINT.unpack_from(body, 0)
        region_b = bytes(body[_CHECKPOINT.size : _CHECKPOINT.size + region_len])
        if len(body) != _CHECKPOINT.size + region_len:
            raise CorruptFrameError("CHECKPOINT body length mismatch")
        return seq, created_ms, region_b.decode()
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptFrameError(f"CHECKPOINT body does not decode: {exc}") from exc


def decode_drop(body: memoryview | bytes) -> tuple[int, int]:
    """``(topic_id, next_offset)`` of a DROP frame's body."""
    if len(body) != _DROP.size:
        raise CorruptFrameError(f"DROP body has {len(body)} bytes, expected {_DROP.size}")
    topic_id, next_offset = _DROP.unpack_from(body, 0)
    return topic_id, next_offset
