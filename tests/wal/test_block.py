"""Entry blocks (wal/block.py): checked whole, appended as one frame, read by every reader,
and idempotent producers' sequences rebuilt by recovery."""

from __future__ import annotations

import asyncio
import os
import struct
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from danube_ingest.errors import DuplicateSequenceError, InvalidEntryError, SequenceGapError
from danube_ingest.store import TopicStore
from danube_ingest.wal.block import (
    IDEMPOTENT_BIT,
    BlockLimits,
    EntryBlock,
    _alike,
    _check_entries,
    check_block,
    encode_block,
    encode_payloads,
    entry_sizes,
    served_block,
    served_frame,
)
from danube_ingest.wal.framing import Entry, decode_messages, messages_frame
from danube_ingest.wal.meta import PRODUCER_WINDOW

OpenStore = Callable[..., Awaitable[TopicStore]]
LIMITS = BlockLimits(max_payload_bytes=1000, max_attributes=4)
TOPIC = "/default/blocks"
PID = IDEMPOTENT_BIT | 7


def entries(n: int, start: int = 0) -> list[Entry]:
    out = []
    for i in range(start, start + n):
        if i % 3 == 0:
            out.append(Entry(f"m{i}".encode(), producer_name="p", publish_ms=i))
        elif i % 3 == 1:
            out.append(Entry(f"m{i}".encode(), routing_key=f"k{i}", producer_name="p"))
        else:
            out.append(Entry(f"m{i}".encode(), attributes={"a": "é", "b": str(i)}, schema_id=3))
    return out


def checked(batch: list[Entry]) -> tuple[bytearray, bytes]:
    block, sizes = encode_block(batch)
    return bytearray(block), sizes


def test_a_valid_block_is_accepted_and_its_sizes_are_the_walked_ones() -> None:
    block, sizes = checked(entries(10))
    got = check_block(block, sizes, 10, LIMITS)
    assert got.count == 10
    assert entry_sizes(block, 10).astype("<u4").tobytes() == sizes
    decoded = got.entries(100)
    assert [e.payload for e in decoded] == [f"m{i}".encode() for i in range(10)]
    assert decoded[0].offset == 100 and decoded[2].attributes == {"a": "é", "b": "2"}


def with_entry(entry: Entry) -> tuple[bytearray, bytes]:
    return checked([Entry(b"ok"), entry, Entry(b"ok")])


@pytest.mark.parametrize(
    ("make", "count", "needle"),
    [
        (lambda: with_entry(Entry(b"x" * 1001)), 3, "entry 1 of the batch: payload of 1001"),
        (
            lambda: with_entry(Entry(b"x", attributes={str(i): "" for i in range(5)})),
            3,
            "entry 1 of the batch: 5 attributes exceed limits.max_attributes",
        ),
        (lambda: with_entry(Entry(b"x", producer_name="n" * 256)), 3, "producer name is 256"),
        (lambda: with_entry(Entry(b"x" * 990, routing_key="k" * 20)), 3, "which bounds all"),
        (lambda: with_entry(Entry(b"x" * 990, attributes={"k": "v" * 20})), 3, "bounds all"),
        (lambda: with_entry(Entry(b"x")), 2, "sizes holds 12 bytes"),
    ],
)
def test_a_block_breaking_a_limit_is_refused_naming_the_entry(
    make: Callable[[], tuple[bytearray, bytes]], count: int, needle: str
) -> None:
    block, sizes = make()
    before = bytes(block)
    with pytest.raises(InvalidEntryError, match=needle):
        check_block(block, sizes, count, LIMITS)
    assert bytes(block) == before


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        (Entry(b"x", routing_key="r" * 70_000), "entry 1: routing key of 70000"),
        (Entry(b"x", attributes={"k" * 65_536: "v"}), "entry 1: attribute key of 65536"),
        (Entry(b"x", routing_key="\ud800"), "entry 1: routing key is not valid unicode"),
    ],
    ids=["routing key", "attribute key", "surrogate"],
)
def test_encode_block_refuses_an_entry_no_frame_holds_naming_it(entry: Entry, needle: str) -> None:
    """(It used to raise struct.error from deep in the framing, which the batch Producer did
    not expect: the batch's futures never resolved.)"""
    with pytest.raises(InvalidEntryError, match=needle):
        encode_block([Entry(b"ok"), entry])


