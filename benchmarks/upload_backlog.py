"""Live publish latency while the uploader catches up a WAL backlog, bandwidth limit off vs on.

Run: ``.venv/bin/python benchmarks/upload_backlog.py`` (no arguments, ~5 min on 2 cores).

Setup: a real local etcd and the real broker in a child process (``BrokerChild`` of
``publish_danube_client.py``: the daemon's defaults, ``storage.mode: wal_cloud`` with the
default fs object store under its data dir, ``fsync: always``, 8 MiB segments, upload
concurrency 4), danube-client 0.5 in this process, everything on loopback. Each window uses a
fresh broker (own id, data dir and etcd prefix) and starts with an object store outage: the fs
store's root is replaced by a file, so every upload fails and is retried (every <= 0.5 s).

- ``catchup_off`` / ``catchup_on``: during the outage a danube-client producer publishes a
  ``BACKLOG_MIB`` backlog of incompressible 256 KiB messages to one topic; it sits in the WAL,
  not uploaded. ``OUTAGE_END`` s into the measured window the store comes back and the
  uploader catches up, without (``off``) or with (``on``: ``LIMIT_MIB`` MiB/s)
  ``storage.uploader.max_bytes_per_second``.
- ``baseline``: the same outage and window with no backlog (nothing to catch up).

Measured in each window (``ROUND_SECONDS`` s after a ``WARMUP``): a second producer publishes
``RATE`` msg/s of ``PAYLOAD_BYTES``-byte messages to another reliable topic, paced open loop
(one ``send`` task started every 1/RATE s, as in ``e2e_latency.py``); publish latency =
``send`` -> response (the durable ack). Also the broker's CPU share and WAL fdatasyncs over the
window, and the catch-up: bytes that appeared in the store (polled every 0.1 s, staging files
included) over the time from the first to the last growth (``catchup_mib_s``), and whether it
finished inside the window.

Rounds: ``ROUNDS``; each runs the three windows, their order rotated every round. Figures are
medians over rounds of each window's p50/p99. Main figure (``value``): publish p99 during a
catch-up with the limit on; ``baseline``: publish p99 with no catch-up in the same run;
``ratio`` = on / baseline (lower is better, 1.0: a catch-up costs live publishes nothing).
``ratio_off`` is the same for the catch-up without a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from _common import MIB, bench_dir, emit, machine, median, percentile, ratio, say, warn_if_busy
from e2e_latency import paced
from publish_danube_client import BrokerChild, close_client, open_client, proc_cpu

BACKLOG_MIB = 256
BACKLOG_PAYLOAD = 256 * 1024
BACKLOG_IN_FLIGHT = 8
LIMIT_MIB = 20
RATE = 500
PAYLOAD_BYTES = 1024
ROUNDS = 3
ROUND_SECONDS = 20.0
WARMUP = 1.0
MAX_IN_FLIGHT = 2000
#: Seconds into the measured window at which the object store comes back.
OUTAGE_END = 2.0
MODES = ("baseline", "catchup_off", "catchup_on")
LIVE_TOPIC = "/default/live"
BACKLOG_TOPIC = "/default/backlog"


def broker_yaml(prefix: str, *, limit_mib: int | None) -> str:
    limit = "null" if limit_mib is None else f"{limit_mib}MiB"
    return f"""\
etcd:
  prefix: {prefix}
storage:
  mode: wal_cloud
  wal:
    fsync: always
  uploader:
    max_bytes_per_second: {limit}
    # The store fails at once during the outage and the uploader retries every <= 0.5 s, so
    # the catch-up starts within half a second of the store's return.
    max_retries: 0
    retry_base_ms: 100
    retry_max_ms: 500
"""


class ObjectWatch:
    """Polls the total size of the fs store's ``segments/`` every 0.1 s in a thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _size(self) -> int:
        total = 0
        for directory, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(OSError):  # renamed or removed meanwhile
                    total += os.path.getsize(os.path.join(directory, name))
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._size()))
            self._stop.wait(0.1)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), self._size()))
        grown = [
            t
            for (t, size), (_, before) in zip(self.samples[1:], self.samples, strict=False)
            if size > before
        ]
        total = self.samples[-1][1]
        if not grown or total == 0:
            return {"bytes": total, "seconds": float("nan"), "mib_s": float("nan")}
        # The first growth happened within one poll before it was seen.
        seconds = grown[-1] - grown[0] + 0.1
        return {
            "bytes": total,
            "seconds": seconds,
            "mib_s": total / MIB / seconds,
        }


