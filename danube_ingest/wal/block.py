"""Entry blocks: the entry section of a MESSAGES frame, built by a client, checked whole.

An entry block is ``count`` entries laid out exactly as in a MESSAGES body after its batch
header (see :mod:`danube_ingest.wal.framing`), plus a table of each entry's size (``count``
little-endian u32, sent next to the block, never stored). The batch path appends a checked
block as one MESSAGES frame: the 32-byte batch header in front, the block as it came.

Why the WAL's own layout (Kafka's record batches make the same choice): the daemon then never
builds one object per message on the way in. With the size table, the entries' start positions
are one cumulative sum, and every fixed-size entry header (55 bytes) can be gathered and
checked with numpy in a few vectorised operations; only entries with attributes (variable
length, rare) are walked in Python. A block of alike entries (equal sizes, and equal flags,
lengths, name and key: what ``send_many`` sends) is proven with fewer: whole-block comparisons
against its first entry, whose fields are checked once. Stamping is vectorised too: the daemon
overwrites each entry's ``ingest_ms`` (one time per batch), ``producer_id`` and ``request_id``
(the idempotent producer's id and the batch's sequence, so the producer state is persisted with
the data and rebuilt by recovery from each frame's first entry). Every existing reader
(recovery, cache, dispatch, uploader, ``.bin`` objects, analytics) sees an ordinary MESSAGES
frame.

Guarantees of :func:`check_block`: a block it accepts decodes with
:func:`framing.decode_messages` into exactly ``count`` entries that pass the same limits as a
danube-client publish (``broker.validation.check_message``): payload, attribute count, names
and keys, their total, valid UTF-8 text, ``publish_ms`` in range. A block it refuses raises
:class:`InvalidEntryError` naming the entry index and what is wrong.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

from danube_ingest.errors import InvalidEntryError
from danube_ingest.wal.framing import (
    BATCH_HEADER_SIZE,
    ENTRY_HEADER_SIZE,
    ENTRY_LENGTHS,
    Entry,
    decode_messages,
    entry_size,
    messages_frame,
)
from danube_ingest.wal.stored import StoredEntries

#: The per-entry fixed header as a numpy record (little-endian, packed like the frame).
ENTRY_DTYPE = np.dtype(
    [
        ("ingest_ms", "<i8"),
        ("publish_ms", "<i8"),
        ("producer_id", "<u8"),
        ("request_id", "<u8"),
        ("schema_id", "<u8"),
        ("schema_version", "<u4"),
        ("flags", "u1"),
        ("name_len", "<u2"),
        ("key_len", "<u2"),
        ("attr_count", "<u2"),
        ("payload_len", "<u4"),
    ]
)
# ENTRY_HEADER_SIZE (framing's per-entry struct) is this record's size.
assert ENTRY_DTYPE.itemsize == ENTRY_HEADER_SIZE  # the same layout as framing's entry struct

#: Where fields sit in an entry header.
_COUNTS_AT = ENTRY_DTYPE.fields["name_len"][1]  # type: ignore[index]
_ATTR_COUNT_AT = ENTRY_DTYPE.fields["attr_count"][1]  # type: ignore[index]
_PAYLOAD_LEN_AT = ENTRY_DTYPE.fields["payload_len"][1]  # type: ignore[index]
_FLAGS_AT = ENTRY_DTYPE.fields["flags"][1]  # type: ignore[index]
_PUBLISH_AT = ENTRY_DTYPE.fields["publish_ms"][1]  # type: ignore[index]
#: Up to this many 8-byte words of alike entries are compared column by column (see _alike).
_ALIKE_MAX_WORDS = 8
#: flags, then the lengths (``ENTRY_LENGTHS``): the fixed fields the checks read.
_COUNTS = struct.Struct("<B" + ENTRY_LENGTHS.format.lstrip("<"))
_INGEST_AT = 0
_PRODUCER_AT = 16
_REQUEST_AT = _PRODUCER_AT + 8
_KNOWN_FLAGS = 1 | 2
_HAS_KEY = 2
_ATTR = struct.Struct("<HI")
#: An entry header without its last field (payload_len).
_PREFIX = struct.Struct("<qqQQQIBHHH")
_BATCH = struct.Struct("<IQIqq")
_BYTE8 = np.arange(8, dtype=np.int64)
_HEADER_BYTES = np.arange(ENTRY_HEADER_SIZE, dtype=np.int64)

#: Idempotent producer ids have this bit set; danube-client producer ids (etcd counters) never
#: do, so recovery tells a batch producer's frame from any other by its first entry.
IDEMPOTENT_BIT = 1 << 63


@dataclass(frozen=True, slots=True)
class BlockLimits:
    """What one entry of a block may hold (the danube-client path's limits)."""

    max_payload_bytes: int
    """Largest payload, and largest payload + attributes + routing key + producer name."""
    max_attributes: int
    """Most attributes on one entry."""
    max_name_bytes: int = 255
    """Longest producer name (UTF-8 bytes)."""


class EntryBlock:
    """A checked entry block (see :func:`check_block`); the batch path appends it whole."""

    __slots__ = ("count", "data", "row_size", "starts")

    def __init__(self, data: bytearray, starts: npt.NDArray[np.int64], row_size: int = 0) -> None:
        self.data = data
        """The entries (stamped in place by :meth:`stamp`)."""
        self.starts = starts
        """Byte position of each entry in ``data``."""
        self.count = len(starts)
        self.row_size = row_size
        """The size of every entry when all have the same size (``starts`` is then
        ``arange(count) * row_size``), else 0."""

    def stamp(self, ingest_ms: int, producer_id: int, request_id: int) -> None:
        """Set every entry's ingest time, producer id and request id (vectorised)."""
        if self.row_size:
            # One structured write of the three fields of every entry; the rest stays as it is.
            rows = np.frombuffer(self.data, dtype=_stamped_dtype(self.row_size))
            rows[:] = (ingest_ms, producer_id, request_id)
            return
        arr = np.frombuffer(self.data, dtype=np.uint8)
        values = (
            (_INGEST_AT, ingest_ms.to_bytes(8, "little", signed=True)),
            (_PRODUCER_AT, producer_id.to_bytes(8, "little")),
            (_REQUEST_AT, request_id.to_bytes(8, "little")),
        )
        at8 = self.starts[:, None] + _BYTE8
        for at, value in values:
            arr[at8 + at] = np.frombuffer(value, np.uint8)

    def header(self, topic_id: int, base_offset: int, ingest_ms: int) -> bytes:
        """The MESSAGES batch header that makes this block a frame body."""
        return _BATCH.pack(topic_id, base_offset, self.count, ingest_ms, ingest_ms)

    def entries(self, base_offset: int) -> list[Entry]:
        """The block's entries, decoded, with offsets from ``base_offset``."""
        body = self.header(0, base_offset, 0) + bytes(self.data)
        return decode_messages(body)[1]


class BlockEntries(Sequence[Entry]):
    """The entries of an appended block, decoded only when first read.

    Handed to the cache and the durable callbacks in place of a list: a block nobody reads
    while it is among the cache's newest is cooled to its frame bytes without ever being
    decoded into objects.
    """

    __slots__ = ("_decoded", "base_offset", "block")

    def __init__(self, block: EntryBlock, base_offset: int) -> None:
        self.block = block
        self.base_offset = base_offset
        self._decoded: list[Entry] | None = None

    @property
    def end_offset(self) -> int:
        """The offset after the block's last entry (without decoding)."""
        return self.base_offset + self.block.count

    def _list(self) -> list[Entry]:
        decoded = self._decoded
        if decoded is None:
            decoded = self._decoded = self.block.entries(self.base_offset)
        return decoded

    def __len__(self) -> int:
        return self.block.count

    @overload
    def __getitem__(self, index: int) -> Entry: ...
    @overload
    def __getitem__(self, index: slice) -> list[Entry]: ...
    def __getitem__(self, index: int | slice) -> Entry | list[Entry]:
        return self._list()[index]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._list())


