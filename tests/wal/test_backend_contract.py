"""The WAL backend contract (``danube_ingest/wal/backend.py``), run against every backend.

Each test drives a real ``RegionLog`` on a real backend and checks what the contract promises
whatever stores the bytes: offsets, order, group commit, refusals, deletion, restarts. A new
backend joins by adding a :class:`Case` to ``CASES`` (how to open a log on it, whether its data
survives a restart, what counts as one durable write); backend-specific behaviour (linger,
fdatasync failures, reserved blocks) stays in the backend's own tests.

What the memory backend promises across a restart: nothing survives it. A RegionLog opened
again on a new ``MemoryBackend`` (as a restarted daemon with ``storage.wal.mode: memory``
does) recovers an empty region, and offsets start again at 0.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.errors import InvalidEntryError, PayloadTooLargeError
from danube_ingest.wal import Entry, Kind, RegionLog, Sealed
from danube_ingest.wal.backend import Chunk
from danube_ingest.wal.framing import MAX_SHORT_FIELD, decode_messages, decode_topic, iter_frames
from danube_ingest.wal.kafka import KafkaBackend, KafkaWal
from danube_ingest.wal.log import Group

TOPIC = "/ns/t"
#: Seconds an append may take to be answered before the test counts the log as wedged.
ANSWER = 10.0


@dataclass
class Case:
    """One backend under the contract."""

    name: str
    survives_restart: bool
    """Whether a log opened again on the same storage recovers what was stored."""
    open: Callable[..., Awaitable[RegionLog]]
    """``await open(**RegionLog.open options)``: a log on this case's storage (the same
    storage each call, so a second open after ``close`` is a restart)."""
    durable_writes: Callable[[], int]
    """Durable writes made so far: what group commit shares among appends."""


class DurableReports:
    """Counts the backend's durable reports (``chunks_written`` calls) on every log it opens:
    the memory backend's unit of durable write (it has no sync to share)."""

    def __init__(self) -> None:
        self.count = 0

    def watch(self, log: RegionLog) -> RegionLog:
        report = log.chunks_written

        def counted(chunks: list[Chunk], sealed: tuple[int, int] | None) -> None:
            self.count += 1
            report(chunks, sealed)

        log.chunks_written = counted  # type: ignore[method-assign]
        return log


@pytest.fixture(params=["file", "memory", pytest.param("kafka", marks=pytest.mark.kafka)])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Case]:
    opened: list[RegionLog] = []
    kind: str = request.param
    if kind == "file":
        syncs: list[int] = []
        real = os.fdatasync

        def counting(fd: int) -> None:
            real(fd)
            if threading.current_thread().name.startswith("wal-writer"):
                syncs.append(fd)

        monkeypatch.setattr(os, "fdatasync", counting)

        async def open_file(**options: Any) -> RegionLog:
            log = await RegionLog.open(tmp_path / "r0", **options)
            opened.append(log)
            return log

        case = Case("file", True, open_file, lambda: len(syncs))
    elif kind == "kafka":
        # Each test has its own WAL name (so its own topics) in the session's Kafka; the
        # cache directory is wiped by every open (Kafka alone is what survives).
        settings = KafkaWal(
            request.getfixturevalue("kafka_server"),
            wal=f"contract-{uuid.uuid4().hex[:12]}",
            replication_factor=1,
        )
        commits: list[int] = []

        async def open_kafka(**options: Any) -> RegionLog:
            log = await RegionLog.open(tmp_path / "r0", kafka=settings, **options)
            backend = log._backend
            assert isinstance(backend, KafkaBackend)
            commits.append(0)
            index = len(commits) - 1
            original = backend._commit

            def counted(group: list[Chunk], metas: list[Any]) -> None:
                original(group, metas)
                if group:
                    commits[index] += 1

            backend._commit = counted  # type: ignore[method-assign]
            opened.append(log)
            return log

        case = Case("kafka", True, open_kafka, lambda: sum(commits))
    else:
        reports = DurableReports()

        async def open_memory(**options: Any) -> RegionLog:
            log = reports.watch(await RegionLog.open(None, **options))
            opened.append(log)
            return log

        case = Case("memory", False, open_memory, lambda: reports.count)
    yield case
    for log in opened:
        await log.close()


