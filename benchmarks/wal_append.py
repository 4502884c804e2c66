"""Durable append throughput and latency of TopicStore (fsync="always") against plain Python.

Run: ``.venv/bin/python benchmarks/wal_append.py`` (no arguments, ~45 s on 2 cores).

Throughput figures need an otherwise idle machine; the run warns when the load average is high
and also reports process CPU time per message, which other load distorts much less.

Main figure (``value``): 100-byte payloads appended by 1024 concurrent asyncio tasks, each
looping ``await store.append(topic, Entry(payload))``; messages acknowledged durable per second.

Baseline: the least a durable group-commit log can do in single-threaded Python: per message
one ``struct.pack('<IIQ', len, crc32c(payload), offset)`` and two bytearray appends, per batch of
1024 messages one ``os.write`` and one ``os.fdatasync``. No asyncio, no threads, no offsets per
topic, no index, no cache. The main measurement and the baseline (and the raw-disk ceiling) run
three times interleaved; the medians are reported, since this machine's disk is noisy.

Extras (all measured in the same run, see docs/benchmarks.md):

* ``batched_1_*`` / ``batched_4_*``: ``append_batch`` of 1024 entries per call, one caller and
  four concurrent callers, against the same baseline. ``entry_build_*``: what building those
  entries (``Entry(payload)``, in the caller) costs per message alone, also as a share of the
  baseline's whole time per message.
* ``raw_disk_*``: the raw-disk ceiling: the baseline's pre-framed bytes (one batch, 1024
  messages), written with ``os.write`` + ``os.fdatasync`` only, nothing computed per message.
* ``latency_*``: one task appending sequentially (one append in flight) against a raw loop of a
  116-byte ``os.write`` + ``os.fdatasync``; p50/p99 in ms; ``latency_p99_margin_ms`` is store p99
  minus raw p99.
* ``mib1_*``: 1 MiB payloads, one in flight and four in flight, against a raw loop of 1 MiB
  ``os.write`` + ``os.fdatasync``; MiB/s of payload. ``mib1_raw4_*``: a raw loop of the write
  the store makes with four in flight (4 MiB in one ``os.writev``, one ``os.fdatasync``).
* ``uvloop_*``: the main measurement once more on a uvloop event loop (if importable).
* ``prototype_*``: the issue's comparator, driven by the main figure's 1024 tasks: a minimal
  asyncio group-commit log (``PrototypeLog``) with one future per append, struct+crc32c framing
  into a bytearray, one ``os.write`` + ``os.fdatasync`` per batch in a writer thread and one
  ``call_soon_threadsafe`` per batch. ``store_vs_prototype`` is store msg/s / prototype msg/s.
* ``asyncio_ceiling_*``: the same 1024 tasks with no store and no I/O, each awaiting a shared
  future that a loop callback completes once per loop iteration (``LoopTicker``): what asyncio
  task switching alone allows.

The two references run in the same three interleaved rounds as the main measurement.
"""

from __future__ import annotations

import asyncio
import os
import queue
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from _common import (
    MIB,
    FsyncCounter,
    bench_dir,
    emit,
    machine,
    median,
    percentile,
    ratio,
    say,
    warn_if_busy,
)
from crc32c import crc32c

from danube_ingest.runtime import tune_gc
from danube_ingest.store.topic_store import TopicStore
from danube_ingest.wal.framing import Entry

PAYLOAD_BYTES = 100
PAYLOAD = bytes(range(PAYLOAD_BYTES))
BATCH = 1024
TASKS = 1024
TOPIC = "bench"
REPEATS = 3