def encode_block(entries: Sequence[Entry]) -> tuple[bytes, bytes]:
    """Encode ``entries`` as an entry block; returns ``(block, sizes)``.

    The stamped fields are encoded as the entries hold them (a producer sends zeros). Raises
    :class:`InvalidEntryError` for an entry the frame cannot hold, ValueError for no entries.
    """
    if not entries:
        raise ValueError("an entry block needs at least one entry")
    try:
        pieces = messages_frame(0, 0, entries)
    except (struct.error, OverflowError, UnicodeEncodeError):
        # (messages_frame trusts its entries to have been checked; name the one that was not.)
        for i, entry in enumerate(entries):
            try:
                entry_size(entry)
            except InvalidEntryError as exc:
                raise InvalidEntryError(f"entry {i}: {exc}") from None
        raise
    body = b"".join(pieces[1:])
    block = body[BATCH_HEADER_SIZE:]
    return block, entry_sizes(block, len(entries)).astype("<u4").tobytes()


def served_block(entries: Sequence[Entry]) -> tuple[bytes, bytes]:
    """The entry block of ``entries`` as they are stored; returns ``(block, sizes)``.

    Entries decoded from a stored frame (a WAL segment, the cache, an object) are served as the
    bytes they were stored as, without encoding each one: a run of entries that lie next to each
    other in one frame body (a frame the consumer gets whole, or a part of one) is one slice of
    it. The result equals ``encode_block(entries)`` (the stored bytes are that encoding,
    stamped fields included). Entries that were never stored and decoded (appended as objects
    and still among the cache's newest) make the whole batch go through ``encode_block``.
    """
    if not entries:
        raise ValueError("an entry block needs at least one entry")
    parts: list[bytes] = []
    sizes = np.empty(len(entries), dtype="<u4")
    src: bytes | None = None
    run_start = run_end = 0
    for i, entry in enumerate(entries):
        source = entry._src
        if source is None:
            return encode_block(entries)
        start = entry._start
        end = entry._end
        sizes[i] = end - start
        if source is src and start == run_end:
            run_end = end
            continue
        if src is not None:
            parts.append(src[run_start:run_end])
        src, run_start, run_end = source, start, end
    assert src is not None
    if not parts:
        return src[run_start:run_end], sizes.tobytes()
    parts.append(src[run_start:run_end])
    return b"".join(parts), sizes.tobytes()


