"""Fairness: per-message producers' publish latency while a batch producer saturates the broker.

Run: ``flock /tmp/danube-bench.lock .venv/bin/python benchmarks/fairness.py`` (~70 s).

The real broker in a child process (``BrokerChild`` of ``publish_danube_client.py``: the
daemon's WAL with ``fsync: always``) on a local etcd, loopback gRPC. In this process (uvloop):
``SMALL_PRODUCERS`` danube-client producers, each publishing one ``PAYLOAD_SIZE``-byte message
every ``1 / SMALL_RATE`` s on its own topic, one send in flight; a latency is one ``send`` call
(call to durable answer), as an application sees it. A slot missed while a send was in flight
is skipped, not caught up (so one stall does not snowball into every later send: the
figures are per call, and a stalled producer shows as fewer ``sends``).
In a second child process: one ``danube_ingest.client.Producer`` publishing ``BULK_BATCH``
messages of ``BULK_PAYLOAD`` bytes per ``send_many`` as fast as the broker takes them (64
batches in flight), on a topic of its own.

``ROUNDS`` interleaved pairs of windows of ``SECONDS`` s: *idle* (the batch child is stopped
with SIGSTOP, and its in-flight batches drained for ``SETTLE`` s first) and *loaded* (SIGCONT).
Per window: the per-message publish latency p50/p99, the batch producer's acknowledged MB/s,
the broker's CPU seconds. The JSON line's ``value`` is the median over rounds of the loaded p99
/ the idle p99 (the goal: at most 3).
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import bench_dir, cpu_pressure, emit, machine, median, percentile, say, warn_if_busy
from publish_danube_client import BrokerChild, proc_cpu

SMALL_PRODUCERS = 4
SMALL_RATE = 50.0
PAYLOAD_SIZE = 100
BULK_BATCH = 1000
BULK_PAYLOAD = 1024
WARMUP = 3.0
SETTLE = 1.0
ROUNDS = 4
SECONDS = 6.0
GOAL = 3.0

#: The batch producer child: publishes until killed, writing its acknowledged message count
#: (8 bytes, little-endian) to the file named by argv[2] after every batch.
_BULK = """
import asyncio, struct, sys
from danube_ingest.client import Producer

async def main() -> None:
    url, counter = sys.argv[1], sys.argv[2]
    payloads = [bytes({size}) for _ in range({batch})]
    done = 0
    with open(counter, "r+b", buffering=0) as out:
        async with Producer(url, "/default/fair-bulk", max_batch_messages={batch},
                            max_in_flight=64, max_buffered={batch} * 64) as producer:
            print("bulk ready", flush=True)
            pending = []
            while True:
                pending.append(await producer.send_many(payloads))
                while len(pending) > 32:
                    await pending.pop(0)
                    done += {batch}
                    out.seek(0)
                    out.write(struct.pack("<Q", done))

asyncio.run(main())
"""


class Bulk:
    """The batch producer child, stopped and continued with SIGSTOP / SIGCONT."""

    def __init__(self, work: Path, url: str) -> None:
        self.counter = work / "bulk-count.bin"
        self.counter.write_bytes(bytes(8))
        self.log = work / "bulk.log"
        script = _BULK.format(size=BULK_PAYLOAD, batch=BULK_BATCH)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", script, url, str(self.counter)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent,
            )
        deadline = time.monotonic() + 60
        while "bulk ready" not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"batch producer failed:\n{self.log.read_text()}")
            time.sleep(0.05)

    def count(self) -> int:
        return int(struct.unpack("<Q", self.counter.read_bytes()[:8])[0])

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.process.kill()
        self.process.wait()
        if "Traceback" in self.log.read_text(errors="replace"):
            say(f"batch producer log:\n{self.log.read_text()[-2000:]}")


async def small_window(producers: list[Any], seconds: float) -> list[float]:
    """Latencies (ms, each ``send`` call) of the paced per-message sends."""
    latencies: list[float] = []
    payload = bytes(PAYLOAD_SIZE)
    step = 1.0 / SMALL_RATE

    async def run(producer: Any, phase: float) -> None:
        start = time.perf_counter() + phase
        n = 0
        while True:
            due = start + n * step
            if due - start >= seconds:
                return
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            began = time.perf_counter()
            await producer.send(payload)
            done = time.perf_counter()
            latencies.append((done - began) * 1000)
            n = max(n + 1, int((done - start) / step) + 1)  # (missed slots skipped)

    await asyncio.gather(*(run(p, i * step / len(producers)) for i, p in enumerate(producers)))
    return latencies


async def window(producers: list[Any], broker: BrokerChild, bulk: Bulk) -> dict[str, float]:
    """One window of paced per-message sends: their latency, the batch producer's rate, CPU."""
    bulk0, cpu0, self0 = bulk.count(), proc_cpu(broker.pid), time.process_time()
    t0 = time.perf_counter()
    lat = await small_window(producers, SECONDS)
    wall = time.perf_counter() - t0
    bulk_msgs = bulk.count() - bulk0
    return {
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat),
        "sends": len(lat),
        "bulk_mb_per_s": bulk_msgs * BULK_PAYLOAD / wall / 1e6,
        "bulk_msgs_per_s": bulk_msgs / wall,
        "broker_cpu_share": (proc_cpu(broker.pid) - cpu0) / wall,
        "client_cpu_share": (time.process_time() - self0) / wall,
    }