async def publish_backlog(url: str) -> float:
    """Publish ``BACKLOG_MIB`` MiB of incompressible messages; seconds taken."""
    from danube import DispatchStrategy

    client = await open_client(url)
    producer = (
        client.new_producer()
        .with_topic(BACKLOG_TOPIC)
        .with_name("bench-backlog")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .build()
    )
    await producer.create()
    count = BACKLOG_MIB * MIB // BACKLOG_PAYLOAD
    payloads = [os.urandom(BACKLOG_PAYLOAD) for _ in range(16)]
    started = time.perf_counter()
    sem = asyncio.Semaphore(BACKLOG_IN_FLIGHT)

    async def send(i: int) -> None:
        async with sem:
            # Fresh bytes per message: a repeated payload would compress in the objects.
            await producer.send(os.urandom(64) + payloads[i % 16][64:])

    await asyncio.gather(*(send(i) for i in range(count)))
    took = time.perf_counter() - started
    await close_client(client, [producer])
    return took


async def live_window(broker: BrokerChild, objects: Path) -> dict[str, Any]:
    """``RATE`` msg/s to the live topic for ``ROUND_SECONDS``; publish latencies (ms). The
    object store's outage ends ``OUTAGE_END`` s into the window."""
    from danube import DispatchStrategy

    client = await open_client(broker.url)
    producer = (
        client.new_producer()
        .with_topic(LIVE_TOPIC)
        .with_name("bench-live")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .build()
    )
    await producer.create()
    latencies: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    state = {"in_flight": 0, "skipped": 0, "errors": 0, "measure": False}
    payload = os.urandom(PAYLOAD_BYTES)

    async def send() -> None:
        state["in_flight"] += 1
        measure = state["measure"]
        t = time.perf_counter_ns()
        try:
            await producer.send(payload)
        except Exception:
            state["errors"] += 1
            return
        finally:
            state["in_flight"] -= 1
        if measure:
            latencies.append((time.perf_counter_ns() - t) / 1e6)

    def fire() -> None:
        if state["in_flight"] >= MAX_IN_FLIGHT:
            state["skipped"] += 1
            return
        task = asyncio.create_task(send())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await paced(RATE, WARMUP, fire)
    state["measure"] = True
    asyncio.get_running_loop().call_later(OUTAGE_END, end_outage, objects)
    cpu0, t0, f0 = proc_cpu(broker.pid), time.perf_counter(), broker.fdatasync_stats()
    lag = await paced(RATE, ROUND_SECONDS, fire)
    cpu = (proc_cpu(broker.pid) - cpu0) / (time.perf_counter() - t0)
    f1 = broker.fdatasync_stats()
    if tasks:
        await asyncio.wait(tasks, timeout=10)
    await close_client(client, [producer])
    return {
        "latencies": latencies,
        "broker_cpu": cpu,
        "lag_p99_ms": lag["lag_p99_ms"],
        "fdatasyncs": f1[0] - f0[0],
        "fdatasync_mean_ms": (f1[1] - f0[1]) / max(1, f1[0] - f0[0]) * 1e3,
        "fdatasyncs_over_10ms": f1[2] - f0[2],
        "skipped": state["skipped"],
        "errors": state["errors"],
    }


def start_outage(objects: Path) -> None:
    """The fs store's root becomes a file: every upload fails (and is retried)."""
    shutil.rmtree(objects, ignore_errors=True)
    objects.write_bytes(b"")


def end_outage(objects: Path) -> None:
    objects.unlink()
    objects.mkdir()


def run_window(work: Path, etcd: str, mode: str, rnd: int) -> dict[str, Any]:
    name = f"up-{mode.replace('_', '-')}-{rnd}"
    limit = LIMIT_MIB if mode == "catchup_on" else None
    config = broker_yaml(f"/bench-upload-{name}", limit_mib=limit)
    broker = BrokerChild(work, etcd, broker_id=name, config_yaml=config)
    objects = broker.data_dir / "objects"
    backlog = mode != "baseline"
    out: dict[str, Any] = {"mode": mode, "round": rnd}
    try:
        broker.start()
        start_outage(objects)
        if backlog:
            out["backlog_publish_s"] = asyncio.run(publish_backlog(broker.url))
            wal = broker.data_dir / "wal"
            out["wal_bytes"] = sum(p.stat().st_size for p in wal.rglob("*") if p.is_file())
        watch = ObjectWatch(objects)
        watch.start()
        live = asyncio.run(live_window(broker, objects))
        catchup = watch.stop()
    finally:
        broker.stop()
        shutil.rmtree(broker.data_dir, ignore_errors=True)
    lat = live.pop("latencies")
    out.update(live)
    out["p50_ms"] = percentile(lat, 50)
    out["p99_ms"] = percentile(lat, 99)
    out["max_ms"] = max(lat, default=float("nan"))
    out["samples"] = len(lat)
    out["catchup_bytes"] = catchup["bytes"]
    out["catchup_mib_s"] = catchup["mib_s"] if backlog else float("nan")
    out["catchup_s"] = catchup["seconds"] if backlog else float("nan")
    # Objects hold the WAL's frames plus their own framing: done once they hold as much.
    out["catchup_done_in_window"] = bool(backlog and catchup["bytes"] >= out["wal_bytes"])
    return out