MAIN_SECONDS = 2.0
MAIN_WARMUP = 0.4
# The prototype gets the main window (it is the figure the store is compared with); the
# ceiling gets a shorter one so that the whole run stays under a minute on 2 cores.
PROTOTYPE_SECONDS = MAIN_SECONDS
CEILING_SECONDS = 1.0
SYNC_SECONDS = 1.2
SYNC_WARMUP_BATCHES = 16
BATCHED_SECONDS = 1.5
LATENCY_ROUNDS = 2
LATENCY_PER_ROUND = 1000
LATENCY_WARMUP = 50
BIG_SECONDS = 0.6
BIG_WARMUP = 0.15
BIG_ROUNDS = 4
BIG = os.urandom(MIB)

GOAL_MAIN = 0.25
GOAL_BATCHED = 0.7
GOAL_LATENCY_MARGIN_MS = 2.0
GOAL_BIG = 0.9

_HDR = struct.Struct("<IIQ")


# -- plain Python references (no asyncio) ----------------------------------------------------


def _open_new(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)


def baseline_group_commit(path: Path, seconds: float) -> tuple[float, float]:
    """Minimal single-threaded group commit: frame 1024 messages, one write, one fdatasync.

    Returns (msg/s, process CPU µs per message).
    """
    fd = _open_new(path)
    pack = _HDR.pack
    payload = PAYLOAD
    write = os.write
    sync = os.fdatasync
    buf = bytearray()
    offset = 0
    batches = 0
    start = cpu0 = 0.0
    deadline = float("inf")
    try:
        while True:
            for _ in range(BATCH):
                buf += pack(len(payload), crc32c(payload), offset)
                buf += payload
                offset += 1
            written = write(fd, buf)
            assert written == len(buf)
            sync(fd)
            buf.clear()
            batches += 1
            if batches == SYNC_WARMUP_BATCHES:
                start = time.perf_counter()
                cpu0 = time.process_time()
                deadline = start + seconds
            elif batches > SYNC_WARMUP_BATCHES and time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
    msgs = (batches - SYNC_WARMUP_BATCHES) * BATCH
    return msgs / elapsed, cpu / msgs * 1e6


def _framed_batch() -> bytes:
    buf = bytearray()
    for offset in range(BATCH):
        buf += _HDR.pack(len(PAYLOAD), crc32c(PAYLOAD), offset)
        buf += PAYLOAD
    return bytes(buf)


def _write_sync_rate(path: Path, data: bytes, warmup: int, seconds: float) -> float:
    """Writes per second of ``data`` (os.write + os.fdatasync each) after ``warmup`` of them."""
    fd = _open_new(path)
    n = 0
    start = 0.0
    deadline = float("inf")
    try:
        while True:
            os.write(fd, data)
            os.fdatasync(fd)
            n += 1
            if n == warmup:
                start = time.perf_counter()
                deadline = start + seconds
            elif n > warmup and time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return (n - warmup) / elapsed


def raw_disk(path: Path, seconds: float) -> float:
    """The ceiling: the baseline's pre-framed batch, write + fdatasync only (msg/s)."""
    return _write_sync_rate(path, _framed_batch(), SYNC_WARMUP_BATCHES, seconds) * BATCH


def raw_sync_latencies(path: Path, count: int) -> list[float]:
    """Seconds per small write (one framed 100-byte message) + fdatasync."""
    data = _framed_batch()[: _HDR.size + PAYLOAD_BYTES]
    fd = _open_new(path)
    out = []
    try:
        for i in range(count + LATENCY_WARMUP):
            t = time.perf_counter()
            os.write(fd, data)
            os.fdatasync(fd)
            if i >= LATENCY_WARMUP:
                out.append(time.perf_counter() - t)
    finally:
        os.close(fd)
    return out


def raw_big(path: Path, seconds: float) -> float:
    """MiB/s of 1 MiB os.write + fdatasync, growing one file."""
    return _write_sync_rate(path, BIG, 4, seconds)