def test_corrupt_blocks_are_refused() -> None:
    block, sizes = checked(entries(3))
    table = list(struct.unpack("<3I", sizes))
    # A size table that does not tile the entries.
    bad = struct.pack("<3I", table[0] + 1, table[1] - 1, table[2])
    with pytest.raises(InvalidEntryError, match="does not match its header"):
        check_block(block, bad, 3, LIMITS)
    # A block cut short.
    with pytest.raises(InvalidEntryError, match="add up to"):
        check_block(block[:-1], sizes, 3, LIMITS)
    # A payload length that runs past its entry.
    broken = bytearray(block)
    struct.pack_into("<I", broken, 51, 500)
    with pytest.raises(InvalidEntryError, match="entry 0 of the batch: size"):
        check_block(broken, sizes, 3, LIMITS)
    # Unknown flags; a routing key without its flag; text that is not UTF-8.
    for at, value, needle in ((44, 0x80, "unknown flags"), (44, 0, "routing-key flag")):
        one, one_sizes = checked([Entry(b"x", routing_key="k")])
        one[at] = value
        with pytest.raises(InvalidEntryError, match=needle):
            check_block(one, one_sizes, 1, LIMITS)
    one, one_sizes = checked([Entry(b"x", producer_name="ab")])
    one[55] = 0xFF
    with pytest.raises(InvalidEntryError, match="producer name is not valid UTF-8"):
        check_block(one, one_sizes, 1, LIMITS)
    one, one_sizes = checked([Entry(b"x", attributes={"k": "v"})])
    one[55 + 6] = 0xFF
    with pytest.raises(InvalidEntryError, match="attribute key or value is not valid UTF-8"):
        check_block(one, one_sizes, 1, LIMITS)


async def append(store: TopicStore, batch: list[Entry], pid: int, seq: int) -> tuple[range, bool]:
    block, sizes = checked(batch)
    staged = store.append_block(TOPIC, check_block(block, sizes, len(batch), LIMITS), pid, seq)
    await staged.future
    return staged.offsets, staged.duplicate


