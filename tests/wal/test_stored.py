"""StoredEntries: entries held as the MESSAGES bodies they were read from.

What a frame consumer is served from them (``block()``) is byte for byte what the decoded
entries would be served as (``served_block``), the entries built from them on demand are the
decoded ones, and a body whose entries do not tile it is refused as a full decode refuses it.
"""

from __future__ import annotations

import pytest

from danube_ingest.errors import CorruptFrameError
from danube_ingest.wal.block import served_block, served_frame
from danube_ingest.wal.framing import Entry, decode_messages, messages_frame
from danube_ingest.wal.stored import StoredEntries, entry_bounds


def body_of(entries: list[Entry], base: int) -> bytes:
    return b"".join(messages_frame(7, base, entries)[1:])


def uniform(n: int) -> list[Entry]:
    return [Entry(b"%06d" % i, producer_name="p", routing_key="k") for i in range(n)]


def mixed(n: int) -> list[Entry]:
    return [
        Entry(
            b"x" * (i % 13),
            producer_name=f"p{i % 2}",
            routing_key="k" if i % 3 else None,
            attributes={"a": str(i)} if i % 4 == 0 else None,
            schema_id=i if i % 5 == 0 else None,
            publish_ms=i,
        )
        for i in range(n)
    ]


def fields(entry: Entry) -> tuple[object, ...]:
    return (
        entry.offset,
        entry.payload,
        entry.producer_name,
        entry.routing_key,
        entry.attributes,
        entry.schema_id,
        entry.publish_ms,
    )


@pytest.mark.parametrize("make", [uniform, mixed])
def test_stored_entries_serve_and_build_what_a_decode_gives(make: object) -> None:
    assert callable(make)
    body = body_of(make(40), 100)
    decoded = decode_messages(body)[1]
    stored = StoredEntries.of_body(body)
    assert len(stored) == 40
    assert (stored.first_offset, stored.last_offset) == (100, 139)
    assert [fields(e) for e in stored] == [fields(e) for e in decoded]
    assert fields(stored[17]) == fields(decoded[17])
    assert fields(stored[-1]) == fields(decoded[-1])
    for lo, hi in ((0, 40), (0, 1), (5, 23), (39, 40), (12, 12 + 7)):
        part = stored[lo:hi]
        assert isinstance(part, StoredEntries)
        assert part.block() == served_block(decoded[lo:hi])
        assert served_frame(part) == served_block(decoded[lo:hi])
        assert [e.offset for e in part] == list(range(100 + lo, 100 + hi))


def test_offsets_may_jump_between_bodies_and_pieces_split_there() -> None:
    first = body_of(uniform(10), 0)
    second = body_of(mixed(10), 50)
    joined = StoredEntries.join(
        [StoredEntries.of_body(first, 4), StoredEntries.of_body(second, 0, 3)]
    )
    assert [e.offset for e in joined] == [4, 5, 6, 7, 8, 9, 50, 51, 52]
    assert [joined.offset_at(i) for i in range(len(joined))] == [e.offset for e in joined]
    pieces = joined.pieces()
    assert [(p.first_offset, p.last_offset) for p in pieces] == [(4, 9), (50, 52)]
    decoded = decode_messages(first)[1][4:] + decode_messages(second)[1][:3]
    assert joined.block() == served_block(decoded)
    assert joined[5:8].block() == served_block(decoded[5:8])


@pytest.mark.parametrize("make", [uniform, mixed])
def test_a_body_whose_entries_do_not_tile_it_is_refused(make: object) -> None:
    assert callable(make)
    body = body_of(make(8), 0)
    with pytest.raises(CorruptFrameError, match="trailing bytes"):
        entry_bounds(body + b"\0")
    with pytest.raises(CorruptFrameError):
        entry_bounds(body[:-1])
    # One entry claiming a longer payload than it has (its neighbours then do not tile).
    bounds = entry_bounds(body)
    at = int(bounds[3]) + 51  # payload_len of entry 3
    bad = bytearray(body)
    bad[at] += 1
    with pytest.raises(CorruptFrameError):
        entry_bounds(bytes(bad))
    with pytest.raises(CorruptFrameError):
        decode_messages(bytes(bad))  # (a full decode refuses it too)
