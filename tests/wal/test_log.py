"""RegionLog's segment files on disk: blocks reserved ahead, released at the seal."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from danube_ingest.wal import RegionLog
from danube_ingest.wal.framing import Entry
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