def raw_big4(path: Path, seconds: float) -> float:
    """MiB/s of 4 MiB writes (four 1 MiB buffers, one os.writev) + one fdatasync each: the
    group the store writes with four 1 MiB appends in flight."""
    fd = _open_new(path)
    n = 0
    start = 0.0
    deadline = float("inf")
    group = [BIG] * 4
    try:
        while True:
            os.writev(fd, group)
            os.fdatasync(fd)
            n += 1
            if n == 2:
                start = time.perf_counter()
                deadline = start + seconds
            elif n > 2 and time.perf_counter() >= deadline:
                break
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return (n - 2) * 4 / elapsed


def entry_build_us() -> float:
    """Microseconds per message to build ``append_batch``'s entries: the batched caller's
    ``[Entry(payload) for _ in range(1024)]``, which the store's figure includes (best of 20)."""
    best = float("inf")
    payload = PAYLOAD
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(10):
            entries = [Entry(payload) for _ in range(BATCH)]
        best = min(best, (time.perf_counter() - t) / (10 * BATCH))
    del entries
    return best * 1e6


# -- TopicStore measurements -----------------------------------------------------------------


async def _timed_window(
    counter: Callable[[], int], warmup: float, seconds: float, fsyncs: FsyncCounter | None
) -> dict[str, float]:
    """Sleep through warm-up, then measure progress over ``seconds``.

    Returns rate (per s), fdatasyncs/s, items per fdatasync and process CPU µs per item (all
    threads of this process: event loop, WAL writer, snapshot helpers).
    """
    await asyncio.sleep(warmup)
    f0 = fsyncs.calls if fsyncs else 0
    c0, t0, cpu0 = counter(), time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    c1, t1, cpu1 = counter(), time.perf_counter(), time.process_time()
    f1 = fsyncs.calls if fsyncs else 0
    done, elapsed, syncs = c1 - c0, t1 - t0, f1 - f0
    return {
        "rate": done / elapsed,
        "fsyncs_per_s": syncs / elapsed,
        "msgs_per_fsync": done / syncs if syncs else float("nan"),
        "cpu_us_per_msg": (cpu1 - cpu0) / done * 1e6 if done else float("nan"),
    }


Append = Callable[[str, Entry], Awaitable[object]]


async def drive_tasks(append_fn: Append, seconds: float) -> tuple[dict[str, float], int]:
    """The main figure's driver: ``TASKS`` tasks each looping ``await append(topic, Entry(...))``.

    Shared by the store and both references, so they differ only in ``append_fn``. Returns the
    window's figures (see ``_timed_window``) and the number of appends awaited in total.
    """
    done = 0
    stop = False
    payload = PAYLOAD

    async def worker() -> None:
        nonlocal done
        append = append_fn
        while not stop:
            await append(TOPIC, Entry(payload))
            done += 1

    workers = [asyncio.create_task(worker()) for _ in range(TASKS)]
    with FsyncCounter() as fsyncs:
        res = await _timed_window(lambda: done, MAIN_WARMUP, seconds, fsyncs)
    stop = True
    await asyncio.gather(*workers)
    return res, done


async def store_concurrent(wal_dir: Path) -> dict[str, float]:
    """``TASKS`` tasks each looping ``await store.append(topic, Entry(payload))``."""
    store = await TopicStore.open(wal_dir, fsync="always")
    res, done = await drive_tasks(store.append, MAIN_SECONDS)
    info = store.info(TOPIC)
    await store.close()
    assert info is not None and info.high_watermark >= done, (info, done)
    return res


async def store_batched(wal_dir: Path, callers: int) -> dict[str, float]:
    """``callers`` tasks each looping ``await store.append_batch(topic, 1024 new entries)``."""
    store = await TopicStore.open(wal_dir, fsync="always")
    done = 0
    stop = False
    payload = PAYLOAD

    async def caller() -> None:
        nonlocal done
        while not stop:
            entries = [Entry(payload) for _ in range(BATCH)]
            await store.append_batch(TOPIC, entries)
            done += BATCH

    workers = [asyncio.create_task(caller()) for _ in range(callers)]
    with FsyncCounter() as fsyncs:
        res = await _timed_window(lambda: done, MAIN_WARMUP, BATCHED_SECONDS, fsyncs)
    stop = True
    await asyncio.gather(*workers)
    await store.close()
    return res


