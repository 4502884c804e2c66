"""The benchmark runner: publish throughput and latency against batch size and concurrency, for
our batch client, danube-client and Redis Streams, written into docs/benchmarks.md and plots.

Run: ``.venv/bin/python benchmarks/run_all.py`` (~1-3 min on 2 cores; ``--quick``: a few
seconds of work, for the test). Options: ``--rounds N``, ``--doc PATH`` (the Markdown file whose
generated section is replaced; default docs/benchmarks.md), ``--img-dir DIR`` (default
docs/img).

Setup, all on loopback in temporary directories: a local etcd and the real broker in a child
process (``BrokerChild`` of ``publish_danube_client.py``: the daemon's defaults, ``wal.fsync:
always``), and redis-server 7 started the way the issue and DEPENDENCIES.md say
(``--appendonly yes --appendfsync always --save ""``: the AOF fsynced before each reply,
group-committed per event-loop turn, the same promise as our ``fsync: always``). Clients run in
this process, on one asyncio loop:

* ``ingest``: ``danube_ingest.client.Producer`` — ``concurrency`` producers on one topic, each
  with batches of ``batch`` messages and 8 in flight (``danube_ingest.cli.bench.publish_ingest``,
  what ``danube-ingest bench`` runs);
* ``danube``: danube-client, one producer, ``concurrency`` tasks each awaiting one send
  (batch 1 by construction; a small sweep: it is slow);
* ``redis``: redis-py (``redis.asyncio``), ``concurrency`` clients each sending pipelines
  (``transaction=False``) of ``batch`` ``XADD``s to one stream and awaiting each.

Every cell publishes a fixed number of 100-byte messages; cells run in interleaved rounds (every
cell once per round, the order rotating), and the table reports medians over the rounds of:
durable msg/s; publish latency p50 / p99 (per message: from the send, or the start of building
its pipeline, to its answer); this process's CPU per message and the server's (``/proc/PID/
stat``). CPU pressure (``/proc/pressure/cpu``) is recorded at start and end. Speed depends on
what else runs; compare clients within one run.

Writes: the section of ``--doc`` between ``<!-- run_all:begin -->`` and ``<!-- run_all:end -->``
(appended if absent), ``throughput_vs_batch.png`` and ``latency_vs_concurrency.png`` in
``--img-dir``; prints one JSON line last (``value``: the best ingest msg/s, ``baseline``: the
best Redis msg/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _common import bench_dir, cpu_pressure, emit, machine, median, percentile, ratio, say
from publish_danube_client import BrokerChild, proc_cpu

SIZE = 100
BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Cell:
    client: str
    batch: int
    concurrency: int
    messages: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.client, self.batch, self.concurrency)


def sweep(quick: bool) -> list[Cell]:
    """The default sweep (~1-3 min with 5 rounds here) or the quick one (seconds)."""
    if quick:
        return [
            Cell("ingest", 10, 1, 200),
            Cell("ingest", 100, 2, 1000),
            Cell("danube", 1, 1, 50),
            Cell("danube", 1, 4, 100),
            Cell("redis", 10, 1, 200),
            Cell("redis", 100, 2, 1000),
        ]
    cells = []
    for batch in (10, 100, 1000):
        for concurrency in (1, 4):
            n = 40_000 if batch == 1000 else 20_000 if batch == 100 else 3_000
            cells.append(Cell("ingest", batch, concurrency, n))
            cells.append(Cell("redis", batch, concurrency, n))
    for concurrency in (1, 16, 64):
        cells.append(Cell("danube", 1, concurrency, 300 if concurrency == 1 else 1_500))
    return cells


# -- redis ---------------------------------------------------------------------------------------


class RedisServer:
    """redis-server 7 with the AOF fsynced before every reply, in ``work``, on a free port."""

    def __init__(self, work: Path) -> None:
        from danube_ingest.testing import free_port

        self.work = work
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> None:
        import redis

        self.work.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.work), "--appendonly", "yes", "--appendfsync", "always",
            "--save", "",
        ]  # fmt: skip
        log = (self.work / "redis.log").open("wb")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None:
                    raise RuntimeError("redis-server exited; see redis.log") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout}s")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


async def publish_redis(port: int, stream: str, cell: Cell) -> dict[str, Any]:
    """``cell.concurrency`` clients, each awaiting pipelines of ``cell.batch`` XADDs."""
    import redis.asyncio as aioredis

    payload = b"x" * SIZE
    latencies: list[float] = []
    clients = [aioredis.Redis(port=port) for _ in range(cell.concurrency)]
    shares = [
        cell.messages // cell.concurrency + (i < cell.messages % cell.concurrency)
        for i in range(cell.concurrency)
    ]

    async def one(client: Any, share: int) -> None:
        while share > 0:
            n = min(cell.batch, share)
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for _ in range(n):
                pipe.xadd(stream, {"d": payload})
            await pipe.execute()
            latencies.extend([time.perf_counter() - started] * n)
            share -= n

    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(one(c, s) for c, s in zip(clients, shares, strict=True)))
    finally:
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        for client in clients:
            await client.aclose()
    return _row(len(latencies), elapsed, cpu, latencies)


# -- the sweep -----------------------------------------------------------------------------------


def _row(stored: int, elapsed: float, cpu: float, latencies: list[float]) -> dict[str, Any]:
    return {
        "msg_per_s": stored / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "client_cpu_us": cpu / stored * 1e6,
    }


async def measure(
    cell: Cell, round_no: int, url: str, redis: RedisServer, broker: BrokerChild
) -> dict[str, Any]:
    from danube_ingest.cli.bench import publish_danube, publish_ingest

    name = f"sweep-{cell.client}-b{cell.batch}-c{cell.concurrency}-r{round_no}"
    server_pid = redis.pid if cell.client == "redis" else broker.pid
    server0 = proc_cpu(server_pid)
    if cell.client == "redis":
        row = await publish_redis(redis.port, name, cell)
    else:
        if cell.client == "ingest":
            figures = await publish_ingest(
                url, f"/default/{name}", cell.messages, SIZE,
                batch=cell.batch, concurrency=cell.concurrency,
            )  # fmt: skip
        else:
            figures = await publish_danube(
                url, f"/default/{name}", cell.messages, SIZE, concurrency=cell.concurrency
            )
        row = {
            "msg_per_s": figures.msg_per_s,
            "p50_ms": figures.latency_ms["p50"],
            "p99_ms": figures.latency_ms["p99"],
            "client_cpu_us": figures.cpu_us_per_msg,
        }
    row["server_cpu_us"] = (proc_cpu(server_pid) - server0) / cell.messages * 1e6
    return row


async def run_sweep(cells: list[Cell], rounds: int) -> tuple[dict[Any, dict[str, float]], Any]:
    from danube_ingest.testing import LocalEtcd

    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {c.key: [] for c in cells}
    with bench_dir("run-all") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        redis = RedisServer(work / "redis")
        broker.start()
        try:
            redis.start()
            for r in range(rounds):
                shift = r % len(cells)
                for cell in cells[shift:] + cells[:shift]:
                    row = await measure(cell, r, broker.url, redis, broker)
                    samples[cell.key].append(row)
                    say(
                        f"  round {r + 1}/{rounds} {cell.client:6} batch {cell.batch:>4} "
                        f"concurrency {cell.concurrency:>2}: {row['msg_per_s']:>9,.0f} msg/s "
                        f"p99 {row['p99_ms']:7.2f} ms"
                    )
        finally:
            redis.stop()
            broker.stop()
    medians = {
        key: {field: median([s[field] for s in rows]) for field in rows[0]}
        for key, rows in samples.items()
    }
    return medians, samples


# -- outputs -------------------------------------------------------------------------------------

_LABELS = {"ingest": "danube_ingest.client", "danube": "danube-client", "redis": "Redis Streams"}


def plot(medians: dict[Any, dict[str, float]], img_dir: Path) -> list[Path]:
    """throughput_vs_batch.png and latency_vs_concurrency.png in ``img_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    paths = [img_dir / "throughput_vs_batch.png", img_dir / "latency_vs_concurrency.png"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for client in ("ingest", "redis", "danube"):
        for conc in sorted({k[2] for k in medians if k[0] == client}):
            points = sorted(
                (k[1], v["msg_per_s"])
                for k, v in medians.items()
                if k[:1] == (client,) and k[2] == conc
            )
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=f"{_LABELS[client]}, concurrency {conc}")
    ax.set(xscale="log", yscale="log", xlabel="batch size (messages)", ylabel="durable msg/s")
    ax.set_title(f"Publish throughput, {SIZE}-byte messages, fsync before the answer")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for client in ("ingest", "redis", "danube"):
        for batch in sorted({k[1] for k in medians if k[0] == client}):
            points = sorted(
                (k[2], v["p99_ms"]) for k, v in medians.items() if k[:2] == (client, batch)
            )
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=f"{_LABELS[client]}, batch {batch}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="concurrency (producers / clients / sends in flight)",
        ylabel="publish latency p99 (ms)",
    )
    ax.set_title("Publish latency p99 (send -> durable answer)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def table(
    medians: dict[Any, dict[str, float]],
    cells: list[Cell],
    rounds: int,
    command: str,
    pressure: tuple[float | None, float | None],
    images: list[Path],
    doc: Path,
) -> str:
    """The generated Markdown section (between the markers)."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        BEGIN,
        f"Generated by `{command}` on {when}: {rounds} interleaved rounds, medians; "
        f"{SIZE}-byte messages, durable (fsync before the answer); CPU pressure (avg10) "
        f"{pressure[0]}% at start, {pressure[1]}% at end; {os.cpu_count()} CPUs shared by "
        "client and server.",
        "",
        "| client | batch | concurrency | messages | msg/s | p50 ms | p99 ms "
        "| client CPU µs/msg | server CPU µs/msg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cell in sorted(
        cells, key=lambda c: (("ingest", "redis", "danube").index(c.client), c.batch, c.concurrency)
    ):
        m = medians[cell.key]
        lines.append(
            f"| {_LABELS[cell.client]} | {cell.batch} | {cell.concurrency} | {cell.messages:,} "
            f"| {m['msg_per_s']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} "
            f"| {m['client_cpu_us']:.1f} | {m['server_cpu_us']:.1f} |"
        )
    lines.append("")
    for image in images:
        rel = os.path.relpath(image, doc.parent)
        lines.append(f"![{image.stem.replace('_', ' ')}]({rel})")
    lines.append(END)
    return "\n".join(lines)


def write_section(doc: Path, section: str) -> None:
    """Replace the text between the markers in ``doc`` (append a section if they are absent)."""
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        text = text[:start] + section + text[end:]
    else:
        text = (
            text.rstrip("\n")
            + ("\n\n" if text else "")
            + "## `run_all.py` — generated sweep\n\n"
            + section
            + "\n"
        )
    doc.write_text(text)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny sweep (for the test)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5; --quick: 1)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 5)
    cells = sweep(args.quick)
    command = ".venv/bin/python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    if args.rounds:
        command += f" --rounds {args.rounds}"
    start_pressure = cpu_pressure()
    say(f"sweep: {len(cells)} cells x {rounds} rounds; CPU pressure {start_pressure}%")
    t0 = time.perf_counter()
    medians, _ = await run_sweep(cells, rounds)
    pressure = (start_pressure, cpu_pressure())
    images = plot(medians, args.img_dir)
    write_section(args.doc, table(medians, cells, rounds, command, pressure, images, args.doc))
    written = ", ".join(str(p) for p in images)
    say(f"wrote {args.doc} and {written} ({time.perf_counter() - t0:.0f} s)")
    best = {
        client: max(v["msg_per_s"] for k, v in medians.items() if k[0] == client)
        for client in ("ingest", "redis", "danube")
    }
    emit(
        {
            "benchmark": "run_all",
            "value": best["ingest"],
            "unit": "msg/s",
            "baseline": best["redis"],
            "ratio": ratio(best["ingest"], best["redis"]),
            "ratio_meaning": "best durable msg/s of the sweep, danube_ingest.client / Redis "
            "Streams (redis-py pipelines), same run",
            "best_danube_client": best["danube"],
            "ratio_vs_danube_client": ratio(best["ingest"], best["danube"]),
            "cells": [
                {"client": k[0], "batch": k[1], "concurrency": k[2], **v}
                for k, v in medians.items()
            ],
            "rounds": rounds,
            "cpu_pressure_avg10": {"start": pressure[0], "end": pressure[1]},
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    asyncio.run(main())
