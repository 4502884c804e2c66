"""Adaptive group commit: the writer waits for more appends only while they stream in.

Counts real ``os.fdatasync`` calls of the writer thread (the function is wrapped, the syncs
still happen; one test makes each take 2 ms longer, as on a slower disk) and times real
appends on real files.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from danube_ingest.wal import RegionLog
from danube_ingest.wal.framing import Entry

OpenLog = Callable[..., Awaitable[RegionLog]]

TOPIC = "/ns/t"


class Syncs:
    """The fdatasync calls made by WAL writer threads (``calls``: their times); each of them
    takes ``extra`` more seconds."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.extra = 0.0


@pytest.fixture
def fdatasyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Syncs]:
    syncs = Syncs()
    real = os.fdatasync

    def counting(fd: int) -> None:
        real(fd)
        if threading.current_thread().name.startswith("wal-writer"):
            if syncs.extra:
                time.sleep(syncs.extra)
            syncs.calls.append(time.monotonic())

    monkeypatch.setattr(os, "fdatasync", counting)
    yield syncs


async def stream(log: RegionLog, count: int, pause: float) -> list[int]:
    """Stage ``count`` small appends, one every ``pause`` s, without waiting for each to be
    durable (many independent producers); return their offsets once all are durable."""
    entries = []
    for i in range(count):
        entry = Entry(b"%06d" % i + b"x" * 94)
        log.stage(TOPIC, entry)
        entries.append(entry)
        await asyncio.sleep(pause)
    return list(await asyncio.gather(*entries))


async def test_a_stream_of_small_appends_shares_fdatasyncs_while_it_lasts(
    tmp_path: Path, open_log: OpenLog, fdatasyncs: Syncs
) -> None:
    # Appends arrive every ~0.3 ms while each sync takes ~2 ms: several arrive during each.
    fdatasyncs.extra = 0.002
    counts = {}
    for linger_us in (0, 50_000):
        log = await open_log(tmp_path / f"linger-{linger_us}", linger_us=linger_us)
        await log.stage(TOPIC, Entry(b"first"))  # registers the topic: not part of the count
        before = len(fdatasyncs.calls)
        offsets = await stream(log, 400, 0.0002)
        counts[linger_us] = len(fdatasyncs.calls) - before
        assert offsets == list(range(1, 401)), "every append durable, in order"
        await log.close()
        reopened = await open_log(tmp_path / f"linger-{linger_us}")
        assert reopened.topic(TOPIC).hwm == 401  # type: ignore[union-attr]
        await reopened.close()
    # Without lingering, each sync takes what arrived during the previous one (a few appends);
    # lingering, a sync waits for up to 50 ms of the stream or 64 KiB (~470 of these appends).
    assert counts[50_000] * 4 <= counts[0], counts


async def test_an_appender_that_waits_for_each_append_is_never_delayed(
    tmp_path: Path, open_log: OpenLog, fdatasyncs: Syncs
) -> None:
    # Appends 5 ms apart arrive often enough for a 1 s linger, but each appender waits for its
    # previous append: nothing arrives while the writer syncs, so it must not wait (had it
    # lingered, each append would take at least the 10 ms it waits for a follower).
    log = await open_log(tmp_path / "r0", linger_us=1_000_000)
    latencies = []
    for i in range(25):
        start = time.perf_counter()
        entry = Entry(b"x" * 100)
        log.stage(TOPIC, entry)
        assert await entry == i
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.005)
    assert statistics.median(latencies) < 0.005, latencies
    assert len(fdatasyncs.calls) >= 25  # one sync per append, none shared


async def test_when_a_stream_stops_its_last_appends_are_synced_without_waiting_out_the_linger(
    tmp_path: Path, open_log: OpenLog, fdatasyncs: Syncs
) -> None:
    fdatasyncs.extra = 0.002  # appends arrive during each sync: the writer lingers
    log = await open_log(tmp_path / "r0", linger_us=1_000_000)
    for round_ in range(3):
        entries = []
        for _ in range(100):
            entries.append(Entry(b"z" * 100))
            log.stage(TOPIC, entries[-1])
            await asyncio.sleep(0.0002)
        stopped = time.perf_counter()
        offsets = await asyncio.gather(*entries)
        assert offsets == list(range(100 * round_, 100 * round_ + 100))
        # The writer stops lingering once no append came for twice the average gap, long
        # before the 1 s maximum.
        assert time.perf_counter() - stopped < 0.5
    assert len(fdatasyncs.calls) < 150  # ...and it did linger: far fewer syncs than appends


async def test_a_burst_whose_appenders_all_wait_is_synced_without_waiting_out_the_linger(
    tmp_path: Path, open_log: OpenLog
) -> None:
    # A linger far longer than any stall of a loaded machine, so "not waited out" is exact.
    log = await open_log(tmp_path / "r0", linger_us=10_000_000)
    for _ in range(5):
        start = time.perf_counter()
        entries = [Entry(b"y" * 20) for _ in range(1024)]
        for entry in entries:
            log.stage(TOPIC, entry)
        offsets = await asyncio.gather(*entries)
        assert offsets == sorted(offsets) and len(set(offsets)) == 1024
        # Lingering (if at all) ends once no more appends arrive, far before the 10 s maximum.
        assert time.perf_counter() - start < 5


async def test_a_large_group_is_written_at_once(
    tmp_path: Path, open_log: OpenLog, fdatasyncs: Syncs
) -> None:
    # A group of 64 KiB or more amortises its sync already: the writer does not wait for more,
    # even in the middle of a stream.
    log = await open_log(tmp_path / "r0", linger_us=10_000_000)
    start = time.perf_counter()
    for _ in range(20):
        log.stage(TOPIC, Entry(os.urandom(80 * 1024)))
        await asyncio.sleep(0.001)
    last = Entry(b"last")
    log.stage(TOPIC, last)
    assert await last == 20
    assert time.perf_counter() - start < 5  # the 10 s linger was never waited out
    assert len(fdatasyncs.calls) >= 5