async def stored(log: RegionLog) -> dict[str, list[tuple[int, bytes]]]:
    """Every entry the log's segments hold, read back through the backend: per topic name,
    (offset, payload) in the order the frames lie in the segments."""
    names: dict[int, str] = {}
    found: dict[str, list[tuple[int, bytes]]] = {}
    for seq in sorted(log.segment_sizes):
        data = await log.read(seq, 0, log.segment_sizes[seq])
        assert len(data) == log.segment_sizes[seq], f"segment {seq} read back short"
        for frame in iter_frames(data):
            if frame.kind == Kind.TOPIC:
                topic_id, name = decode_topic(frame.body)
                names[topic_id] = name
            elif frame.kind == Kind.MESSAGES:
                header, entries = decode_messages(frame.body)
                found.setdefault(names[header.topic_id], []).extend(
                    (entry.offset, bytes(entry.payload)) for entry in entries
                )
    return found


async def test_offsets_are_consecutive_per_topic_and_stored_in_order(backend: Case) -> None:
    """Appends to three topics, over several chunks and segments: each topic's offsets run
    0, 1, 2... in staging order; ``on_durable`` sees them in that order; the segments hold
    exactly those entries in that order; every seal reports the segment's final size."""
    log = await backend.open(segment_bytes=16 * 1024, segment_seconds=3600)
    topics = ["/ns/a", "/ns/b", "/ns/c"]
    durable: dict[str, list[int]] = {name: [] for name in topics}
    sealed: list[Sealed] = []

    def on_durable(groups: list[Group]) -> None:
        for topic, entries, _size, _body in groups:
            durable[topic.name].extend(entry.offset for entry in entries)

    log.on_durable = on_durable
    log.on_sealed = sealed.append
    staged: dict[str, list[Entry]] = {name: [] for name in topics}
    for i in range(300):
        for name in topics:
            entry = Entry(b"%s-%04d-" % (name.encode(), i) + b"x" * 80)
            log.stage(name, entry)
            staged[name].append(entry)
        if i % 40 == 0:
            await asyncio.sleep(0)  # a new chunk
    for name in topics:
        offsets = await asyncio.wait_for(asyncio.gather(*staged[name]), ANSWER)
        assert offsets == list(range(300)), name
        assert durable[name] == list(range(300)), name
    assert len(sealed) >= 2, "the entries span several segments"
    for seal in sealed:
        assert seal.seq in log.sealed and seal.size == log.segment_sizes[seal.seq]
    found = await stored(log)
    for name in topics:
        assert found[name] == [(e.offset, bytes(e.payload)) for e in staged[name]], name


async def test_offsets_after_a_restart(backend: Case) -> None:
    """A backend whose data survives a restart recovers every topic, and offsets continue
    after the last one stored (never reused); the memory backend starts an empty region."""
    log = await backend.open()
    first = [Entry(b"%d" % i) for i in range(10)]
    assert await asyncio.wait_for(log.stage_batch(TOPIC, first), ANSWER) is None
    await log.close()

    log = await backend.open()
    entry = Entry(b"after")
    log.stage(TOPIC, entry)
    offset = await asyncio.wait_for(entry, ANSWER)
    found = await stored(log)
    if backend.survives_restart:
        assert offset == 10
        assert found[TOPIC] == [(i, b"%d" % i) for i in range(10)] + [(10, b"after")]
    else:
        assert offset == 0
        assert found[TOPIC] == [(0, b"after")]
    await log.close()

    log = await backend.open()
    topic = log.topic(TOPIC)
    if backend.survives_restart:
        assert topic is not None and (topic.first_offset, topic.hwm) == (0, 11)
    else:
        assert topic is None and await stored(log) == {}


async def test_concurrent_appends_share_durable_writes(backend: Case) -> None:
    """Group commit: a thousand appenders, each awaiting its own append, three rounds: every
    append is durable with its own offset, and they share far fewer durable writes."""

    async def append(i: int) -> int:
        entry = Entry(b"%06d" % i + b"x" * 94)
        log.stage(TOPIC, entry)
        return await entry

    log = await backend.open()
    await log.stage(TOPIC, Entry(b"first"))  # registers the topic: not part of the count
    before = backend.durable_writes()
    offsets: list[int] = []
    for round_no in range(3):
        tasks = [append(round_no * 1000 + i) for i in range(1000)]
        offsets += await asyncio.wait_for(asyncio.gather(*tasks), ANSWER)
    writes = backend.durable_writes() - before
    assert sorted(offsets) == list(range(1, 3001))
    assert 0 < writes <= 3000 // 10, f"{writes} durable writes for 3000 appends"
    found = await stored(log)
    assert [offset for offset, _ in found[TOPIC]] == list(range(3001))