async def store_latencies(wal_dir: Path, count: int) -> list[float]:
    """Seconds per ``await store.append`` with one append in flight."""
    store = await TopicStore.open(wal_dir, fsync="always")
    out = []
    append = store.append
    try:
        for i in range(count + LATENCY_WARMUP):
            t = time.perf_counter()
            await append(TOPIC, Entry(PAYLOAD))
            if i >= LATENCY_WARMUP:
                out.append(time.perf_counter() - t)
    finally:
        await store.close()
    return out


async def store_big(wal_dir: Path, inflight: int) -> float:
    """MiB/s of 1 MiB appends with ``inflight`` tasks each awaiting its append."""
    store = await TopicStore.open(wal_dir, fsync="always")
    done = 0
    stop = False

    async def worker() -> None:
        nonlocal done
        while not stop:
            await store.append(TOPIC, Entry(BIG))
            done += 1

    workers = [asyncio.create_task(worker()) for _ in range(inflight)]
    res = await _timed_window(lambda: done, BIG_WARMUP, BIG_SECONDS, None)
    stop = True
    await asyncio.gather(*workers)
    await store.close()
    return res["rate"]


# -- references for the 1024-task figure ----------------------------------------------------

_Queued = tuple[bytearray, int, list["asyncio.Future[int]"]]


class PrototypeLog:
    """The issue's comparator: a minimal asyncio group-commit log, one future per append.

    ``append`` frames the payload into a loop-side bytearray and returns a new future; the first
    append of a loop iteration schedules one hand-off of the buffer and its futures to a writer
    thread. The writer joins everything queued, makes one ``os.write`` + ``os.fdatasync`` and
    completes the futures (with their offsets) through one ``call_soon_threadsafe``. Appends are
    durable in call order. No topics, index, cache, segments or back-pressure.
    """

    def __init__(self, path: Path) -> None:
        self._fd = _open_new(path)
        self._loop = asyncio.get_running_loop()
        self._queue: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._buf = bytearray()
        self._futs: list[asyncio.Future[int]] = []
        self._first = 0  # offset of self._futs[0]
        self._offset = 0
        self._scheduled = False
        self._writer = threading.Thread(target=self._run, name="prototype-writer")
        self._writer.start()

    def append(self, topic: str, entry: Entry) -> asyncio.Future[int]:
        payload = entry.payload
        fut = self._loop.create_future()
        self._buf += _HDR.pack(len(payload), crc32c(payload), self._offset)
        self._buf += payload
        self._offset += 1
        self._futs.append(fut)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._handoff)
        return fut

    def close(self) -> None:
        """Write what is queued, stop the writer, close the file (call once appends are done)."""
        self._queue.put(None)
        self._writer.join()
        os.close(self._fd)

    def _handoff(self) -> None:
        self._scheduled = False
        self._queue.put((self._buf, self._first, self._futs))
        self._buf, self._first, self._futs = bytearray(), self._offset, []

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batches = [item]
            while not self._queue.empty():
                more = self._queue.get()
                if more is None:
                    self._queue.put(None)
                    break
                batches.append(more)
            data = b"".join(buf for buf, _, _ in batches)
            error = None
            try:
                if os.write(self._fd, data) != len(data):
                    raise OSError(f"short write to the prototype log (fd {self._fd})")
                os.fdatasync(self._fd)
            except OSError as exc:
                error = exc
            self._loop.call_soon_threadsafe(self._complete, batches, error)

    @staticmethod
    def _complete(batches: list[_Queued], error: OSError | None) -> None:
        for _, first, futs in batches:
            for offset, fut in enumerate(futs, first):
                if error is None:
                    fut.set_result(offset)
                else:
                    fut.set_exception(error)


