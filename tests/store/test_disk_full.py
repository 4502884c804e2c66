"""A really full disk (a small tmpfs): backpressure before any write fails, recovery without a
restart once space is freed, and the fail-stop when ENOSPC happens anyway."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from danube_ingest.cli import main
from danube_ingest.config.models import RetentionConfig
from danube_ingest.errors import WalBackpressureError, WalFailedError
from danube_ingest.store import TopicStore
from danube_ingest.testing import fill_filesystem, small_filesystem
from danube_ingest.wal import Entry
from danube_ingest.wal.log import RegionLog
from danube_ingest.wal.segment import segment_path

from .conftest import KiB, MiB, local_cleaner, read_until, within

T = "/default/disk"
#: The filesystem under test: small enough to fill in a moment.
DISK = 16 * MiB
SEGMENT = 256 * KiB
FLOOR = 2 * MiB


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "disk", DISK) as path:
        yield path


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def open_store(wal: Path, floor: int = FLOOR) -> TopicStore:
    return await TopicStore.open(
        wal,
        segment_bytes=SEGMENT,
        max_batch_bytes=SEGMENT,
        segment_seconds=3600,
        min_free_bytes=floor,
    )


async def fill_with_appends(store: TopicStore, payload: int, *, burst: int) -> list[int]:
    """Append ``burst`` entries at a time until one is refused; return the acknowledged offsets
    (every entry is acknowledged or refused, none fails)."""
    acked: list[int] = []
    i = 0
    while True:
        waits = []
        refused = None
        for _ in range(burst):
            try:
                waits.append(store.append(T, Entry(b"%08d" % i + b"." * (payload - 8))))
            except WalBackpressureError as exc:
                refused = exc
                break
            i += 1
        acked.extend(await within(asyncio.gather(*waits)))
        if refused is not None:
            assert refused.retriable
            assert "storage.wal.retention.min_free_bytes" in str(refused)
            assert str(store.regions[0].region_dir.parent) in str(refused)  # type: ignore[union-attr]
            return acked
        assert i < 10_000, "the disk never filled up"


async def test_full_disk_is_backpressure_before_any_write_fails_and_lifts_once_freed(
    disk: Path,
) -> None:
    ballast = disk / "ballast"
    fill_filesystem(ballast, leave=8 * MiB)
    store = await open_store(disk / "wal")
    try:
        acked = await fill_with_appends(store, 8 * KiB, burst=32)
        assert len(acked) > 100 and acked == list(range(len(acked)))
        assert store.full and store.disk_low
        assert free(disk) >= FLOOR // 2, "appends ate into the floor"
        with pytest.raises(WalBackpressureError):
            await store.append(T, Entry(b"refused"))
        # Nothing acknowledged is lost, nothing refused was written.
        got = await read_until(store.create_reader(T, 0), len(acked))
        assert [e.offset for e in got] == acked
        assert store.info(T).high_watermark == len(acked)  # type: ignore[union-attr]

        # The operator frees space: publishes go through again, without a restart.
        ballast.unlink()
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            try:
                after = await within(store.append(T, Entry(b"after")))
                break
            except WalBackpressureError:
                assert asyncio.get_running_loop().time() < deadline, "backpressure never lifted"
                await asyncio.sleep(0.05)
        assert after == len(acked)
        assert not store.full
    finally:
        await store.close()
    assert main(["wal", "verify", "--wal-dir", str(disk / "wal")]) == 0
    reopened = await open_store(disk / "wal")
    try:
        got = await read_until(reopened.create_reader(T, 0), len(acked) + 1)
        assert [e.offset for e in got] == [*acked, len(acked)]
        assert got[-1].payload == b"after"
    finally:
        await reopened.close()


async def test_segment_preallocation_never_takes_the_disk_below_the_floor(disk: Path) -> None:
    async def spare_blocks(floor: int) -> int:
        region = disk / f"floor-{floor}"
        log = await RegionLog.open(
            region, segment_bytes=4 * MiB, segment_seconds=3600, min_free_bytes=floor
        )
        try:
            spare = segment_path(region, log.active_seq + 1)
            for _ in range(200):
                if spare.exists():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # a reservation right after the creation is done by now
            return os.stat(spare).st_blocks
        finally:
            await log.close()

    assert await spare_blocks(0) > 0  # the filesystem does preallocate
    # 16 MiB free, 4 MiB reserved would leave 12 MiB: below a floor of 14 MiB.
    assert await spare_blocks(14 * MiB) == 0


async def test_cleaner_counts_free_space_as_retention(disk: Path) -> None:
    store = await open_store(disk / "wal")
    cleaner = local_cleaner(store, RetentionConfig(max_bytes=DISK, min_free_bytes=FLOOR))
    try:
        for i in range(12):
            await store.append(T, Entry(b"x" * 200 * KiB))
            if i % 2:
                store.regions[0].rotate()
        sealed = sorted(store.regions[0].sealed)
        assert len(sealed) >= 5
        assert await cleaner.clean_once() == []  # within every retention limit
        # Something else takes the disk: below the floor, appends are refused ...
        fill_filesystem(disk / "ballast", leave=FLOOR - 300 * KiB)
        assert store.disk_below_floor() and store.full
        with pytest.raises(WalBackpressureError):
            await store.append(T, Entry(b"refused"))
        # ... and the cleaner prunes the oldest segments until the floor is free again.
        deleted = await cleaner.clean_once()
        assert deleted and deleted == [("r0", seq) for seq in sealed[: len(deleted)]]
        assert len(deleted) < len(sealed), "pruned more than the floor needed"
        assert not store.full
        await within(store.append(T, Entry(b"after")))
    finally:
        await store.close()


async def test_enospc_without_a_floor_acknowledges_nothing_and_stops_the_region(
    disk: Path,
) -> None:
    """The fail-stop choice (see danube_ingest.wal.space): a write that fails for want of
    space fails its appends and every later one; a restart recovers exactly what was
    acknowledged."""
    ballast = disk / "ballast"
    fill_filesystem(ballast, leave=4 * MiB)
    store = await open_store(disk / "wal", floor=0)
    acked: list[int] = []
    try:
        with pytest.raises(WalFailedError):
            for i in range(1000):
                acked.append(await within(store.append(T, Entry(b"%08d" % i + b"." * 64 * KiB))))
        assert 0 < len(acked) < 1000
        with pytest.raises(WalFailedError):
            await store.append(T, Entry(b"later"))
    finally:
        await store.close()
    ballast.unlink()
    assert main(["wal", "verify", "--wal-dir", str(disk / "wal")]) == 0
    reopened = await open_store(disk / "wal", floor=0)
    try:
        assert reopened.info(T).high_watermark == len(acked)  # type: ignore[union-attr]
        got = await read_until(reopened.create_reader(T, 0), len(acked))
        assert [e.offset for e in got] == acked
        assert [e.payload[:8] for e in got] == [b"%08d" % i for i in acked]
        assert await within(reopened.append(T, Entry(b"after"))) == len(acked)
    finally:
        await reopened.close()
