"""Stored entries: messages read from stored MESSAGES bodies, kept as those bytes.

A reader that feeds a frame consumer (a batch consumer of an Exclusive or Failover
subscription, see :mod:`danube_ingest.dispatch.runs`) hands the dispatcher
:class:`StoredEntries` instead of a list of :class:`Entry`: the MESSAGES bodies the entries
were read from (a WAL segment, the cache, a decompressed object frame) with each entry's byte
boundaries. A frame is then served as slices of those bodies and one size table
(:meth:`StoredEntries.block`), and no ``Entry`` is ever built for its messages. An ``Entry`` is
built only when something asks for one (indexing, iterating: a per-message consumer, a nack,
an ack timeout), from the same bytes, exactly as :func:`framing.decode_messages` builds it.

Boundaries are computed without a Python loop per entry when every entry of a body has the same
size and no attributes (a bulk send, the common case): one gather of the fixed headers checks
that each entry's lengths add up to that size. Otherwise the body is walked with ``struct`` (no
objects built). Either way a body whose entries do not tile it exactly is refused with
:class:`CorruptFrameError`, like a full decode. Text fields (names, keys, attributes) are
checked for valid UTF-8 only when an ``Entry`` is built: the bytes served to a frame consumer
are the stored ones, CRC-checked where they were read.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np
import numpy.typing as npt

from danube_ingest.errors import CorruptFrameError
from danube_ingest.wal.framing import (
    BATCH_HEADER_SIZE,
    ENTRY_HEADER_SIZE,
    ENTRY_LENGTHS,
    ENTRY_LENGTHS_AT,
    Entry,
    batch_header,
    decode_messages,
)

_ENTRY_HEADER = ENTRY_HEADER_SIZE
_NAME_LEN_AT = ENTRY_LENGTHS_AT
_KEY_LEN_AT = _NAME_LEN_AT + 2
_ATTR_COUNT_AT = _KEY_LEN_AT + 2
_PAYLOAD_LEN_AT = _ATTR_COUNT_AT + 2
_COUNTS = ENTRY_LENGTHS
_ATTR = struct.Struct("<HI")


def entry_bounds(body: bytes) -> npt.NDArray[np.int64]:
    """Where each entry of the MESSAGES ``body`` starts, and where the last one ends
    (``num_entries + 1`` byte positions in ``body``). Raises :class:`CorruptFrameError` when
    the entries do not tile the body exactly."""
    header = batch_header(body)
    count = header.num_entries
    section = len(body) - BATCH_HEADER_SIZE
    if count == 0:
        if section:
            raise CorruptFrameError(f"MESSAGES body has {section} trailing bytes")
        return np.array([BATCH_HEADER_SIZE], dtype=np.int64)
    bounds = _uniform_bounds(body, count, section)
    if bounds is not None:
        return bounds
    bounds = np.empty(count + 1, dtype=np.int64)
    pos = BATCH_HEADER_SIZE
    unpack = _COUNTS.unpack_from
    attr_unpack = _ATTR.unpack_from
    try:
        for i in range(count):
            bounds[i] = pos
            name_len, key_len, attr_count, payload_len = unpack(body, pos + _NAME_LEN_AT)
            pos += _ENTRY_HEADER + name_len + key_len
            for _ in range(attr_count):
                klen, vlen = attr_unpack(body, pos)
                pos += _ATTR.size + klen + vlen
            pos += payload_len
    except struct.error as exc:
        raise CorruptFrameError(f"MESSAGES body does not decode: {exc}") from exc
    if pos > len(body):
        raise CorruptFrameError("MESSAGES entry runs past the end of its body")
    if pos != len(body):
        raise CorruptFrameError(f"MESSAGES body has {len(body) - pos} trailing bytes")
    bounds[count] = pos
    return bounds


def _uniform_bounds(body: bytes, count: int, section: int) -> npt.NDArray[np.int64] | None:
    """The bounds when all ``count`` entries have the first one's size and no attributes,
    checked in one vectorised pass; None when they do not."""
    if section < _ENTRY_HEADER:
        return None
    name_len, key_len, attr_count, payload_len = _COUNTS.unpack_from(
        body, BATCH_HEADER_SIZE + _NAME_LEN_AT
    )
    size = _ENTRY_HEADER + name_len + key_len + payload_len
    if attr_count or size * count != section:
        return None
    rows = np.frombuffer(body, dtype=np.uint8, offset=BATCH_HEADER_SIZE).reshape(count, size)

    def field(at: int, width: int) -> npt.NDArray[np.int64]:
        column = np.ascontiguousarray(rows[:, at : at + width]).view(f"<u{width}")
        return column.ravel().astype(np.int64)

    sizes = field(_NAME_LEN_AT, 2) + field(_KEY_LEN_AT, 2) + field(_PAYLOAD_LEN_AT, 4)
    if field(_ATTR_COUNT_AT, 2).any() or (sizes != size - _ENTRY_HEADER).any():
        return None
    bounds: npt.NDArray[np.int64] = np.arange(count + 1, dtype=np.int64) * size
    return bounds + BATCH_HEADER_SIZE


class _Span(NamedTuple):
    """Entries ``[lo, hi)`` of one MESSAGES body."""

    body: bytes
    bounds: npt.NDArray[np.int64]
    """Entry ``i`` of the body is ``body[bounds[i]:bounds[i + 1]]``."""
    base: int
    """The offset of the body's entry 0."""
    lo: int
    hi: int