class LoopTicker:
    """No store, no I/O: each append awaits a shared future completed once per loop iteration.

    The first append of an iteration creates the future and schedules the callback that
    completes it, so all appends of one iteration form one batch: the cost of asyncio task
    switching alone.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fut: asyncio.Future[None] | None = None

    def append(self, topic: str, entry: Entry) -> asyncio.Future[None]:
        fut = self._fut
        if fut is None:
            fut = self._fut = self._loop.create_future()
            self._loop.call_soon(self._release, fut)
        return fut

    def _release(self, fut: asyncio.Future[None]) -> None:
        self._fut = None
        fut.set_result(None)


async def prototype_concurrent(log_path: Path) -> dict[str, float]:
    """The main figure's driver against ``PrototypeLog``."""
    log = PrototypeLog(log_path)
    try:
        res, _ = await drive_tasks(log.append, PROTOTYPE_SECONDS)
    finally:
        log.close()
    return res


async def asyncio_ceiling() -> dict[str, float]:
    """The main figure's driver against ``LoopTicker``."""
    res, _ = await drive_tasks(LoopTicker().append, CEILING_SECONDS)
    return res


def run_async(coro: Coroutine[Any, Any, Any], *, use_uvloop: bool = False) -> Any:
    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def in_dir(fn: Callable[[Path], Any]) -> Any:
    with bench_dir("wal-append") as d:
        return fn(d)


# -- main ------------------------------------------------------------------------------------


