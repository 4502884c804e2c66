"""Fuzzing the ``.bin`` object decoders: header, footer and trailer, frames, ranges.

Properties, for arbitrary bytes and for mutations of valid objects (bit flips, truncations,
inserted bytes, and field lies under recomputed CRCs, the case a buggy writer produces): the
footer parses to what was written or raises :class:`ObjectFormatError`; every frame it indexes
decodes to the entries written or raises :class:`ObjectFormatError`; never another exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from danube_ingest.errors import ObjectFormatError
from danube_ingest.objects.binfmt import (
    CODECS,
    FRAME_PREFIX_SIZE,
    TRAILER_SIZE,
    BinWriter,
    Footer,
    decode_frame_bytes,
    decode_range,
    parse_object,
    read_footer,
    read_footer_from,
)
from danube_ingest.wal.framing import Entry

from .support import MAX_INPUT, budget

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

KEY = "fuzz/object.bin"
#: Field lies stay below this many bytes: a lying ``raw_len`` is allowed to cost up to
#: ``MAX_RAW_LEN`` (the format's documented bound), which is too slow to draw often.
MAX_LIE = 1 << 20

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)


@st.composite
def objects(draw: st.DrawFn) -> tuple[bytes, dict[str, list[Entry]]]:
    """A valid object, and the entries of each topic in it."""
    writer = BinWriter(
        draw(st.sampled_from(CODECS)), frame_target_bytes=draw(st.sampled_from([64, 512, 1 << 20]))
    )
    topics: dict[str, list[Entry]] = {}
    for t in range(draw(st.integers(0, 3))):
        name = f"/default/{t}{draw(text)}"
        offset = draw(st.integers(0, 1 << 40))
        written: list[Entry] = []
        for _ in range(draw(st.integers(1, 6))):
            offset += draw(st.sampled_from([1, 1, 1, 5]))
            written.append(
                Entry(
                    draw(st.binary(max_size=48)),
                    producer_name=draw(text),
                    routing_key=draw(st.none() | text),
                    attributes=draw(st.none() | st.dictionaries(text, text, max_size=2)) or None,
                    offset=offset,
                    ingest_ms=1_000 + offset,
                )
            )
        writer.add_entries(name, written)
        topics[name] = written
    return writer.finish(), topics


def fields(entry: Entry) -> tuple[Any, ...]:
    return (
        entry.offset,
        entry.ingest_ms,
        bytes(entry.payload),
        entry.producer_name,
        entry.routing_key,
        entry.attributes,
    )


def decode_all(data: bytes, footer: Footer) -> dict[str, list[Entry]]:
    """Every entry of every topic, frame by frame and as one range per topic; raises
    ObjectFormatError."""
    out: dict[str, list[Entry]] = {}
    view = memoryview(data)
    for name, span in footer.topics.items():
        got: list[Entry] = []
        for ref in span.frames:
            got += decode_frame_bytes(view[ref.position : ref.position + ref.length], ref, KEY)
        ranged = [
            e
            for _ref, entries in decode_range(
                view[span.position : span.position + span.length], span, span.position, KEY
            )
            for e in entries
        ]
        assert [fields(e) for e in ranged] == [fields(e) for e in got]
        out[name] = got
    return out


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> tuple[str, bytes]:
    """``(how, damaged object)``."""
    how = draw(st.sampled_from(["flip", "truncate", "insert", "frame_lie", "footer_lie"]))
    at = draw(st.integers(0, len(data) - 1))
    out = bytearray(data)
    if how == "flip":
        out[at] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        del out[at:]
    elif how == "insert":
        out[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif how == "frame_lie":
        # The first frame's prefix with a lying field and a recomputed prefix CRC.
        if len(out) < 8 + FRAME_PREFIX_SIZE + TRAILER_SIZE:
            return how, bytes(out)
        field = draw(st.sampled_from([(0, "<I"), (4, "<B"), (5, "<B"), (6, "<H"), (8, "<I")]))
        value = draw(st.integers(0, {"<B": 255, "<H": 65_535, "<I": MAX_LIE}[field[1]]))
        struct.pack_into(field[1], out, 8 + field[0], value)
        struct.pack_into("<I", out, 8 + 16, crc32c(bytes(out[8 : 8 + 16])))
    else:
        # Footer bytes changed, then its CRC and the trailer's recomputed: only the parser's own
        # checks stand between the lie and the reader.
        (footer_len,) = struct.unpack_from("<I", out, len(out) - TRAILER_SIZE + 4)
        start = len(out) - TRAILER_SIZE - footer_len
        if footer_len:
            pos = start + draw(st.integers(0, footer_len - 1))
            out[pos] = draw(st.integers(0, 255))
        footer = bytes(out[start : len(out) - TRAILER_SIZE])
        t = len(out) - TRAILER_SIZE
        struct.pack_into("<I", out, t + 8, crc32c(footer))
        struct.pack_into("<I", out, t, crc32c(bytes(out[t + 4 :])))
    return how, bytes(out)


@budget(300)
@given(data=st.binary(max_size=MAX_INPUT), size=st.integers(0, 1 << 40))
def test_arbitrary_bytes_raise_only_object_format_errors(data: bytes, size: int) -> None:
    with pytest.raises(ObjectFormatError):
        parse_object(data, KEY)
    with contextlib.suppress(ObjectFormatError):
        read_footer(data, max(size, len(data)), KEY)


@budget(250)
@given(obj=objects(), data=st.data())
def test_damaged_objects_decode_as_written_or_raise(
    obj: tuple[bytes, dict[str, list[Entry]]], data: st.DataObject
) -> None:
    original, written = obj
    footer = parse_object(original, KEY)
    assert {t: [fields(e) for e in es] for t, es in decode_all(original, footer).items()} == {
        t: [fields(e) for e in es] for t, es in written.items()
    }
    how, bad = data.draw(damaged(original))
    try:
        footer = parse_object(bad, KEY)
        got = decode_all(bad, footer)
    except ObjectFormatError as exc:
        assert exc.key == KEY
        return
    # Whatever decodes is what was written. A footer that lies under a valid CRC can rename a
    # topic (nothing else records the name), but never make up or change an entry.
    if how == "footer_lie":
        every = [fields(e) for entries in written.values() for e in entries]
        assert all(fields(e) in every for entries in got.values() for e in entries)
        return
    for topic, entries in got.items():
        assert topic in written
        assert [fields(e) for e in entries] == [fields(e) for e in written[topic]]


@budget(150)
@given(obj=objects(), data=st.data())
def test_footer_read_by_ranges_agrees_or_raises(
    obj: tuple[bytes, dict[str, list[Entry]]], data: st.DataObject
) -> None:
    """``read_footer_from`` (the cold path's ranged reads) on a damaged object: the footer that
    ``parse_object`` reads, or ObjectFormatError."""
    _how, bad = data.draw(damaged(obj[0]))

    async def get_range(key: str, offset: int, size: int) -> bytes:
        return bad[offset : offset + size]

    async def both() -> tuple[Any, Any]:
        try:
            whole: Any = parse_object(bad, KEY)
        except ObjectFormatError:
            whole = None
        try:
            ranged: Any = await read_footer_from(get_range, len(bad), KEY)
        except ObjectFormatError:
            ranged = None
        return whole, ranged

    whole, ranged = asyncio.run(both())
    if whole is not None:
        assert ranged == whole