#: Entries no frame can hold, and what they break.
BAD: dict[str, tuple[type[Exception], dict[str, Any]]] = {
    "routing key": (InvalidEntryError, {"routing_key": "r" * (MAX_SHORT_FIELD + 1)}),
    "producer name": (InvalidEntryError, {"producer_name": "p" * (MAX_SHORT_FIELD + 1)}),
    "producer_id": (InvalidEntryError, {"producer_id": -1}),
    "payload over max_entry_bytes": (PayloadTooLargeError, {"payload": b"x" * 1025}),
}


@pytest.mark.parametrize("bad", BAD.values(), ids=list(BAD))
async def test_bad_entries_are_refused_before_an_offset(
    backend: Case, bad: tuple[type[Exception], dict[str, Any]]
) -> None:
    """A refused entry (alone, or in a batch: all or nothing) gets no offset and stores
    nothing; the log goes on with the next offset. So does a topic name no frame holds."""
    error, fields = bad
    fields = {"payload": b"bad", **fields}
    log = await backend.open(max_entry_bytes=1024)
    good = Entry(b"a")
    log.stage(TOPIC, good)
    with pytest.raises(error) as refused:
        log.stage(TOPIC, Entry(**fields))
    assert TOPIC in str(refused.value)
    with pytest.raises(error):
        log.stage_batch(TOPIC, [Entry(b"b"), Entry(**fields)])
    with pytest.raises(InvalidEntryError):
        log.stage("/ns/" + "n" * 70_000, Entry(b"c"))
    after = Entry(b"d")
    log.stage(TOPIC, after)
    assert await asyncio.wait_for(asyncio.gather(good, after), ANSWER) == [0, 1]
    assert await stored(log) == {TOPIC: [(0, b"a"), (1, b"d")]}
    assert [topic.name for topic in log.topics()] == [TOPIC]


async def test_segments_are_deleted_below_the_mark_oldest_first(backend: Case) -> None:
    """Deleting the oldest sealed segment (what the cleaner does below the prune mark) moves
    each topic's first offset past it and makes it unreadable; only the oldest sealed one may
    go; appends continue; a backend that survives restarts does not bring it back."""
    log = await backend.open(segment_seconds=3600)
    for round_no in range(3):
        batch = [Entry(b"%d-%d" % (round_no, i)) for i in range(5)]
        await asyncio.wait_for(log.stage_batch(TOPIC, batch), ANSWER)
        if round_no < 2:
            log.rotate()
    first, second = sorted(log.sealed)[-2:]
    assert log.active_seq not in log.sealed
    with pytest.raises(ValueError, match="not the oldest"):
        log.delete_segment(second)
    with pytest.raises(ValueError, match="not sealed"):
        log.delete_segment(log.active_seq)
    for seq in sorted(log.sealed)[:-2]:  # (an empty first segment, if the backend has one)
        await asyncio.wait_for(log.delete_segment(seq), ANSWER)
    held = log.disk_bytes
    log.mark_uploaded(first)
    await asyncio.wait_for(log.delete_segment(first), ANSWER)
    topic = log.topic(TOPIC)
    assert topic is not None and (topic.first_offset, topic.hwm) == (5, 15)
    assert first not in log.sealed and first not in log.segment_sizes
    assert await log.read(first, 0, 100) == b""
    assert log.disk_bytes < held
    entry = Entry(b"after")
    log.stage(TOPIC, entry)
    assert await asyncio.wait_for(entry, ANSWER) == 15
    found = await stored(log)
    assert [offset for offset, _ in found[TOPIC]] == list(range(5, 16))
    await log.close()

    if backend.survives_restart:
        log = await backend.open()
        topic = log.topic(TOPIC)
        assert topic is not None and (topic.first_offset, topic.hwm) == (5, 16)
        assert first not in log.segment_sizes
        assert [offset for offset, _ in (await stored(log))[TOPIC]] == list(range(5, 16))
