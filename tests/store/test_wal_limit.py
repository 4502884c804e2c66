"""A WAL at its size limit (``retention.max_bytes``) where pruning is allowed (``local_only``):
the store wakes the cleaner at the prune level, a few segments below the limit, so a writer
that keeps going never finds the WAL full, and the WAL never holds more than the limit."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import danube_ingest.wal.local.writer as wal_writer
from danube_ingest.config.models import RetentionConfig
from danube_ingest.wal import Entry
from danube_ingest.wal.segment import segment_path
from danube_ingest.wal.space import prune_level

from .conftest import (
    KiB,
    MiB,
    StoreFactory,
    assert_sequence,
    info_of,
    local_cleaner,
    read_until,
    within,
)

T = "/default/limit"
SEGMENT = 64 * KiB
LIMIT = 1 * MiB
PAYLOAD = 16 * KiB
RETENTION = RetentionConfig(max_bytes=LIMIT, min_free_bytes=0)


def test_the_prune_level_is_four_segments_below_the_limit_and_above_zero() -> None:
    assert prune_level(1024 * MiB, 8 * MiB) == 992 * MiB
    assert prune_level(LIMIT, SEGMENT) == LIMIT - 4 * SEGMENT
    assert prune_level(2 * SEGMENT, SEGMENT) == 2 * SEGMENT - SEGMENT // 2
    assert prune_level(SEGMENT, SEGMENT) == SEGMENT - SEGMENT // 4 > 0


async def test_a_wal_at_its_limit_is_pruned_before_appends_find_it_full(
    stores: StoreFactory,
) -> None:
    store = await stores.open(
        segment_bytes=SEGMENT,
        max_batch_bytes=SEGMENT,
        segment_seconds=3600,
        max_wal_bytes=LIMIT,
    )
    assert store.prune_wal_bytes == LIMIT - 4 * SEGMENT
    # Only the store's wake-ups run a pass.
    cleaner = local_cleaner(store, RETENTION, interval=3600)
    store.on_pressure = cleaner.wake
    cleaner.start()
    payloads = [b"%06d" % i + b"x" * PAYLOAD for i in range(3 * LIMIT // PAYLOAD)]
    peak = 0
    try:
        for payload in payloads:  # three times the limit, one durable append after another
            await within(store.append(T, Entry(payload)))  # never WalBackpressureError
            peak = max(peak, store.wal_bytes())
            assert not store.full
    finally:
        await cleaner.stop()
    assert cleaner.stats.forced == cleaner.stats.segments > 0
    assert peak <= LIMIT
    info = info_of(store, T)
    assert info.high_watermark == len(payloads) and info.first_offset > 0
    retained = await read_until(store.create_reader(T, info.first_offset), len(payloads))
    assert_sequence(retained, info.first_offset, payloads[info.first_offset :])


async def test_a_segment_file_that_cannot_be_removed_is_reported_and_pruning_goes_on(
    file_stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await file_stores.open(
        segment_bytes=SEGMENT, max_batch_bytes=SEGMENT, segment_seconds=3600
    )
    cleaner = local_cleaner(store, RETENTION)
    for i in range(2 * LIMIT // PAYLOAD):
        await store.append(T, Entry(b"%06d" % i + b"x" * PAYLOAD))
    region = store.regions[0]
    oldest = min(region.sealed)

    def unremovable(region_dir: Path, seqs: list[int]) -> None:
        raise OSError(errno.EIO, "Input/output error", str(segment_path(region_dir, seqs[0])))

    monkeypatch.setattr(wal_writer, "remove_segments", unremovable)
    with pytest.raises(OSError, match="Input/output error"):
        await cleaner.clean_once()
    # Forgotten by the WAL all the same, counted, and the next pass goes on from the next
    # segment, removing the file left behind with its own.
    assert oldest not in region.sealed and store.wal_bytes() <= LIMIT - 4 * SEGMENT
    assert cleaner.stats.failures >= 1 and "Input/output error" in str(cleaner.stats.last_error)
    assert segment_path(region.region_dir, oldest).exists()  # type: ignore[arg-type]
    monkeypatch.undo()
    for _ in range(8):
        await store.append(T, Entry(b"y" * PAYLOAD))
    assert await cleaner.clean_once()
    assert store.wal_bytes() <= LIMIT - 4 * SEGMENT
    assert not segment_path(region.region_dir, oldest).exists()  # type: ignore[arg-type]
