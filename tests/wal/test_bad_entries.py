"""Entries the WAL frame cannot hold, and failures past staging: one bad append must never
wedge the log, burn offsets or leave a log that recovery, verify or repair treat as damaged."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from danube_ingest.errors import InvalidEntryError, WalFailedError
from danube_ingest.store import TopicStore
from danube_ingest.wal import RegionLog, repair_region, verify_region
from danube_ingest.wal.framing import (
    BATCH_HEADER_SIZE,
    MAX_SHORT_FIELD,
    PREFIX_SIZE,
    Entry,
    checkpoint_frame,
    decode_frame,
    decode_messages,
    entry_size,
    messages_frame,
    topic_frame,
)
from danube_ingest.wal.local import writer as wal_writer
from danube_ingest.wal.segment import segment_path

OpenLog = Callable[..., Awaitable[RegionLog]]

TOPIC = "/ns/t"
#: Seconds an append may take to be answered (durable or failed) before the log counts as wedged.
ANSWER = 5.0

#: One field past what its frame field holds (or not encodable at all), per field.
UNFRAMABLE: dict[str, dict[str, Any]] = {
    "routing key": {"routing_key": "r" * (MAX_SHORT_FIELD + 1)},
    "routing key in 3-byte chars": {"routing_key": "\u20ac" * (MAX_SHORT_FIELD // 3 + 1)},
    "attribute key": {"attributes": {"k" * (MAX_SHORT_FIELD + 1): "v"}},
    "attribute count": {"attributes": {str(i): "" for i in range(MAX_SHORT_FIELD + 1)}},
    "producer name": {"producer_name": "p" * (MAX_SHORT_FIELD + 1)},
    "lone surrogate": {"attributes": {"k": "\ud800"}},
    "publish_ms": {"publish_ms": 1 << 63},
    "producer_id": {"producer_id": -1},
    "request_id": {"request_id": 1 << 64},
    "schema_id": {"schema_id": 1 << 64},
    "schema_version": {"schema_version": 1 << 32},
}


@pytest.mark.parametrize("fields", UNFRAMABLE.values(), ids=list(UNFRAMABLE))
async def test_unframable_entry_is_refused_before_it_gets_an_offset(
    tmp_path: Path, open_log: OpenLog, fields: dict[str, Any]
) -> None:
    region = tmp_path / "r0"
    log = await open_log(region)
    first = Entry(b"a")
    log.stage(TOPIC, first)
    with pytest.raises(InvalidEntryError) as refused:
        log.stage(TOPIC, Entry(b"bad", **fields))
    assert TOPIC in str(refused.value)
    with pytest.raises(InvalidEntryError):  # all or nothing
        log.stage_batch(TOPIC, [Entry(b"b"), Entry(b"bad", **fields)])
    second = Entry(b"c")
    log.stage(TOPIC, second)
    assert await asyncio.wait_for(asyncio.gather(first, second), ANSWER) == [0, 1]
    await log.close()

    report = verify_region(region)
    assert report.ok and not report.gaps and report.torn_tail is None
    assert report.topics == {TOPIC: (0, 2)}
    reopened = await open_log(region)
    assert reopened.topic(TOPIC).hwm == 2  # type: ignore[union-attr]


async def test_fields_at_their_frame_limits_are_stored(tmp_path: Path, open_log: OpenLog) -> None:
    region = tmp_path / "r0"
    log = await open_log(region)
    widest = Entry(
        b"x",
        producer_name="p" * MAX_SHORT_FIELD,
        routing_key="r" * MAX_SHORT_FIELD,
        attributes={"k" * MAX_SHORT_FIELD: "v", **{str(i): "" for i in range(MAX_SHORT_FIELD - 1)}},
        publish_ms=(1 << 63) - 1,
        producer_id=(1 << 64) - 1,
        request_id=(1 << 64) - 1,
        schema_id=(1 << 64) - 1,
        schema_version=(1 << 32) - 1,
    )
    assert entry_size(widest) > 3 * MAX_SHORT_FIELD
    log.stage(TOPIC, widest)
    assert await asyncio.wait_for(widest, ANSWER) == 0
    await log.close()
    assert verify_region(region).topics == {TOPIC: (0, 1)}


async def test_topic_name_too_long_for_its_frame_is_refused(
    tmp_path: Path, open_log: OpenLog
) -> None:
    log = await open_log(tmp_path / "r0")
    name = "/ns/" + "t" * MAX_SHORT_FIELD
    with pytest.raises(InvalidEntryError) as refused:
        log.stage(name, Entry(b"x"))
    assert len(str(refused.value)) < 300  # the name is cut, not echoed whole
    assert log.topic(name) is None
    good = Entry(b"x")
    log.stage(TOPIC, good)
    assert await asyncio.wait_for(good, ANSWER) == 0


async def test_framing_failure_answers_every_waiter_and_marks_the_log_failed(
    tmp_path: Path, open_log: OpenLog
) -> None:
    """An entry changed after it was staged (which callers must not do) cannot be framed: its
    waiters and everyone staged with it get an error at once, and the log takes nothing more."""
    region = tmp_path / "r0"
    log = await open_log(region)
    before = Entry(b"before")
    log.stage(TOPIC, before)
    assert await before == 0
    spoiled = Entry(b"x")
    waiters = [
        log.stage(TOPIC, Entry(b"a")),
        log.stage(TOPIC, spoiled),
        log.stage("/ns/u", Entry(b"b")),
    ]
    spoiled.routing_key = "r" * (MAX_SHORT_FIELD + 1)
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), ANSWER)
    assert all(isinstance(r, WalFailedError) for r in results), results
    with pytest.raises(WalFailedError):
        log.stage(TOPIC, Entry(b"after"))
    await asyncio.wait_for(log.close(), ANSWER)

    report = verify_region(region)
    assert report.ok and not report.gaps
    assert report.topics == {TOPIC: (0, 1)}


async def test_writer_thread_death_answers_every_waiter_and_close_returns(
    tmp_path: Path, open_log: OpenLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the writer thread dies of something other than a failed write (here
    while it looks at the queue, where no write error handler runs)."""
    region = tmp_path / "r0"
    log = await open_log(region, linger_us=0)
    before = Entry(b"before")
    log.stage(TOPIC, before)
    assert await before == 0

    def die(chunk: object) -> int:
        raise RuntimeError("injected writer death")

    monkeypatch.setattr(wal_writer, "chunk_bytes", die)
    waiters = [log.stage(TOPIC, Entry(b"a")), log.stage("/ns/u", Entry(b"b"))]
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), ANSWER)
    assert all(isinstance(r, WalFailedError) for r in results), results
    assert "injected writer death" in str(results[0])
    with pytest.raises(WalFailedError):
        log.stage(TOPIC, Entry(b"after"))
    await asyncio.wait_for(log.close(), ANSWER)
    monkeypatch.undo()
    assert verify_region(region).topics == {TOPIC: (0, 1)}


