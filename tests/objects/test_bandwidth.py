"""TokenBucket and paced_chunks: the bandwidth limit's own guarantees, on the real clock
(lower bounds on elapsed time, which no slow machine can break)."""

from __future__ import annotations

import asyncio
import time

import pytest

from danube_ingest.objects.bandwidth import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    TokenBucket,
    chunk_bytes,
    paced_chunks,
)

MiB = 1 << 20


async def test_grants_no_faster_than_the_rate_after_the_first_burst() -> None:
    rate, burst = 4 * MiB, 64 * 1024
    bucket = TokenBucket(rate, burst=burst)
    started = time.monotonic()
    await bucket.take(burst)  # the bucket starts full: the first burst is free
    assert time.monotonic() - started < 0.5
    await bucket.take(MiB)  # more than a burst: granted in steps, each waiting its turn
    elapsed = time.monotonic() - started
    assert elapsed >= MiB / rate
    assert bucket.granted == burst + MiB
    assert bucket.waited > 0


async def test_concurrent_takers_share_one_rate_and_all_progress() -> None:
    rate, chunk = 2 * MiB, 64 * 1024
    bucket = TokenBucket(rate, burst=chunk)
    finished: dict[int, float] = {}
    started = time.monotonic()

    async def upload(n: int) -> None:
        async for _ in paced_chunks(bytes(256 * 1024), bucket, chunk):
            pass
        finished[n] = time.monotonic() - started

    await asyncio.gather(*(upload(n) for n in range(4)))
    # 1 MiB through one 2 MiB/s bucket, whatever the number of takers.
    assert max(finished.values()) >= (MiB - chunk) / rate
    # Turns alternate chunk by chunk (FIFO): nobody finishes its 256 KiB alone at full rate
    # (that would take (256 KiB - one burst) / rate = 0.09 s). The first taker, which has a
    # chunk to itself before the others arrive, still waits for at least two of their chunks
    # per chunk of its own after that (0.28 s here).
    assert min(finished.values()) >= (2 * 256 * 1024) / rate


async def test_a_cancelled_taker_is_granted_nothing() -> None:
    bucket = TokenBucket(MiB, burst=64 * 1024)
    await bucket.take(64 * 1024)
    waiter = asyncio.create_task(bucket.take(512 * 1024))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert bucket.granted == 64 * 1024


async def test_paced_chunks_yield_the_data_in_order_in_chunks() -> None:
    data = bytes(range(256)) * 1000
    bucket = TokenBucket(100 * MiB, burst=4096)
    pieces = [piece async for piece in paced_chunks(data, bucket, 4096)]
    assert b"".join(pieces) == data
    assert {len(p) for p in pieces[:-1]} == {4096}
    assert bucket.granted == len(data)


def test_chunk_size_follows_the_rate_within_bounds() -> None:
    assert chunk_bytes(MiB) == MIN_CHUNK_BYTES
    assert chunk_bytes(8 * MiB) == 8 * MiB // 20
    assert chunk_bytes(1 << 40) == MAX_CHUNK_BYTES


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_invalid_bucket_is_refused(rate: int, burst: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        TokenBucket(rate, burst=burst)
