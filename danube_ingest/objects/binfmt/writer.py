"""Building ``.bin`` objects: :class:`BinWriter`.

The byte layout is described in :mod:`danube_ingest.objects.binfmt.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence

import lz4.block
import zstandard
from crc32c import crc32c

from danube_ingest.errors import ObjectFormatError
from danube_ingest.objects.binfmt.layout import (
    _FRAME_HEAD,
    _FRAME_PREFIX,
    _NONE,
    _U32,
    _ZSTD,
    CODECS,
    FRAME_PREFIX_SIZE,
    HEADER,
    HEADER_SIZE,
    MAX_RAW_LEN,
    Footer,
    FrameRef,
    TopicSpan,
    _footer_and_trailer,
    _span,
)
from danube_ingest.wal.framing import (
    BatchHeader,
    Entry,
    Kind,
    batch_header,
    decode_time,
    iter_frames,
    messages_frame,
)

#: Largest ``frame_target_bytes``: a reader decodes a whole frame to read one entry of it, and
#: frames beyond a few MiB no longer compress better.
MAX_FRAME_TARGET = 64 << 20

#: Bytes of a MESSAGES entry besides its strings and payload (``framing._ENTRY``), used only to
#: size batches in :meth:`BinWriter.add_entries`.
_ENTRY_OVERHEAD = 48


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

    def add_frame(self, topic: str, frame: bytes | memoryview, ref: FrameRef) -> None:
        """Add one object frame of another object as it is stored (no re-compression).

        ``frame`` is the frame's prefix and stored bytes, ``ref`` its footer record; its
        offsets must be above those already added for ``topic``. The frame being filled is
        finished first, so frame boundaries stay where they were. Raises
        :class:`ObjectFormatError` if a CRC does not match (nothing is added then); the WAL
        frames inside are not decoded: ``ref`` comes from a CRC-checked footer.
        """
        state = self._topic(topic)
        if ref.first_offset <= state.last_offset:
            raise ValueError(
                f"topic {topic}: frame from offset {ref.first_offset} does not follow offset "
                f"{state.last_offset}"
            )
        view = frame if isinstance(frame, memoryview) else memoryview(frame)
        if len(view) != ref.length:
            raise ObjectFormatError(
                "?", ref.position, f"frame of {len(view)} bytes, not {ref.length}"
            )
        prefix, stored = view[:FRAME_PREFIX_SIZE], view[FRAME_PREFIX_SIZE:]
        stored_len, _, _, _, _, stored_crc, prefix_crc = _FRAME_PREFIX.unpack(prefix)
        if (
            crc32c(prefix[: FRAME_PREFIX_SIZE - 4]) != prefix_crc
            or stored_len != len(stored)
            or crc32c(stored) != stored_crc
        ):
            raise ObjectFormatError("?", ref.position, "frame CRC mismatch")
        self._topics.setdefault(topic, state)
        self._flush(state)
        meta = (
            ref.first_offset,
            ref.last_offset,
            ref.entries,
            ref.first_ingest_ms,
            ref.last_ingest_ms,
        )
        state.frames.append((meta, bytes(prefix), bytes(stored)))
        state.last_offset = ref.last_offset

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
        spans: dict[str, TopicSpan] = {}
        position = HEADER_SIZE
        for name, state in self._topics.items():
            self._flush(state)
            refs: list[FrameRef] = []
            for meta, prefix, stored in state.frames:
                length = len(prefix) + len(stored)
                refs.append(FrameRef(name, *meta, position, length))
                pieces += (prefix, stored)
                position += length
            spans[name] = _span(name, refs)
        self._topics = {}
        footer_position = position
        pieces.append(_footer_and_trailer(spans))
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