def served_frame(entries: Sequence[Entry]) -> tuple[bytes, bytes]:
    """:func:`served_block` of entries with consecutive offsets, in order (a dispatched frame).

    When the first and the last were decoded from the same stored body, so were all between
    (a MESSAGES frame holds a contiguous range of offsets; another decoding of the same frame
    spans the same bytes): the block is one slice of it and only the sizes are read per entry,
    checked to tile the slice. :class:`StoredEntries` are served from their bodies without
    building an ``Entry``. Otherwise as :func:`served_block`.
    """
    if isinstance(entries, StoredEntries):
        return entries.block()  # no Entry built: slices of the stored bodies
    if not entries:
        raise ValueError("an entry block needs at least one entry")
    first = entries[0]
    last = entries[-1]
    source = first._src
    if source is not None and source is last._src:
        sizes = np.array([e._end - e._start for e in entries], dtype=np.int64)
        if int(sizes.sum()) == last._end - first._start and int(sizes.min()) > 0:
            return source[first._start : last._end], sizes.astype("<u4").tobytes()
    return served_block(entries)


def encode_payloads(
    payloads: Sequence[bytes],
    *,
    publish_ms: int = 0,
    producer_name: str = "",
    routing_key: str | None = None,
    payload_len: int | None = None,
) -> tuple[bytes, bytes]:
    """Encode plain messages (a payload each; one publish time, producer name and routing key
    for all; no attributes, no schema) as an entry block; returns ``(block, sizes)``.

    The result is byte for byte what :func:`encode_block` makes of the same messages as
    :class:`Entry` objects, without building them: the fixed part of every entry header is
    packed once, and when all payloads have the same length (the common case of a bulk send)
    the block is one ``bytes.join`` of the payloads with that header between them.
    ``payload_len``: the length of every payload, when the caller has checked that they all
    have it (the check is then not repeated). Raises :class:`InvalidEntryError` for a name or
    key longer than its header field holds, ValueError for no payloads.
    """
    count = len(payloads)
    if not count:
        raise ValueError("an entry block needs at least one entry")
    name_b = producer_name.encode()
    key_b = b"" if routing_key is None else routing_key.encode()
    if len(name_b) > 0xFFFF or len(key_b) > 0xFFFF:
        raise InvalidEntryError(
            f"producer name ({len(name_b)} bytes) and routing key ({len(key_b)} bytes) must "
            f"each fit in 65,535 bytes"
        )
    flags = 0 if routing_key is None else _HAS_KEY
    fixed = _PREFIX.pack(0, publish_ms, 0, 0, 0, 0, flags, len(name_b), len(key_b), 0)
    text = name_b + key_b
    if payload_len is None:
        lengths = set(map(len, payloads))
        if len(lengths) == 1:
            (payload_len,) = lengths
    if payload_len is not None:
        head = fixed + payload_len.to_bytes(4, "little") + text
        size = len(head) + payload_len
        # head p0 head p1 ...: one C-level join, each payload copied once.
        return head.join([b"", *payloads]), size.to_bytes(4, "little") * count
    block = b"".join(
        [
            piece
            for payload in payloads
            for piece in (fixed, len(payload).to_bytes(4, "little"), text, payload)
        ]
    )
    sizes = np.fromiter(map(len, payloads), dtype=np.int64, count=count)
    sizes += ENTRY_HEADER_SIZE + len(text)
    return block, sizes.astype("<u4").tobytes()