def main() -> None:
    # The daemon's process settings (danube-ingest broker applies them the same way).
    tune_gc()
    t_start = time.perf_counter()
    say(f"wal_append: {PAYLOAD_BYTES}-byte payloads, fsync=always, {os.cpu_count()} CPUs")
    say(f"  main: {TASKS} asyncio tasks x `await store.append`, {MAIN_SECONDS}s windows")
    say(f"  baseline: single-threaded frame+crc32c loop, {BATCH} msgs per write+fdatasync")
    load_start = warn_if_busy("start")

    base_runs: list[float] = []
    base_cpu_runs: list[float] = []
    raw_runs: list[float] = []
    main_runs: list[dict[str, float]] = []
    proto_runs: list[dict[str, float]] = []
    ceiling_runs: list[dict[str, float]] = []
    for i in range(REPEATS):
        base, base_cpu = in_dir(lambda d: baseline_group_commit(d / "base.log", SYNC_SECONDS))
        raw = in_dir(lambda d: raw_disk(d / "raw.log", SYNC_SECONDS))
        res = in_dir(lambda d: run_async(store_concurrent(d)))
        proto = in_dir(lambda d: run_async(prototype_concurrent(d / "proto.log")))
        ceiling = run_async(asyncio_ceiling())
        base_runs.append(base)
        base_cpu_runs.append(base_cpu)
        raw_runs.append(raw)
        main_runs.append(res)
        proto_runs.append(proto)
        ceiling_runs.append(ceiling)
        say(
            f"  round {i + 1}: baseline {base:,.0f} msg/s ({base_cpu:.2f} CPU-us/msg) | raw disk "
            f"{raw:,.0f} msg/s | store {res['rate']:,.0f} msg/s ({res['cpu_us_per_msg']:.2f} "
            f"CPU-us/msg, {res['msgs_per_fsync']:.0f} msgs/fdatasync, "
            f"{res['fsyncs_per_s']:,.0f} fdatasync/s) | prototype {proto['rate']:,.0f} msg/s "
            f"({proto['cpu_us_per_msg']:.2f} CPU-us/msg, {proto['msgs_per_fsync']:.0f} "
            f"msgs/fdatasync) | asyncio ceiling {ceiling['rate']:,.0f} awaits/s"
        )
    value = median([r["rate"] for r in main_runs])
    baseline = median(base_runs)
    raw_value = median(raw_runs)
    msgs_per_fsync = median([r["msgs_per_fsync"] for r in main_runs])
    fsyncs_per_s = median([r["fsyncs_per_s"] for r in main_runs])
    store_cpu = median([r["cpu_us_per_msg"] for r in main_runs])
    base_cpu = median(base_cpu_runs)
    say(
        f"main (median of {REPEATS}): store {value:,.0f} msg/s, baseline {baseline:,.0f} msg/s, "
        f"ratio {ratio(value, baseline):.3f} (goal >= {GOAL_MAIN}); raw disk {raw_value:,.0f} "
        f"msg/s, store/raw {ratio(value, raw_value):.3f}"
    )
    say(
        f"  CPU per message (all threads): store {store_cpu:.2f} us, baseline {base_cpu:.2f} us "
        f"-> baseline/store {ratio(base_cpu, store_cpu):.3f} (less sensitive to machine load)"
    )
    proto_value = median([r["rate"] for r in proto_runs])
    proto_cpu = median([r["cpu_us_per_msg"] for r in proto_runs])
    proto_per_fsync = median([r["msgs_per_fsync"] for r in proto_runs])
    ceiling_value = median([r["rate"] for r in ceiling_runs])
    ceiling_cpu = median([r["cpu_us_per_msg"] for r in ceiling_runs])
    say(
        f"references (median of {REPEATS}, same 1024 tasks): issue's asyncio prototype "
        f"{proto_value:,.0f} msg/s ({proto_cpu:.2f} CPU-us/msg, {proto_per_fsync:.0f} "
        f"msgs/fdatasync), ratio {ratio(proto_value, baseline):.3f}, store/prototype "
        f"{ratio(value, proto_value):.3f} | asyncio ceiling (no store, no I/O) "
        f"{ceiling_value:,.0f} awaits/s ({ceiling_cpu:.2f} CPU-us/await), ratio "
        f"{ratio(ceiling_value, baseline):.3f}"
    )

    uv: dict[str, float] | None = None
    try:
        import uvloop  # noqa: F401
    except ImportError:
        say("uvloop: not importable, skipped")
    else:
        uv = in_dir(lambda d: run_async(store_concurrent(d), use_uvloop=True))
        say(
            f"uvloop (1 run): store {uv['rate']:,.0f} msg/s ({uv['cpu_us_per_msg']:.2f} "
            f"CPU-us/msg), ratio {ratio(uv['rate'], baseline):.3f}"
        )

    batched: dict[int, dict[str, float]] = {}
    for callers in (1, 4):

        def batched_run(d: Path, c: int = callers) -> dict[str, float]:
            result: dict[str, float] = run_async(store_batched(d, c))
            return result

        res = in_dir(batched_run)
        batched[callers] = res
        say(
            f"append_batch x{BATCH}, {callers} caller(s): {res['rate']:,.0f} msg/s, ratio "
            f"{ratio(res['rate'], baseline):.3f} (goal >= {GOAL_BATCHED}), store/raw "
            f"{ratio(res['rate'], raw_value):.3f}, {res['msgs_per_fsync']:.0f} msgs/fdatasync, "
            f"{res['cpu_us_per_msg']:.2f} CPU-us/msg"
        )

    entry_us = entry_build_us()
    say(
        f"  building the entries alone ([Entry(payload) for _ in range({BATCH})]): "
        f"{entry_us:.3f} us/msg = {entry_us * baseline / 1e6:.2f} of the baseline's whole "
        f"time per message"
    )

    raw_lat: list[float] = []
    store_lat: list[float] = []
    for _ in range(LATENCY_ROUNDS):
        raw_lat += in_dir(lambda d: raw_sync_latencies(d / "lat.log", LATENCY_PER_ROUND))
        store_lat += in_dir(lambda d: run_async(store_latencies(d, LATENCY_PER_ROUND)))
    ms = 1000.0
    lat = {
        "latency_p50_ms": percentile(store_lat, 50) * ms,
        "latency_p99_ms": percentile(store_lat, 99) * ms,
        "latency_max_ms": max(store_lat) * ms,
        "raw_fsync_p50_ms": percentile(raw_lat, 50) * ms,
        "raw_fsync_p99_ms": percentile(raw_lat, 99) * ms,
        "raw_fsync_max_ms": max(raw_lat) * ms,
        "latency_samples": len(store_lat),
    }
    margin = lat["latency_p99_ms"] - lat["raw_fsync_p99_ms"]
    say(
        f"latency, 1 in flight ({len(store_lat)} appends): store p50 {lat['latency_p50_ms']:.3f} "
        f"ms p99 {lat['latency_p99_ms']:.3f} ms | raw write+fdatasync p50 "
        f"{lat['raw_fsync_p50_ms']:.3f} ms p99 {lat['raw_fsync_p99_ms']:.3f} ms | p99 margin "
        f"{margin:.3f} ms (goal <= {GOAL_LATENCY_MARGIN_MS})"
    )

    raw_big_runs = []
    raw_big4_runs = []
    big_seq_runs = []
    big_4_runs = []
    for _ in range(BIG_ROUNDS):
        raw_big_runs.append(in_dir(lambda d: raw_big(d / "big.log", BIG_SECONDS)))
        raw_big4_runs.append(in_dir(lambda d: raw_big4(d / "big4.log", BIG_SECONDS)))
        big_seq_runs.append(in_dir(lambda d: run_async(store_big(d, 1))))
        big_4_runs.append(in_dir(lambda d: run_async(store_big(d, 4))))
    big_raw = median(raw_big_runs)
    big_raw4 = median(raw_big4_runs)
    big_seq = median(big_seq_runs)
    big_4 = median(big_4_runs)
    say(
        f"1 MiB appends (median of {BIG_ROUNDS}): 1 in flight {big_seq:,.0f} MiB/s, 4 in flight "
        f"{big_4:,.0f} MiB/s | raw 1 MiB write+fdatasync {big_raw:,.0f} MiB/s | ratios "
        f"{ratio(big_seq, big_raw):.3f} / {ratio(big_4, big_raw):.3f} (goal >= {GOAL_BIG})"
    )
    say(
        f"  raw 4 MiB writev+fdatasync (the store's write with 4 in flight) {big_raw4:,.0f} MiB/s;"
        f" store 4 in flight / that {ratio(big_4, big_raw4):.3f}"
    )

    main_ratio = ratio(value, baseline)
    b1 = batched[1]["rate"]
    b4 = batched[4]["rate"]
    result: dict[str, Any] = {
        "benchmark": "wal_append",
        "value": value,
        "unit": "msg/s",
        "baseline": baseline,
        "ratio": main_ratio,
        "ratio_meaning": "value/baseline, higher is better (durable msg/s of 1024 asyncio tasks "
        "vs a minimal single-threaded Python group-commit loop)",
        "goal_ratio": GOAL_MAIN,
        "goal_met": main_ratio >= GOAL_MAIN,
        "payload_bytes": PAYLOAD_BYTES,
        "tasks": TASKS,
        "fsync": "always",
        "value_runs": [r["rate"] for r in main_runs],
        "baseline_runs": base_runs,
        "value_cpu_us_per_msg": store_cpu,
        "baseline_cpu_us_per_msg": base_cpu,
        "cpu_ratio": ratio(base_cpu, store_cpu),
        "cpu_ratio_meaning": "baseline CPU-us per msg / store CPU-us per msg (process CPU time, "
        "all threads), higher is better; robust to other load on the machine",
        "store_msgs_per_fdatasync": msgs_per_fsync,
        "store_fdatasyncs_per_s": fsyncs_per_s,
        "prototype_value": proto_value,
        "prototype_ratio": ratio(proto_value, baseline),
        "prototype_cpu_us_per_msg": proto_cpu,
        "prototype_msgs_per_fdatasync": proto_per_fsync,
        "prototype_runs": [r["rate"] for r in proto_runs],
        "store_vs_prototype": ratio(value, proto_value),
        "prototype_meaning": "the issue's comparator driven by the same 1024 tasks: a minimal "
        "asyncio group-commit log with one future per append, a writer thread doing one "
        "os.write + os.fdatasync per batch and one call_soon_threadsafe per batch; "
        "store_vs_prototype = value / prototype_value",
        "asyncio_ceiling_value": ceiling_value,
        "asyncio_ceiling_ratio": ratio(ceiling_value, baseline),
        "asyncio_ceiling_cpu_us_per_msg": ceiling_cpu,
        "asyncio_ceiling_runs": [r["rate"] for r in ceiling_runs],
        "asyncio_ceiling_meaning": "awaits/s of the same 1024 tasks with no store and no I/O, "
        "each awaiting a shared future completed once per loop iteration; ratio vs baseline",
        "uvloop_value": uv["rate"] if uv else None,
        "uvloop_ratio": ratio(uv["rate"], baseline) if uv else None,
        "uvloop_cpu_us_per_msg": uv["cpu_us_per_msg"] if uv else None,
        "batched_1_value": b1,
        "batched_1_ratio": ratio(b1, baseline),
        "batched_1_cpu_us_per_msg": batched[1]["cpu_us_per_msg"],
        "batched_4_value": b4,
        "batched_4_ratio": ratio(b4, baseline),
        "batched_4_cpu_us_per_msg": batched[4]["cpu_us_per_msg"],
        "batched_goal_ratio": GOAL_BATCHED,
        "batched_goal_met": min(b1, b4) / baseline >= GOAL_BATCHED,
        "entry_build_us_per_msg": entry_us,
        "entry_build_share_of_baseline": entry_us * baseline / 1e6,
        "entry_build_meaning": "us per message to build append_batch's Entry objects in the "
        "caller (part of the batched figures); share = that / the baseline's us per message",
        "raw_disk_value": raw_value,
        "raw_disk_runs": raw_runs,
        "raw_disk_ratio": ratio(value, raw_value),
        "raw_disk_batched_1_ratio": ratio(b1, raw_value),
        "raw_disk_batched_4_ratio": ratio(b4, raw_value),
        "raw_disk_baseline_ratio": ratio(baseline, raw_value),
        "raw_disk_ratio_meaning": "store (or baseline) msg/s / raw write+fdatasync msg/s of the "
        "same pre-framed 1024-message batches",
        **lat,
        "latency_p99_margin_ms": margin,
        "latency_goal_margin_ms": GOAL_LATENCY_MARGIN_MS,
        "latency_goal_met": margin <= GOAL_LATENCY_MARGIN_MS,
        "mib1_seq_mib_s": big_seq,
        "mib1_4inflight_mib_s": big_4,
        "mib1_raw_mib_s": big_raw,
        "mib1_seq_ratio": ratio(big_seq, big_raw),
        "mib1_4inflight_ratio": ratio(big_4, big_raw),
        "mib1_goal_ratio": GOAL_BIG,
        "mib1_goal_met": min(big_seq, big_4) / big_raw >= GOAL_BIG,
        "mib1_raw_runs": raw_big_runs,
        "mib1_raw4_mib_s": big_raw4,
        "mib1_raw4_runs": raw_big4_runs,
        "mib1_4inflight_vs_raw4": ratio(big_4, big_raw4),
        "mib1_raw4_meaning": "raw 4 MiB writev (4 x 1 MiB) + fdatasync: the write the store makes "
        "with 4 appends in flight; mib1_4inflight_vs_raw4 = store 4-in-flight MiB/s / that",
        "mib1_seq_runs": big_seq_runs,
        "mib1_4inflight_runs": big_4_runs,
        "elapsed_s": time.perf_counter() - t_start,
        "load_start": load_start,
        "load_end": warn_if_busy("end"),
        **machine(),
    }
    emit(result)


if __name__ == "__main__":
    main()
