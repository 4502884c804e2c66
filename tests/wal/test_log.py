"""RegionLog's segment files on disk: blocks reserved ahead, released at the seal, removed off
the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import danube_ingest.wal.local.writer as wal_writer
import danube_ingest.wal.log as wal_log
from danube_ingest.wal import RegionLog
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.meta import SNAPSHOT_NAME
from danube_ingest.wal.segment import segment_path

OpenLog = Callable[..., Awaitable[RegionLog]]

SEGMENT = 1024 * 1024


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


async def test_next_segment_has_its_blocks_reserved_and_a_sealed_one_keeps_only_its_data(
    tmp_path: Path, open_log: OpenLog
) -> None:
    region = tmp_path / "r0"
    log = await open_log(region, segment_bytes=SEGMENT, segment_seconds=3600)
    await asyncio.gather(*(log.stage("/ns/t", Entry(b"x" * 100)) for _ in range(10)))
    active = log.active_seq
    spare = segment_path(region, active + 1)
    deadline = asyncio.get_running_loop().time() + 5
    while not spare.exists():  # created in the background
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert spare.stat().st_size == 0  # empty: appends and recovery see an empty file
    assert allocated(spare) >= SEGMENT  # ...whose blocks are reserved already

    log.rotate()
    while active not in log.sealed:
        await asyncio.sleep(0.005)
    sealed = segment_path(region, active)
    size = sealed.stat().st_size
    assert size == log.segment_sizes[active] > 1000
    assert allocated(sealed) < size + 64 * 1024  # the unused reservation was given back
    await log.close()

    reopened = await open_log(region, segment_bytes=SEGMENT)
    assert reopened.topic("/ns/t").hwm == 10  # type: ignore[union-attr]
    await reopened.close()


async def test_a_deleted_segment_is_removed_off_the_loop_and_close_waits_for_it(
    tmp_path: Path, open_log: OpenLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index forgets the segment when delete_segment is called; its file is unlinked (and
    the directory synced) in a worker thread while the loop goes on appending; the removal's
    future, a snapshot that no longer lists the segment, and close() all wait until the file
    is gone (a snapshot written first would leave a restart a file nothing points into)."""
    monkeypatch.setattr(wal_log, "SNAPSHOT_MIN_INTERVAL", 0.0)  # every seal writes one
    region = tmp_path / "r0"
    snapshot = region / SNAPSHOT_NAME
    log = await open_log(region, segment_bytes=SEGMENT, segment_seconds=3600)
    await asyncio.gather(*(log.stage("/ns/t", Entry(b"x" * 100)) for _ in range(10)))
    first = log.active_seq
    log.rotate()
    await asyncio.gather(*(log.stage("/ns/t", Entry(b"y" * 100)) for _ in range(10)))
    assert first in log.sealed
    deadline = asyncio.get_running_loop().time() + 5
    while not snapshot.exists():  # the seal's snapshot, written once the seal is durable
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    before = snapshot.read_bytes()

    gate, started = threading.Event(), threading.Event()
    real_remove = wal_writer.remove_segments

    def gated_remove(region_dir: Path, seqs: list[int]) -> None:
        started.set()
        assert gate.wait(10)
        real_remove(region_dir, seqs)

    monkeypatch.setattr(wal_writer, "remove_segments", gated_remove)
    deleting = asyncio.ensure_future(log.delete_segment(first))
    while not started.is_set():
        await asyncio.sleep(0.005)
    # The index already forgot it; the file is still there while the thread waits.
    assert first not in log.sealed and first not in log.segment_sizes
    assert log.topic("/ns/t").first_offset == 10  # type: ignore[union-attr]
    assert await log.read(first, 0, 100) == b""
    assert segment_path(region, first).exists()
    # The loop is free: more appends are made durable meanwhile, a seal among them.
    log.rotate()
    await asyncio.wait_for(
        asyncio.gather(*(log.stage("/ns/t", Entry(b"z" * 100)) for _ in range(5))), 5
    )
    await asyncio.sleep(0.1)
    assert not deleting.done()
    assert snapshot.read_bytes() == before  # the seal's snapshot waits for the removal
    closing = asyncio.ensure_future(log.close())
    await asyncio.sleep(0.1)
    assert not closing.done()  # close() waits for the removal
    gate.set()
    await asyncio.wait_for(deleting, 5)
    await asyncio.wait_for(closing, 5)
    assert not segment_path(region, first).exists()
    assert snapshot.read_bytes() != before

    reopened = await open_log(region, segment_bytes=SEGMENT)
    topic = reopened.topic("/ns/t")
    assert topic is not None and (topic.first_offset, topic.hwm) == (10, 25)