def entry_sizes(block: bytes | bytearray | memoryview, count: int) -> npt.NDArray[np.int64]:
    """Each entry's size, walking the block (for a block that came without its size table)."""
    sizes = np.empty(count, dtype=np.int64)
    pos = 0
    unpack = ENTRY_LENGTHS.unpack_from
    for i in range(count):
        name_len, key_len, attr_count, payload_len = unpack(block, pos + _COUNTS_AT)
        end = pos + ENTRY_HEADER_SIZE + name_len + key_len
        for _ in range(attr_count):
            klen, vlen = _ATTR.unpack_from(block, end)
            end += _ATTR.size + klen + vlen
        end += payload_len
        sizes[i] = end - pos
        pos = end
    return sizes


def _refuse(index: int, what: str) -> InvalidEntryError:
    return InvalidEntryError(f"entry {index} of the batch: {what}")


def check_block(
    block: bytearray, sizes_table: bytes, count: int, limits: BlockLimits
) -> EntryBlock:
    """Check that ``block`` holds exactly ``count`` well-formed entries within ``limits``.

    ``sizes_table`` is each entry's size as ``count`` little-endian u32. Raises
    :class:`InvalidEntryError` (naming the entry) for anything a danube-client publish would be
    refused for, or that would not decode; nothing is modified.
    """
    if count < 1:
        raise InvalidEntryError(f"a batch needs at least one message, count is {count}")
    if len(sizes_table) != 4 * count:
        raise InvalidEntryError(
            f"sizes holds {len(sizes_table)} bytes; expected 4 per message ({4 * count} for "
            f"count {count})"
        )
    table = np.frombuffer(sizes_table, dtype="<u4")
    size = int(table[0])
    if size * count == len(block) and (table == size).all():
        accepted = _check_alike(block, count, size, limits)
        if accepted is not None:
            return accepted
    return _check_entries(block, table, count, limits)