async def test_blocks_interleave_with_entries_and_survive_a_restart(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = await open_store(tmp_path)
    await store.append(TOPIC, Entry(b"before"))
    first, dup = await append(store, entries(5), PID, 0)
    assert (first, dup) == (range(1, 6), False)
    await store.append(TOPIC, Entry(b"after"))
    reader = store.create_reader(TOPIC, 0)
    got = await reader.next_batch()
    while len(got) < 7:
        got += await reader.next_batch()
    reader.close()
    assert [e.offset for e in got] == list(range(7))
    assert got[1].producer_id == PID and got[1].request_id == 0
    assert got[1].ingest_ms == got[5].ingest_ms > 0
    assert got[6].payload == b"after"
    await store.close()

    store = await open_store(tmp_path)
    reader = store.create_reader(TOPIC, 0)
    again = await reader.next_batch()
    reader.close()
    assert again == got
    # The producer's record came back with the data: a retry is answered with the old range.
    assert await append(store, entries(5), PID, 0) == (range(1, 6), True)
    assert await append(store, entries(2), PID, 1) == (range(7, 9), False)


async def test_sequences_duplicates_gaps_and_forgotten_ones(
    tmp_path: Path, open_store: OpenStore
) -> None:
    store = await open_store(tmp_path, segment_bytes=4096)
    for seq in range(PRODUCER_WINDOW + 2):
        assert (await append(store, entries(2), PID, seq))[1] is False
    assert await append(store, entries(2), PID, PRODUCER_WINDOW + 1) == (
        range(2 * (PRODUCER_WINDOW + 1), 2 * (PRODUCER_WINDOW + 2)),
        True,
    )
    with pytest.raises(SequenceGapError, match="resend sequence 34") as gap:
        await append(store, entries(2), PID, PRODUCER_WINDOW + 3)
    assert gap.value.expected == PRODUCER_WINDOW + 2
    with pytest.raises(DuplicateSequenceError, match="was stored before"):
        await append(store, entries(2), PID, 0)
    end = store.next_offset(TOPIC)
    # Another producer, and a non-idempotent one (id 0), are independent.
    assert (await append(store, entries(1), PID + 1, 9))[0] == range(end, end + 1)
    assert (await append(store, entries(1), 0, 0))[0] == range(end + 1, end + 2)
    assert (await append(store, entries(1), 0, 0))[0] == range(end + 2, end + 3)
    await store.close()
    # Recovery (from snapshots taken at the seals, then the segments after them).
    store = await open_store(tmp_path, segment_bytes=4096)
    with pytest.raises(SequenceGapError):
        await append(store, entries(2), PID, PRODUCER_WINDOW + 3)
    assert (await append(store, entries(1), PID + 1, 9))[1] is True
    assert (await append(store, entries(2), PID, PRODUCER_WINDOW + 2))[1] is False


async def test_a_refused_sequence_uses_no_offset(tmp_path: Path, open_store: OpenStore) -> None:
    store = await open_store(tmp_path)
    await append(store, entries(1), PID, 0)
    before = store.next_offset(TOPIC)
    with pytest.raises(SequenceGapError):
        await append(store, entries(1), PID, 5)
    assert store.next_offset(TOPIC) == before


async def test_a_block_is_acknowledged_only_after_its_fdatasync(
    tmp_path: Path, open_store: OpenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_store(tmp_path)
    await store.append(TOPIC, Entry(b"warm-up"))  # (the segment exists and is synced)
    gate = threading.Event()
    real = os.fdatasync

    def held(fd: int) -> None:
        if threading.current_thread().name.startswith("wal-writer"):
            assert gate.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    block, sizes = checked(entries(3))
    staged = store.append_block(TOPIC, check_block(block, sizes, 3, LIMITS), PID, 0)
    await asyncio.sleep(0.3)
    assert not staged.future.done()  # written, maybe; not synced: not acknowledged
    gate.set()
    await asyncio.wait_for(staged.future, 10)
    assert staged.offsets == range(1, 4)


def test_equal_size_entries_take_the_strided_path_with_the_same_checks_and_stamps() -> None:
    same = [Entry(b"%03d" % i, producer_name="p", publish_ms=i) for i in range(50)]
    block, sizes = checked(same)
    got = check_block(block, sizes, 50, LIMITS)
    got.stamp(1234, PID, 9)
    decoded = got.entries(10)
    assert [(e.payload, e.ingest_ms, e.producer_id, e.request_id) for e in decoded] == [
        (b"%03d" % i, 1234, PID, 9) for i in range(50)
    ]
    assert [e.publish_ms for e in decoded] == list(range(50))
    broken = bytearray(block)
    size = len(block) // 50
    struct.pack_into("<I", broken, 7 * size + 51, 4)  # entry 7's payload length, one too many
    with pytest.raises(InvalidEntryError, match="entry 7 of the batch: size"):
        check_block(broken, sizes, 50, LIMITS)
    broken = bytearray(block)
    broken[3 * size + 44] = 0x10
    with pytest.raises(InvalidEntryError, match="entry 3 of the batch: unknown flags"):
        check_block(broken, sizes, 50, LIMITS)


def test_decoded_entries_are_served_as_their_stored_bytes() -> None:
    """What Consume sends: stored entries as slices of the frame they were decoded from, equal
    to encoding them again, in any order and across frames; never-stored entries are encoded."""
    stored = entries(9)
    for i, entry in enumerate(stored):
        entry.offset, entry.ingest_ms, entry.producer_id, entry.request_id = i, 77, PID, 4
    body = b"".join(messages_frame(0, 0, stored[:6])[1:])
    other = b"".join(messages_frame(0, 6, stored[6:])[1:])
    decoded = decode_messages(body)[1] + decode_messages(other)[1]
    whole, sizes = served_block(decoded[:6])
    # A whole frame's entries are its entry section, one slice of the stored body.
    assert whole == body[len(body) - len(whole) :] and whole == encode_block(stored[:6])[0]
    assert sizes == encode_block(stored[:6])[1]
    assert len(whole) == sum(entry_sizes(whole, 6))
    cases = [
        decoded[2:4],  # part of one frame
        decoded,  # two frames
        decoded[::2] + decoded[1::2],  # Shared / redelivery order: many runs
        decoded[7:] + decoded[:3],  # a later frame first
        [decoded[0], stored[4], decoded[5]],  # a never-decoded entry: encoded instead
    ]
    for case in cases:
        assert served_block(case) == encode_block(case)
    with pytest.raises(ValueError):
        served_block([])


def test_a_frame_of_consecutive_offsets_is_served_as_its_stored_bytes() -> None:
    """``served_frame`` (a dispatched frame: consecutive offsets) equals encoding its entries
    again: one slice when first and last come from one body, else as ``served_block``."""
    stored = entries(9)
    for i, entry in enumerate(stored):
        entry.offset, entry.ingest_ms, entry.producer_id, entry.request_id = i, 77, PID, 4
    body = b"".join(messages_frame(0, 0, stored[:6])[1:])
    other = b"".join(messages_frame(0, 6, stored[6:])[1:])
    decoded = decode_messages(body)[1] + decode_messages(other)[1]
    again = decode_messages(body)[1]  # the same frame decoded twice (two reads)
    cases = [
        decoded[:6],  # a whole frame
        decoded[1:5],  # part of one
        decoded[4:8],  # across two frames
        decoded[:2] + again[2:4] + decoded[4:6],  # one frame, from two decodings of it
        [decoded[3], stored[4], decoded[5]],  # a never-decoded entry: encoded instead
    ]
    for case in cases:
        assert served_frame(case) == encode_block(case)
    with pytest.raises(ValueError):
        served_frame([])


@settings(max_examples=60, deadline=None)
@given(
    payloads=st.one_of(
        st.integers(0, 300).flatmap(
            lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=40)
        ),
        st.lists(st.binary(max_size=300), min_size=1, max_size=40),
    ),
    name=st.text(max_size=20),
    key=st.none() | st.text(max_size=20),
    publish_ms=st.integers(0, 2**62),
)
def test_encode_payloads_is_encode_block_of_the_same_messages(
    payloads: list[bytes], name: str, key: str | None, publish_ms: int
) -> None:
    """The bulk encoder (numpy rows for equal sizes, one join otherwise) builds exactly the
    block and size table of Entry objects, and the daemon's check accepts it."""
    got = encode_payloads(payloads, publish_ms=publish_ms, producer_name=name, routing_key=key)
    entries = [
        Entry(p, publish_ms=publish_ms, producer_name=name, routing_key=key) for p in payloads
    ]
    assert got == encode_block(entries)
    block = check_block(bytearray(got[0]), got[1], len(payloads), BlockLimits(10_000, 16))
    assert [e.payload for e in block.entries(0)] == payloads


def test_encode_payloads_refuses_nothing_and_overlong_names() -> None:
    with pytest.raises(ValueError, match="at least one entry"):
        encode_payloads([])
    with pytest.raises(InvalidEntryError, match="65,535 bytes"):
        encode_payloads([b"x"], routing_key="k" * 70_000)


@pytest.mark.parametrize(
    ("at", "value", "needle"),
    [
        (44, 0x10, "unknown flags"),
        (44, 0, "routing-key flag"),
        (15, 0x80, "publish_ms -"),
        (55, 0xFF, "producer name is not valid UTF-8"),
        (51, 0xFF, "does not match its header"),
        (49, 1, "too small for its header and attributes"),
    ],
)
def test_equal_entries_broken_alike_are_refused_as_the_first_alone(
    at: int, value: int, needle: str
) -> None:
    """A block of equal entries (what ``send_many`` sends) broken the same way in every entry
    is refused with what its first entry alone gets (naming entry 0); with one entry broken,
    the refusal names that entry."""
    payloads = [b"x" * 20] * 30
    block, sizes = encode_payloads(payloads, publish_ms=5, producer_name="pé", routing_key="k")
    assert check_block(bytearray(block), sizes, 30, LIMITS).count == 30
    size = len(block) // 30
    broken = bytearray(block)
    for i in range(30):
        broken[i * size + at] = value
    with pytest.raises(InvalidEntryError, match=needle) as alone:
        check_block(bytearray(broken[:size]), sizes[:4], 1, LIMITS)
    with pytest.raises(InvalidEntryError, match=needle) as whole:
        check_block(broken, sizes, 30, LIMITS)
    assert str(whole.value) == str(alone.value) and "entry 0 of the batch" in str(whole.value)
    one = bytearray(block)
    one[17 * size + at] = value
    with pytest.raises(InvalidEntryError, match=needle) as single:
        check_block(one, sizes, 30, LIMITS)
    assert "entry 17 of the batch" in str(single.value)


def verdict(check: Callable[[], EntryBlock]) -> tuple[object, ...]:
    """What a check made of a block: the refusal's message, or the accepted entries."""
    try:
        got = check()
    except InvalidEntryError as exc:
        return ("refused", str(exc))
    return ("accepted", bytes(got.data), got.starts.tolist(), got.count)


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(1, 12),
    payload_len=st.integers(0, 40),
    name=st.one_of(st.text(max_size=4), st.text(min_size=60, max_size=80)),
    key=st.one_of(st.none(), st.text(max_size=4)),
    publish_ms=st.integers(0, 2**63 - 1),
    where=st.sampled_from(["none", "all", "one"]),
    at=st.integers(0, 400),
    value=st.integers(0, 255),
    data=st.data(),
)
def test_blocks_of_alike_entries_get_the_general_checks_verdict(
    count: int,
    payload_len: int,
    name: str,
    key: str | None,
    publish_ms: int,
    where: str,
    at: int,
    value: int,
    data: st.DataObject,
) -> None:
    """The shortcut for blocks of equal-size entries (what ``send_many`` sends: a few
    whole-block comparisons and the first entry's fields) accepts exactly what the
    entry-by-entry check accepts, and refuses the rest with the same message (naming the same
    entry), whichever byte is changed in every entry or in one."""
    payloads = [bytes([65 + i % 26]) * payload_len for i in range(count)]
    block, sizes = encode_payloads(
        payloads, publish_ms=publish_ms, producer_name=name, routing_key=key
    )
    size = len(block) // count
    broken = bytearray(block)
    at %= size
    if where == "all":
        for i in range(count):
            broken[i * size + at] = value
    elif where == "one":
        broken[data.draw(st.integers(0, count - 1)) * size + at] = value
    table = np.frombuffer(sizes, dtype="<u4")
    whole = verdict(lambda: check_block(bytearray(broken), sizes, count, LIMITS))
    general = verdict(lambda: _check_entries(bytearray(broken), table, count, LIMITS))
    assert whole == general