def main() -> None:
    t_start = time.perf_counter()
    say(
        f"upload_backlog: live publishes at {RATE} msg/s ({PAYLOAD_BYTES} B) while the uploader "
        f"catches up a {BACKLOG_MIB} MiB WAL backlog to an fs store; limit off vs "
        f"{LIMIT_MIB} MiB/s vs no backlog; {ROUNDS} rounds x 3 windows of {ROUND_SECONDS}s, "
        f"{os.cpu_count()} CPUs"
    )
    load_start = warn_if_busy("start")
    from danube_ingest.testing import LocalEtcd

    windows: list[dict[str, Any]] = []
    with bench_dir("upload") as work, LocalEtcd() as etcd:
        for rnd in range(ROUNDS):
            order = MODES[rnd % 3 :] + MODES[: rnd % 3]
            for mode in order:
                w = run_window(work, etcd.endpoint, mode, rnd)
                windows.append(w)
                extra = ""
                if mode != "baseline":
                    extra = (
                        f"; backlog {w['wal_bytes'] / MIB:.0f} MiB WAL published in "
                        f"{w['backlog_publish_s']:.1f}s; catch-up {w['catchup_bytes'] / MIB:.0f} "
                        f"MiB at {w['catchup_mib_s']:.1f} MiB/s over {w['catchup_s']:.1f}s"
                        f"{'' if w['catchup_done_in_window'] else ' (NOT finished in window)'}"
                    )
                say(
                    f"  round {rnd + 1} {mode}: publish p50 {w['p50_ms']:.2f} ms p99 "
                    f"{w['p99_ms']:.2f} ms max {w['max_ms']:.1f} ms ({w['samples']} msgs, "
                    f"{w['errors']} errors, {w['skipped']} skipped); broker CPU share "
                    f"{w['broker_cpu']:.2f}; pacing lag p99 {w['lag_p99_ms']:.2f} ms; WAL "
                    f"fdatasync mean "
                    f"{w['fdatasync_mean_ms']:.2f} ms, {w['fdatasyncs_over_10ms']} >= 10 ms{extra}"
                )

    def med(mode: str, key: str) -> float:
        return median([w[key] for w in windows if w["mode"] == mode])

    figures = {
        mode: {
            key: med(mode, key)
            for key in ("p50_ms", "p99_ms", "max_ms", "broker_cpu", "catchup_mib_s", "catchup_s")
        }
        for mode in MODES
    }
    for mode in MODES:
        f = figures[mode]
        say(
            f"{mode} (median of {ROUNDS}): publish p50 {f['p50_ms']:.2f} ms, p99 "
            f"{f['p99_ms']:.2f} ms, max {f['max_ms']:.1f} ms; broker CPU share "
            f"{f['broker_cpu']:.2f}"
            + (
                f"; catch-up {f['catchup_mib_s']:.1f} MiB/s ({f['catchup_s']:.1f}s)"
                if mode != "baseline"
                else ""
            )
        )
    base_p99 = figures["baseline"]["p99_ms"]
    on_p99 = figures["catchup_on"]["p99_ms"]
    off_p99 = figures["catchup_off"]["p99_ms"]
    say(
        f"ratio p99 catch-up / no catch-up: limit on {ratio(on_p99, base_p99):.2f}, "
        f"limit off {ratio(off_p99, base_p99):.2f}"
    )
    emit(
        {
            "benchmark": "upload_backlog",
            "value": on_p99,
            "unit": "ms",
            "baseline": base_p99,
            "ratio": ratio(on_p99, base_p99),
            "ratio_meaning": f"live publish p99 during a {BACKLOG_MIB} MiB upload catch-up with "
            f"max_bytes_per_second {LIMIT_MIB} MiB/s / live publish p99 with nothing to upload, "
            "same run (lower is better)",
            "ratio_off": ratio(off_p99, base_p99),
            "limit_mib_s": LIMIT_MIB,
            "backlog_mib": BACKLOG_MIB,
            "rate_msg_s": RATE,
            "payload_bytes": PAYLOAD_BYTES,
            "round_seconds": ROUND_SECONDS,
            "rounds": ROUNDS,
            "figures": figures,
            "windows": windows,
            "elapsed_s": time.perf_counter() - t_start,
            "load_start": load_start,
            "load_end": warn_if_busy("end"),
            **machine(),
        }
    )


if __name__ == "__main__":
    main()