def _check_entries(
    block: bytearray, table: npt.NDArray[np.uint32], count: int, limits: BlockLimits
) -> EntryBlock:
    """:func:`check_block`'s general path: every entry's fields checked (vectorised), the
    first entry at fault named."""
    sizes = table.astype(np.int64)
    if int(sizes.sum()) != len(block):
        raise InvalidEntryError(
            f"entry sizes add up to {int(sizes.sum())} bytes, the block has {len(block)}: "
            f"count, sizes or the block is wrong"
        )
    small = np.flatnonzero(sizes < ENTRY_HEADER_SIZE)
    if len(small):
        i = int(small[0])
        raise _refuse(i, f"size {int(sizes[i])} is below the {ENTRY_HEADER_SIZE}-byte header")
    starts = np.cumsum(sizes) - sizes
    arr = np.frombuffer(block, dtype=np.uint8)
    rows = _rows(arr, starts)
    row_size = 0
    if rows is not None:
        row_size = rows.shape[1]
        raw = np.ascontiguousarray(rows[:, :ENTRY_HEADER_SIZE])
    else:
        raw = arr[starts[:, None] + _HEADER_BYTES]
    heads = raw.view(ENTRY_DTYPE).reshape(count)
    name_len = heads["name_len"].astype(np.int64)
    key_len = heads["key_len"].astype(np.int64)
    attr_count = heads["attr_count"].astype(np.int64)
    payload_len = heads["payload_len"].astype(np.int64)
    flags = heads["flags"].astype(np.int64)
    text = name_len + key_len
    fixed = ENTRY_HEADER_SIZE + text + payload_len
    _first(
        (flags & ~_KNOWN_FLAGS) != 0,
        lambda i: f"unknown flags {int(flags[i]):#x}",
    )
    _first(
        (key_len > 0) & ((flags & _HAS_KEY) == 0),
        lambda i: f"routing key of {int(key_len[i])} bytes without the routing-key flag",
    )
    plain = attr_count == 0
    _first(
        plain & (sizes != fixed),
        lambda i: f"size {int(sizes[i])} does not match its header ({int(fixed[i])} bytes)",
    )
    _first(
        ~plain & (sizes < fixed + _ATTR.size * attr_count),
        lambda i: f"size {int(sizes[i])} is too small for its header and attributes",
    )
    # Structure first (a damaged block says so), then the limits (attributes are walked last,
    # once their count is within limits.max_attributes).
    _first(
        name_len > limits.max_name_bytes,
        lambda i: (
            f"producer name is {int(name_len[i])} bytes long; "
            f"at most {limits.max_name_bytes} bytes (UTF-8)"
        ),
    )
    _first(
        payload_len > limits.max_payload_bytes,
        lambda i: (
            f"payload of {int(payload_len[i])} bytes exceeds limits.max_payload_bytes "
            f"({limits.max_payload_bytes})"
        ),
    )
    _first(
        attr_count > limits.max_attributes,
        lambda i: (
            f"{int(attr_count[i])} attributes exceed limits.max_attributes "
            f"({limits.max_attributes})"
        ),
    )
    _first(
        heads["publish_ms"] < 0,
        lambda i: f"publish_ms {int(heads['publish_ms'][i])} is negative",
    )
    _first(
        plain & (sizes - ENTRY_HEADER_SIZE > limits.max_payload_bytes),
        lambda i: (
            f"message of {int(sizes[i]) - ENTRY_HEADER_SIZE} bytes (payload, routing key, "
            f"producer name) exceeds limits.max_payload_bytes ({limits.max_payload_bytes}), which "
            f"bounds all of them together"
        ),
    )
    _check_text(arr, starts + ENTRY_HEADER_SIZE, name_len, key_len)
    for i in np.flatnonzero(~plain).tolist():
        _check_attributes(block, int(starts[i]), int(sizes[i]), int(fixed[i]), i, limits)
    return EntryBlock(block, starts, row_size)


def _check_alike(block: bytearray, count: int, size: int, limits: BlockLimits) -> EntryBlock | None:
    """The checked block when its ``count`` entries of ``size`` bytes each are plain (no
    attributes) and alike (fixed-size messages from one producer with one name and key: the
    common case), proven with a few whole-block comparisons and the first entry's fields;
    None when that cannot be shown, and :func:`check_block`'s general path decides (and
    names the entry at fault). Accepts only what the general path accepts: every entry's
    flags, name, key, attribute count and payload length equal the first's, which passes every
    check, no ``publish_ms`` is negative, and every entry's name and key bytes equal the
    first's, which are UTF-8."""
    if size < ENTRY_HEADER_SIZE:
        return None
    flags, name_len, key_len, attr_count, payload_len = _COUNTS.unpack_from(block, _FLAGS_AT)
    text = name_len + key_len
    if (
        flags & ~_KNOWN_FLAGS
        or (key_len and not flags & _HAS_KEY)
        or attr_count
        or size != ENTRY_HEADER_SIZE + text + payload_len
        or name_len > limits.max_name_bytes
        or size - ENTRY_HEADER_SIZE > limits.max_payload_bytes
    ):
        return None
    if count > 1 and not _alike(block, count, size, _FLAGS_AT, ENTRY_HEADER_SIZE + text):
        return None
    if (np.ndarray((count,), "<i8", block, _PUBLISH_AT, (size,)) < 0).any():
        return None
    if text:
        name_end = ENTRY_HEADER_SIZE + name_len
        try:
            bytes(block[ENTRY_HEADER_SIZE:name_end]).decode()
            bytes(block[name_end : name_end + key_len]).decode()
        except UnicodeDecodeError:
            return None
    return EntryBlock(block, np.arange(0, count * size, size, dtype=np.int64), size)