def test_alike_entries_are_checked_without_the_entry_by_entry_pass() -> None:
    """A block of alike entries is accepted by the shortcut (its entries' common size known,
    so stamping writes strided records); a name and key that are UTF-8 together but not each
    alone are refused as the general check refuses them."""
    block, sizes = encode_payloads([b"x" * 30] * 40, producer_name="é", routing_key="k")
    got = check_block(bytearray(block), sizes, 40, LIMITS)
    size = len(block) // 40
    assert got.row_size == size and got.starts.tolist() == list(range(0, len(block), size))
    got.stamp(77, PID, 5)
    assert [(e.ingest_ms, e.producer_id, e.request_id) for e in got.entries(0)] == [
        (77, PID, 5)
    ] * 40
    split = bytearray(block)
    for i in range(40):  # name b"\xc3", key b"\xa9k": the text decodes whole, not apart
        struct.pack_into("<HH", split, i * size + 45, 1, 2)
    with pytest.raises(InvalidEntryError, match="entry 0 of the batch: producer name is not"):
        check_block(split, sizes, 40, LIMITS)


@pytest.mark.parametrize("width", [8, 11, 16, 17, 63, 64, 65, 72, 73, 200])
def test_alike_compares_every_byte_of_the_span(width: int) -> None:
    """(The shortcut's comparison of entries' fields and text, in overlapping 8-byte words:
    a difference in any byte of the span, in any entry, is seen; bytes outside it are not.)"""
    count, size, start = 5, width + 20, 7
    block = bytearray(bytes(range(size)) * count)
    assert _alike(block, count, size, start, start + width)
    for at in range(size):
        for entry in (1, count - 1):
            changed = bytearray(block)
            changed[entry * size + at] ^= 0x40
            inside = start <= at < start + width
            assert _alike(changed, count, size, start, start + width) is not inside
