"""Publish → delivery latency through the batch path at a paced 100k msg/s (issue 14: p99 ≤ 10 ms).

Run: ``flock /tmp/danube-bench.lock .venv/bin/python benchmarks/batch_latency.py [RATE]``
(~30 s; RATE in msg/s, default 100,000; ``--publish-only``: no consumer, the figures are then
the durable answer latency of each batch's oldest message).

The real broker in a child process (``BrokerChild`` of ``publish_danube_client.py``: the
daemon's default storage, ``wal.fsync: always``) on a local etcd, loopback gRPC. In this
process (uvloop): one ``Producer`` publishing ``RATE`` msg/s of 100-byte payloads, paced: every
``TICK_MS`` ms the messages due since the last tick are handed over with ``send_many`` (one
batch per tick); one Exclusive ``Consumer`` (batch receive, range acks) on the same topic. Each
payload carries the time its message was *due* (``perf_counter_ns``; same process, same
clock), so a publisher falling behind shows as latency instead of hiding it (no coordinated
omission). Latency = receive time of the batch holding the message - its due time: the
durable publish (write + fdatasync), dispatch and delivery. ``durable_*``: the publish side
alone, due time of a batch's oldest message → the producer's future resolving (the daemon's
answer after fdatasync).

``ROUNDS`` interleaved windows of ``SECONDS`` s after a ``WARMUP`` s warm-up; per window
p50 / p99 / p99.9 and the achieved publish and delivery rates; the JSON line has the medians
over windows and the percentiles of all windows pooled. CPU seconds of the broker and of this
process per million messages, and CPU pressure (PSI) before and after.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np
from _common import bench_dir, cpu_pressure, emit, machine, median, say, warn_if_busy
from publish_danube_client import BrokerChild, proc_cpu

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
RATE = int(ARGS[0]) if ARGS else 100_000
#: ``--publish-only``: no consumer; only the durable answer latency (the publish side alone).
PUBLISH_ONLY = "--publish-only" in sys.argv
MEASURED = "publish->durable answer" if PUBLISH_ONLY else "publish->delivery"
TICK_MS = 1.0
PAYLOAD_SIZE = 100
WARMUP = 2.0
ROUNDS = 5
SECONDS = 3.0
TOPIC = "/default/batch-latency"


async def window(
    producer: Any, consumer: Any, seconds: float, lat: list[float], acks: list[float]
) -> tuple[float, float]:
    """Publish paced for ``seconds``, collect latencies (ms) of everything published then
    into ``lat``, and each batch's due → durable answer time (ms, its oldest message) into
    ``acks``; returns (published msg/s, delivered msg/s)."""
    pad = bytes(PAYLOAD_SIZE - 8)
    tick = TICK_MS / 1000.0
    start_ns = time.perf_counter_ns()
    total = int(RATE * seconds)
    sent = 0
    received = 0
    futures: list[asyncio.Future[list[range]]] = []

    async def publish() -> None:
        nonlocal sent
        step_ns = 1e9 / RATE
        next_tick = time.perf_counter()
        while sent < total:
            now_ns = time.perf_counter_ns()
            due = min(total, int((now_ns - start_ns) / step_ns) + 1)
            if due > sent:
                payloads = [
                    int(start_ns + i * step_ns).to_bytes(8, "little") + pad
                    for i in range(sent, due)
                ]
                future = await producer.send_many(payloads)
                first_due = start_ns + sent * step_ns
                future.add_done_callback(
                    lambda _, d=first_due: acks.append((time.perf_counter_ns() - d) / 1e6)
                )
                futures.append(future)
                sent = due
            next_tick += tick
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
        await producer.flush()

    async def consume() -> None:
        nonlocal received
        while consumer is not None and received < total:
            batch = await consumer.receive(timeout=30.0)
            now = time.perf_counter_ns()
            due = np.frombuffer(b"".join(e.payload[:8] for e in batch.entries), dtype="<i8").astype(
                np.float64
            )
            lat.extend(((now - due) / 1e6).tolist())
            received += len(batch.entries)
            consumer.ack(batch)

    t0 = time.perf_counter()
    await asyncio.gather(publish(), consume())
    elapsed = time.perf_counter() - t0
    for future in futures:
        future.result()  # (every batch durable, none refused)
    if consumer is None:
        lat.extend(acks)
        received = sent
    return sent / seconds, received / elapsed


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.asarray(values), p)) if values else float("nan")


async def run() -> None:
    from danube_ingest.client import Consumer, Producer
    from danube_ingest.testing import LocalEtcd

    pressure_before = cpu_pressure()
    warn_if_busy("start")
    rounds: list[dict[str, float]] = []
    pooled: list[float] = []
    with bench_dir("batch-latency") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        broker.start()
        try:
            async with Producer(
                broker.url, TOPIC, max_batch_messages=10_000, max_in_flight=64, max_buffered=RATE
            ) as producer:
                await (await producer.send_many([bytes(PAYLOAD_SIZE)]))  # (creates the topic)
                consumer = None
                if not PUBLISH_ONLY:
                    consumer = Consumer(broker.url, TOPIC, "latency", start="latest")
                    await consumer.start()
                await window(producer, consumer, WARMUP, [], [])
                for round_no in range(ROUNDS):
                    lat: list[float] = []
                    acks: list[float] = []
                    broker0, self0 = proc_cpu(broker.pid), time.process_time()
                    published, delivered = await window(producer, consumer, SECONDS, lat, acks)
                    n = published * SECONDS  # (messages)
                    figures = {
                        "published_per_s": published,
                        "delivered_per_s": delivered,
                        "p50_ms": pct(lat, 50),
                        "p99_ms": pct(lat, 99),
                        "p999_ms": pct(lat, 99.9),
                        "max_ms": max(lat),
                        "durable_p50_ms": pct(acks, 50),
                        "durable_p99_ms": pct(acks, 99),
                        "durable_p999_ms": pct(acks, 99.9),
                        "broker_cpu_s_per_1m": (proc_cpu(broker.pid) - broker0) / n * 1e6,
                        "client_cpu_s_per_1m": (time.process_time() - self0) / n * 1e6,
                        "cpu_pressure": cpu_pressure() or 0.0,
                    }
                    rounds.append(figures)
                    pooled.extend(lat)
                    say(
                        f"round {round_no + 1}/{ROUNDS}: {published:,.0f} msg/s published, "
                        f"{delivered:,.0f} delivered; p50 {figures['p50_ms']:.2f} ms, p99 "
                        f"{figures['p99_ms']:.2f} ms, p99.9 {figures['p999_ms']:.2f} ms, max "
                        f"{figures['max_ms']:.1f} ms; durable answer p50 "
                        f"{figures['durable_p50_ms']:.2f} ms, p99 {figures['durable_p99_ms']:.2f} "
                        f"ms; CPU s per 1M msgs broker "
                        f"{figures['broker_cpu_s_per_1m']:.2f}, client "
                        f"{figures['client_cpu_s_per_1m']:.2f}; pressure "
                        f"{figures['cpu_pressure']}%"
                    )
                if consumer is not None:
                    await consumer.close()
        finally:
            calls, sync_s, slow = broker.fdatasync_stats()
            broker.stop()
    p99 = median([r["p99_ms"] for r in rounds])
    emit(
        {
            "benchmark": "batch_latency",
            "value": p99,
            "unit": "ms",
            "baseline": 10.0,
            "ratio": p99 / 10.0,
            "ratio_meaning": (
                f"median over windows of p99 {MEASURED} "
                f"latency through the batch path at {RATE:,} msg/s / the 10 ms goal (<= 1 meets it)"
            ),
            **{f"median_{k}": median([r[k] for r in rounds]) for k in rounds[0]},
            "pooled_p50_ms": pct(pooled, 50),
            "pooled_p99_ms": pct(pooled, 99),
            "pooled_p999_ms": pct(pooled, 99.9),
            "rounds_p99_ms": [r["p99_ms"] for r in rounds],
            "fdatasync_calls": calls,
            "fdatasync_s": sync_s,
            "fdatasync_over_10ms": slow,
            "rate": RATE,
            "publish_only": PUBLISH_ONLY,
            "tick_ms": TICK_MS,
            "rounds": ROUNDS,
            "seconds": SECONDS,
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": cpu_pressure(),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    import uvloop

    uvloop.run(run())