def _line(name: str, rnd: int, w: dict[str, float]) -> str:
    return (
        f"round {rnd}/{ROUNDS} {name:6}: per-message p50 {w['p50_ms']:.1f} ms, p99 "
        f"{w['p99_ms']:.1f} ms, max {w['max_ms']:.1f} ms ({w['sends']:.0f} sends); batch "
        f"{w['bulk_mb_per_s']:.1f} MB/s; broker CPU {w['broker_cpu_share']:.2f}, client "
        f"{w['client_cpu_share']:.2f}"
    )


async def run() -> None:
    from danube import DispatchStrategy
    from publish_danube_client import close_client, open_client

    from danube_ingest.testing import LocalEtcd

    pressure_before = cpu_pressure()
    warn_if_busy("start")
    idle: list[dict[str, float]] = []
    loaded: list[dict[str, float]] = []
    with bench_dir("fairness") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        broker.start()
        bulk = None
        client = await open_client(broker.url)
        producers: list[Any] = []
        try:
            for i in range(SMALL_PRODUCERS):
                producer = (
                    client.new_producer()
                    .with_topic(f"/default/fair-small-{i}")
                    .with_name(f"small-{i}")
                    .with_dispatch_strategy(DispatchStrategy.RELIABLE)
                    .build()
                )
                await producer.create()
                producers.append(producer)
            bulk = Bulk(work, broker.url)
            await small_window(producers, WARMUP)
            for rnd in range(1, ROUNDS + 1):
                bulk.pause()
                await asyncio.sleep(SETTLE)
                idle.append(await window(producers, broker, bulk))
                say(_line("idle", rnd, idle[-1]))
                bulk.resume()
                await asyncio.sleep(SETTLE)
                loaded.append(await window(producers, broker, bulk))
                say(_line("loaded", rnd, loaded[-1]))
        finally:
            if bulk is not None:
                bulk.stop()
            await close_client(client, producers)
            calls, sync_s, slow = broker.fdatasync_stats()
            broker.stop()
    ratios = [lo["p99_ms"] / i["p99_ms"] for i, lo in zip(idle, loaded, strict=True)]
    ratio = median(ratios)
    say(
        f"per-message p99: idle {median([w['p99_ms'] for w in idle]):.1f} ms, loaded "
        f"{median([w['p99_ms'] for w in loaded]):.1f} ms (median over rounds); loaded / idle "
        f"{ratio:.2f} (goal <= {GOAL:g}); batch producer "
        f"{median([w['bulk_mb_per_s'] for w in loaded]):.1f} MB/s"
    )
    emit(
        {
            "benchmark": "fairness",
            "value": ratio,
            "unit": "x",
            "baseline": GOAL,
            "ratio": ratio / GOAL,
            "ratio_meaning": (
                "median over rounds of (per-message p99 publish latency while a batch producer "
                "saturates the broker / the same p99 idle) / the 3x goal (<= 1 meets it)"
            ),
            **{f"idle_median_{k}": median([w[k] for w in idle]) for k in idle[0]},
            **{f"loaded_median_{k}": median([w[k] for w in loaded]) for k in loaded[0]},
            "rounds_ratio": ratios,
            "fdatasync_calls": calls,
            "fdatasync_s": sync_s,
            "fdatasync_over_10ms": slow,
            "small_producers": SMALL_PRODUCERS,
            "small_rate_each": SMALL_RATE,
            "bulk_batch": BULK_BATCH,
            "bulk_payload": BULK_PAYLOAD,
            "rounds": ROUNDS,
            "seconds": SECONDS,
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": cpu_pressure(),
            "machine": machine(),
        }
    )


def main() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run())


if __name__ == "__main__":
    main()