class StoredEntries(Sequence[Entry]):
    """Entries in offset order, held as the stored bodies they were read from (see module
    docs). Offsets are consecutive within a body; between bodies they may jump (offsets that
    were never assigned). Slicing (step 1) gives another ``StoredEntries`` over the same
    bytes; indexing and iterating build ``Entry`` objects (not kept)."""

    __slots__ = ("_ends", "_spans")

    def __init__(self, spans: Sequence[_Span] = ()) -> None:
        self._spans: tuple[_Span, ...] = tuple(s for s in spans if s.hi > s.lo)
        ends: list[int] = []
        total = 0
        for span in self._spans:
            total += span.hi - span.lo
            ends.append(total)
        self._ends = ends

    @classmethod
    def of_body(
        cls,
        body: bytes | memoryview,
        skip: int = 0,
        limit: int | None = None,
        bounds: npt.NDArray[np.int64] | None = None,
    ) -> StoredEntries:
        """Entries ``[skip, skip + limit)`` of the MESSAGES ``body`` (``bounds``: its
        :func:`entry_bounds`, computed when not given)."""
        body = bytes(body)  # (a memoryview: copied; bytes: as is)
        if bounds is None:
            bounds = entry_bounds(body)
        count = len(bounds) - 1
        lo = min(max(skip, 0), count)
        hi = count if limit is None else min(count, lo + max(limit, 0))
        return cls([_Span(body, bounds, batch_header(body).base_offset, lo, hi)])

    @classmethod
    def join(cls, parts: Sequence[StoredEntries]) -> StoredEntries:
        """``parts`` one after the other (ascending offsets)."""
        return cls([span for part in parts for span in part._spans])

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _locate(self, index: int) -> tuple[_Span, int]:
        """The span holding entry ``index`` and the entry's index in its body."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("StoredEntries index out of range")
        i = bisect_right(self._ends, index)
        span = self._spans[i]
        before = self._ends[i - 1] if i else 0
        return span, span.lo + index - before

    def offset_at(self, index: int) -> int:
        """The offset of entry ``index``, without building it."""
        span, at = self._locate(index)
        return span.base + at

    @property
    def first_offset(self) -> int:
        return self.offset_at(0)

    @property
    def last_offset(self) -> int:
        return self.offset_at(-1)

    @property
    def nbytes(self) -> int:
        """Bytes of the bodies held (shared bodies counted once)."""
        seen: dict[int, int] = {}
        for span in self._spans:
            seen[id(span.body)] = len(span.body)
        return sum(seen.values())

    @overload
    def __getitem__(self, index: int) -> Entry: ...
    @overload
    def __getitem__(self, index: slice) -> StoredEntries: ...
    def __getitem__(self, index: int | slice) -> Entry | StoredEntries:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("StoredEntries slices take no step")
            return self._slice(start, stop)
        span, at = self._locate(index)
        return decode_messages(span.body, at, 1, resume=(at, int(span.bounds[at])))[1][0]

    def _slice(self, start: int, stop: int) -> StoredEntries:
        spans: list[_Span] = []
        before = 0
        for span, end in zip(self._spans, self._ends, strict=True):
            lo = max(start - before, 0)
            hi = min(stop - before, span.hi - span.lo)
            if lo < hi:
                spans.append(span._replace(lo=span.lo + lo, hi=span.lo + hi))
            before = end
            if before >= stop:
                break
        return StoredEntries(spans)

    def __iter__(self) -> Iterator[Entry]:
        for span in self._spans:
            at = span.lo
            yield from decode_messages(
                span.body, at, span.hi - at, resume=(at, int(span.bounds[at]))
            )[1]

    def pieces(self) -> list[StoredEntries]:
        """Self split where offsets jump: each piece has consecutive offsets."""
        out: list[list[_Span]] = []
        expect = -1
        for span in self._spans:
            if not out or span.base + span.lo != expect:
                out.append([])
            out[-1].append(span)
            expect = span.base + span.hi
        return [StoredEntries(spans) for spans in out]

    def block(self) -> tuple[bytes, bytes]:
        """The entry block of these entries and its size table (little-endian u32 each): the
        stored bytes, as ``wal.block.served_block`` serves them."""
        if not self._spans:
            raise ValueError("an entry block needs at least one entry")
        parts: list[bytes] = []
        sizes: list[npt.NDArray[np.int64]] = []
        for span in self._spans:
            bounds = span.bounds
            parts.append(span.body[int(bounds[span.lo]) : int(bounds[span.hi])])
            sizes.append(np.diff(bounds[span.lo : span.hi + 1]))
        table = (np.concatenate(sizes) if len(sizes) > 1 else sizes[0]).astype("<u4")
        return (parts[0] if len(parts) == 1 else b"".join(parts)), table.tobytes()


def offset_at(entries: Sequence[Entry], index: int) -> int:
    """The offset of ``entries[index]`` (without building it for :class:`StoredEntries`)."""
    if isinstance(entries, StoredEntries):
        return entries.offset_at(index)
    return entries[index].offset


def first_offset(entries: Sequence[Entry]) -> int:
    """The offset of ``entries[0]`` (without building it for :class:`StoredEntries`)."""
    return entries.first_offset if isinstance(entries, StoredEntries) else entries[0].offset


def last_offset(entries: Sequence[Entry]) -> int:
    """The offset of ``entries[-1]`` (without building it for :class:`StoredEntries`)."""
    return entries.last_offset if isinstance(entries, StoredEntries) else entries[-1].offset


__all__ = ["StoredEntries", "entry_bounds", "first_offset", "last_offset", "offset_at"]
