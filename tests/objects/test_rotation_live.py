"""Rotation while a producer publishes and a consumer reads through objects: the real
TopicStore, uploader, ingest clock and cleaner (``support.ColdStack``) on the real etcd, over
memory, fs and s3 (moto). The WAL is pruned under the consumer, so it reads from objects."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.orphans import collect_orphans, manifest_integrity, referenced_objects
from danube_ingest.objects.reclock import ClockKeeper
from danube_ingest.objects.rotation import RotationLimits, plan_rotation, rotate_topic
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry

from .support import ColdStack, T, assert_one_line, payloads, prune_all

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

OTHER = "/default/other"
"""Shares the segment objects with ``T`` and is never rotated."""
TOTAL = 3000
BATCH = 100
HOUR_MS = 3_600_000
#: Small objects, so that one test makes many of them.
LIMITS = RotationLimits(max_object_bytes=2 * 1024, frame_bytes=8 * 1024)


async def _publish(
    stack: ColdStack, clock: ClockKeeper, start: int, end: int, sizes: dict[int, int]
) -> None:
    """Publish ``[start, end)`` of ``T`` (and some of ``OTHER``) in batches; each batch is
    sealed, uploaded, covered by the clock, and pruned from the WAL. ``sizes``: start offset
    -> stored bytes of each segment range of ``T`` (read before the clock lets rotation in)."""
    sent = payloads(T, end - start, start)
    for i in range(0, len(sent), BATCH):
        await stack.append(T, sent[i : i + BATCH])
        await stack.append(OTHER, payloads(OTHER, 5, i))
        await stack.seal_and_upload()
        for rng in await stack.manifest.ranges(T):
            if rng.kind == "segment":
                sizes.setdefault(rng.start_offset, rng.byte_length)
        await clock.run_once()  # marks the offsets reached
        await clock.run_once()  # writes the mark now that they are uploaded
        await prune_all(stack, T, OTHER)
        await asyncio.sleep(0.01)


def _bound(sizes: list[int]) -> int:
    """Objects needed for ranges of ``sizes`` (in order) packed greedily, as rotation does."""
    objects, filled = 0, LIMITS.max_object_bytes
    for size in sizes:
        if filled + size > LIMITS.max_object_bytes:
            objects, filled = objects + 1, 0
        filled += size
    return objects


async def _consume(stack: ColdStack, n: int) -> list[Entry]:
    """A slow consumer from offset 0: small batches, a pause after each."""
    reader = stack.store.create_reader(T, 0, max_batch=16)
    out: list[Entry] = []

    async def run() -> None:
        while len(out) < n:
            out.extend(await reader.next_batch())
            await asyncio.sleep(0.005)

    await asyncio.wait_for(run(), 120)
    return out


async def _rotate_until(stack: ColdStack, done: asyncio.Event) -> int:
    rotated = 0
    while not done.is_set():
        report = await rotate_topic(stack.manifest, stack.objects, T, LIMITS)
        rotated += len(report.objects)
        await asyncio.sleep(0.05)
    return rotated


async def test_rotation_while_publishing_and_reading_through_objects(
    etcd_kv: EtcdKV, keys: Keys, object_store: ObjectStore, tmp_path: Path
) -> None:
    stack = await ColdStack(etcd_kv, keys, object_store, tmp_path / "wal").open()
    try:
        await stack.acquire(T, OTHER)
        stack.uploader.start()
        clock = ClockKeeper(stack.store, stack.ownership, lambda: [T, OTHER], interval=3600)
        sizes: dict[int, int] = {}
        await _publish(stack, clock, 0, TOTAL // 3, sizes)
        info = stack.store.info(T)
        assert info is not None and info.first_offset > 0  # the consumer starts in objects

        published = asyncio.Event()
        consumer = asyncio.ensure_future(_consume(stack, TOTAL))
        rotator = asyncio.ensure_future(_rotate_until(stack, published))
        await _publish(stack, clock, TOTAL // 3, TOTAL, sizes)
        published.set()
        got = await consumer
        assert await rotator > 0

        assert [e.offset for e in got] == list(range(TOTAL))
        assert [e.payload for e in got] == payloads(T, TOTAL)
        before = len(await stack.manifest.ranges(T))
        final = await rotate_topic(stack.manifest, stack.objects, T, LIMITS)
        ranges = await stack.manifest.ranges(T)
        assert_one_line(ranges, TOTAL)
        assert len(ranges) == final.entries_after <= before
        # At the bound: nothing closed is left; rolling objects first, then the tail of
        # segment ranges, which is not full (its input would fit one object).
        assert (await plan_rotation(stack.manifest, T, LIMITS)).groups == ()
        kinds = [r.kind for r in ranges]
        tail = [r for r in ranges if r.kind == "segment"]
        assert kinds == sorted(kinds, key=lambda k: k == "segment"), kinds
        assert sum(r.byte_length for r in tail) <= LIMITS.max_object_bytes
        cut = tail[0].start_offset if tail else TOTAL
        rotated = [size for first, size in sorted(sizes.items()) if first < cut]
        assert len(ranges) - len(tail) <= _bound(rotated)

        later = int(time.time() * 1000) + 2 * HOUR_MS
        await collect_orphans(stack.kv, stack.keys, stack.objects, now_ms=later)
        named = set(await referenced_objects(stack.kv, stack.keys))
        stored = set(await stack.objects.list("segments/")) | set(
            await stack.objects.list("topics/")
        )
        assert stored == named  # no orphan left; the other topic's segments stay
        assert any(k.startswith("segments/") for k in named)
        integrity = await manifest_integrity(stack.kv, stack.keys, stack.objects, deep=True)
        assert integrity.ok, integrity.problems
        reader = stack.store.create_reader(T, 0, max_batch=512)
        again: list[Entry] = []
        while len(again) < TOTAL:
            again.extend(await asyncio.wait_for(reader.next_batch(), 20))
        assert [e.offset for e in again] == list(range(TOTAL))
    finally:
        await stack.close()