def test_offset_gap_is_reported_kept_by_repair_and_skipped_by_readers(tmp_path: Path) -> None:
    """A region with an offset gap (what a burned offset left before entries were checked
    when staged): it opens, verify reports the gap without calling it damage, repair moves
    nothing, readers skip the missing offsets and appends continue after the last one."""
    region = tmp_path / "wal" / "r0"
    region.mkdir(parents=True)
    path = segment_path(region, 0)
    frames = [
        checkpoint_frame(0, 0, "r0"),
        topic_frame(1, TOPIC),
        *messages_frame(1, 0, [Entry(b"0"), Entry(b"1")]),
        *messages_frame(1, 3, [Entry(b"3")]),
    ]
    path.write_bytes(b"".join(frames))
    before = path.read_bytes()

    report = verify_region(region)
    assert report.ok
    assert [(g.topic, g.expected, g.found) for g in report.gaps] == [(TOPIC, 2, 3)]
    assert report.topics == {TOPIC: (0, 4)}
    assert repair_region(region) == []
    assert path.read_bytes() == before and not (region / "quarantine").exists()

    async def read_and_append() -> tuple[list[tuple[int, bytes]], int]:
        store = await TopicStore.open(region.parent, cache_topic_max_bytes=1)
        try:
            assert [g.found for g in store.regions[0].recovered.gaps] == [3]
            reader = store.create_reader(TOPIC, 0)
            got: list[tuple[int, bytes]] = []
            while len(got) < 3:
                batch = await asyncio.wait_for(reader.next_batch(), ANSWER)
                got.extend((e.offset, bytes(e.payload)) for e in batch)
            reader.close()
            return got, await store.append(TOPIC, Entry(b"4"))
        finally:
            await store.close()

    got, appended = asyncio.run(read_and_append())
    assert got == [(0, b"0"), (1, b"1"), (3, b"3")]
    assert appended == 4


SIZES = st.sampled_from([0, 1, MAX_SHORT_FIELD - 1, MAX_SHORT_FIELD, MAX_SHORT_FIELD + 1])
CHARS = st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"])


@st.composite
def near_limit_entries(draw: st.DrawFn) -> Entry:
    def text() -> str:
        char, size = draw(CHARS), draw(SIZES)
        body = char * (size // len(char.encode()))
        return body + "a" * (size - len(body.encode()))

    return Entry(
        b"p",
        producer_name=text(),
        routing_key=text() if draw(st.booleans()) else None,
        attributes={f"{i}{text()}": text() for i in range(draw(st.integers(0, 2)))},
        publish_ms=draw(st.sampled_from([-(1 << 63) - 1, -(1 << 63), 0, (1 << 63) - 1, 1 << 63])),
        producer_id=draw(st.sampled_from([-1, 0, (1 << 64) - 1, 1 << 64])),
        schema_id=draw(st.sampled_from([None, 0, (1 << 64) - 1, 1 << 64])),
        schema_version=draw(st.sampled_from([0, (1 << 32) - 1, 1 << 32])),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=near_limit_entries())
def test_entry_size_accepts_exactly_what_frames(entry: Entry) -> None:
    """``entry_size`` refuses an entry exactly when framing it would fail; what it accepts
    frames to its size and decodes back."""
    try:
        size = entry_size(entry)
    except InvalidEntryError:
        with pytest.raises((struct.error, UnicodeEncodeError)):
            messages_frame(1, 0, [entry])
        return
    pieces = messages_frame(1, 0, [entry])
    assert sum(len(p) for p in pieces) == PREFIX_SIZE + BATCH_HEADER_SIZE + size
    (decoded,) = decode_messages(decode_frame(b"".join(pieces)).body)[1]
    assert (decoded.producer_name, decoded.routing_key, decoded.attributes) == (
        entry.producer_name,
        entry.routing_key,
        entry.attributes or None,
    )