def _alike(block: bytearray, count: int, size: int, start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` (at least 8) of each of the block's ``count`` entries of
    ``size`` bytes equal the first entry's. Compared as (overlapping) 8-byte words, one strided
    comparison per word: numpy is slow on many short rows, fast on one long column."""
    if end - start > _ALIKE_MAX_WORDS * 8:
        words = np.ndarray((count, (end - start) // 8), "<u8", block, start, (size, 8))
        if not (words[1:] == words[0]).all():
            return False
        return _alike(block, count, size, end - 8, end)
    for at in (*range(start, end - 8, 8), end - 8):
        column = np.ndarray((count,), "<u8", block, at, (size,))
        if not (column == column[0]).all():
            return False
    return True


def _rows(
    arr: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64]
) -> npt.NDArray[np.uint8] | None:
    """The block as a (count, size) view when every entry has the same size (fixed-size
    messages from one producer: the common case), so headers are strided slices instead of
    gathered bytes; None otherwise."""
    count = len(starts)
    if count == 0 or len(arr) % count:
        return None
    size = len(arr) // count
    if size < ENTRY_HEADER_SIZE or int(starts[-1]) != size * (count - 1):
        return None
    if count > 1 and not (np.diff(starts) == size).all():
        return None
    return arr.reshape(count, size)


@functools.lru_cache(maxsize=256)
def _stamped_dtype(row_size: int) -> np.dtype[np.void]:
    """The fields :meth:`EntryBlock.stamp` sets, as a record of ``row_size`` bytes (an entry)."""
    return np.dtype(
        {
            "names": ["ingest_ms", "producer_id", "request_id"],
            "formats": ["<i8", "<u8", "<u8"],
            "offsets": [_INGEST_AT, _PRODUCER_AT, _REQUEST_AT],
            "itemsize": row_size,
        }
    )


def _first(bad: npt.NDArray[np.bool_], why: Callable[[int], str]) -> None:
    """Raise for the first entry flagged in ``bad``; ``why(i)`` says what is wrong with it."""
    hits = np.flatnonzero(bad)
    if len(hits):
        i = int(hits[0])
        raise _refuse(i, why(i))


def _check_text(
    arr: npt.NDArray[np.uint8],
    text_starts: npt.NDArray[np.int64],
    name_len: npt.NDArray[np.int64],
    key_len: npt.NDArray[np.int64],
) -> None:
    """Producer names and routing keys must be UTF-8: all-ASCII text (the usual case) is
    proven with one gather; entries with other bytes are decoded one by one."""
    lens = name_len + key_len
    total = int(lens.sum())
    if total == 0:
        return
    ends = np.cumsum(lens)
    gather = np.repeat(text_starts - (ends - lens), lens) + np.arange(total, dtype=np.int64)
    if not (arr[gather] >= 0x80).any():
        return
    for i in np.flatnonzero(lens).tolist():
        start = int(text_starts[i])
        name_end = start + int(name_len[i])
        for what, lo, hi in (
            ("producer name", start, name_end),
            ("routing key", name_end, name_end + int(key_len[i])),
        ):
            try:
                arr[lo:hi].tobytes().decode()
            except UnicodeDecodeError:
                raise _refuse(i, f"{what} is not valid UTF-8") from None


def _check_attributes(
    block: bytearray, start: int, size: int, fixed: int, index: int, limits: BlockLimits
) -> None:
    """Walk one entry's attributes: they must fill it exactly, be UTF-8, and keep the message
    within ``max_payload_bytes`` together with its payload, key and name."""
    (attr_count,) = struct.unpack_from("<H", block, start + _ATTR_COUNT_AT)
    pos = start + fixed - _payload_len(block, start)
    end = start + size
    attr_bytes = 0
    for _ in range(attr_count):
        if pos + _ATTR.size > end:
            raise _refuse(index, "attributes run past the entry's size")
        klen, vlen = _ATTR.unpack_from(block, pos)
        pos += _ATTR.size
        if pos + klen + vlen > end:
            raise _refuse(index, "attributes run past the entry's size")
        try:
            bytes(block[pos : pos + klen]).decode()
            bytes(block[pos + klen : pos + klen + vlen]).decode()
        except UnicodeDecodeError:
            raise _refuse(index, "an attribute key or value is not valid UTF-8") from None
        pos += klen + vlen
        attr_bytes += klen + vlen
    if pos + _payload_len(block, start) != end:
        raise _refuse(index, f"size {size} does not match its header and attributes")
    total = fixed - ENTRY_HEADER_SIZE + attr_bytes
    if total > limits.max_payload_bytes:
        raise _refuse(
            index,
            f"message of {total} bytes (payload, attributes, routing key, producer name) exceeds"
            f" limits.max_payload_bytes ({limits.max_payload_bytes}), which bounds all of them "
            f"together",
        )


def _payload_len(block: bytearray, start: int) -> int:
    (length,) = struct.unpack_from("<I", block, start + _PAYLOAD_LEN_AT)
    return int(length)
