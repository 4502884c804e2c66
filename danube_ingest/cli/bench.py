"""``danube-ingest bench``: publish N messages of S bytes and report throughput, latency, CPU.

The measuring functions (``publish_ingest``, ``publish_danube``, ``consume_ingest``) are also
what ``benchmarks/run_all.py`` sweeps. What they measure:

* throughput: messages acknowledged as durable per second of wall-clock time, from the first
  send to the last answer (the broker's ``wal.fsync`` setting decides what durable means);
* publish latency: per message, from the ``send`` call to its answer (so it includes the time a
  message waits in the client for its batch to fill or linger, and for an in-flight slot);
* CPU: this process's CPU time (all threads) over the run, and per message. The broker's CPU is
  not visible from here.

``--consume`` then drains the messages just published through a new subscription starting at
the first of them (the batch client only) and reports that throughput too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from danube_ingest.cli import client as cli_client
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.progress import ProgressLine
from danube_ingest.cli.tls_args import danube_builder, tls_options
from danube_ingest.client import Consumer, Producer, PublishError, TlsOptions

if TYPE_CHECKING:
    from danube import DanubeClientBuilder

#: The percentiles every latency figure reports.
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class PublishFigures:
    """One publish run: what was sent, how fast it was stored, at what latency and CPU."""

    client: str
    messages: int
    size: int
    batch: int
    concurrency: int
    seconds: float
    stored: int
    msg_per_s: float
    mb_per_s: float
    latency_ms: dict[str, float]
    """``p50``, ``p90``, ``p99`` and ``max`` of send → durable answer, milliseconds."""
    cpu_s: float
    cpu_us_per_msg: float
    first_offset: int = -1
    """The lowest offset stored (-1: unknown, as with danube-client)."""


@dataclass(frozen=True)
class ConsumeFigures:
    """One drain of a subscription: messages received and acknowledged per second."""

    messages: int
    seconds: float
    msg_per_s: float
    cpu_s: float
    cpu_us_per_msg: float
    extra: dict[str, Any] = field(default_factory=dict)


def latency_summary(seconds: list[float]) -> dict[str, float]:
    """Nearest-rank percentiles (and the maximum) of latencies in seconds, as milliseconds."""
    ordered = sorted(seconds)
    if not ordered:
        return {f"p{p:g}": math.nan for p in PERCENTILES} | {"max": math.nan}
    summary = {}
    for p in PERCENTILES:
        rank = max(1, math.ceil(p / 100 * len(ordered)))
        summary[f"p{p:g}"] = ordered[min(rank, len(ordered)) - 1] * 1000
    summary["max"] = ordered[-1] * 1000
    return summary


def _shares(count: int, concurrency: int) -> list[int]:
    return [
        count // concurrency + (1 if i < count % concurrency else 0) for i in range(concurrency)
    ]


def _figures(
    client: str,
    size: int,
    batch: int,
    concurrency: int,
    elapsed: float,
    cpu: float,
    latencies: list[float],
    refused: int,
    first_offset: int = -1,
) -> PublishFigures:
    stored = len(latencies)
    return PublishFigures(
        client=client,
        messages=stored + refused,
        size=size,
        batch=batch,
        concurrency=concurrency,
        seconds=elapsed,
        stored=stored,
        msg_per_s=stored / elapsed if elapsed > 0 else math.nan,
        mb_per_s=stored * size / elapsed / 1e6 if elapsed > 0 else math.nan,
        latency_ms=latency_summary(latencies),
        cpu_s=cpu,
        cpu_us_per_msg=cpu / stored * 1e6 if stored else math.nan,
        first_offset=first_offset,
    )


async def publish_ingest(
    url: str,
    topic: str,
    count: int,
    size: int,
    *,
    batch: int = 1000,
    concurrency: int = 1,
    in_flight: int = 8,
    linger_ms: float = 5.0,
    progress: ProgressLine | None = None,
    tls: TlsOptions | None = None,
) -> PublishFigures:
    """Publish ``count`` messages of ``size`` bytes to ``topic`` from ``concurrency`` batch
    ``Producer`` objects (``batch`` messages per batch, ``in_flight`` batches each); return
    once every message is answered. If the broker refused any, raises the first refusal
    (``PublishError``, its text saying how many were refused and stored)."""
    payload = b"x" * size
    latencies: list[float] = []
    refused = 0
    first_offset = -1
    errors: list[BaseException] = []

    def answered(sent_at: float, future: Any) -> None:
        nonlocal refused, first_offset
        error = future.exception() if not future.cancelled() else asyncio.CancelledError()
        if error is not None:
            refused += 1
            errors.append(error)
            return
        latencies.append(time.perf_counter() - sent_at)
        offset = future.result()
        if first_offset < 0 or offset < first_offset:
            first_offset = offset
        if progress is not None:
            progress.step()

    async def one(share: int) -> None:
        async with Producer(
            url,
            topic,
            producer_name="bench",
            max_batch_messages=batch,
            max_batch_bytes=max(1 << 20, batch * size),
            max_in_flight=in_flight,
            max_buffered=batch * (in_flight + 2),
            linger_ms=linger_ms,
            tls=tls,
        ) as producer:
            for _ in range(share):
                sent_at = time.perf_counter()
                future = await producer.send(payload)
                future.add_done_callback(partial(answered, sent_at))
            await producer.flush()

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(share) for share in _shares(count, concurrency)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if errors:
        first = errors[0]
        if isinstance(first, PublishError):
            raise PublishError(
                first.code,
                f"{first.details} ({refused} messages refused, {len(latencies)} stored)",
                first.topic,
            )
        raise first
    return _figures(
        "ingest", size, batch, concurrency, elapsed, cpu, latencies, refused, first_offset
    )


async def publish_danube(
    url: str,
    topic: str,
    count: int,
    size: int,
    *,
    concurrency: int = 1,
    progress: ProgressLine | None = None,
    builder: DanubeClientBuilder | None = None,
) -> PublishFigures:
    """Publish ``count`` messages of ``size`` bytes through danube-client: one producer,
    ``concurrency`` tasks each awaiting one send at a time (so ``concurrency`` sends in
    flight); batch size 1 by construction."""
    from danube import DanubeClientBuilder, DispatchStrategy

    client = await (builder or DanubeClientBuilder().service_url(url)).build()
    producer = (
        client.new_producer()
        .with_topic(topic)
        .with_name(f"bench-{uuid.uuid4().hex[:8]}")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .build()
    )
    await producer.create()
    payload = b"x" * size
    latencies: list[float] = []

    async def task(share: int) -> None:
        for _ in range(share):
            sent_at = time.perf_counter()
            await producer.send(payload, {})
            latencies.append(time.perf_counter() - sent_at)
            if progress is not None:
                progress.step()

    cpu0, t0 = time.process_time(), time.perf_counter()
    try:
        await asyncio.gather(*(task(share) for share in _shares(count, concurrency)))
    finally:
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        await producer.close()
        # (danube-client keeps its channels open after the producer closes.)
        for connection in list(client.connection_manager._connections.values()):
            await connection.channel.close()
    return _figures("danube", size, 1, concurrency, elapsed, cpu, latencies, 0)


async def consume_ingest(
    url: str,
    topic: str,
    first_offset: int,
    count: int,
    *,
    max_batch: int = 1000,
    progress: ProgressLine | None = None,
    timeout: float = 60.0,
    tls: TlsOptions | None = None,
) -> ConsumeFigures:
    """Receive and acknowledge ``count`` messages from ``first_offset`` on, through a new
    Exclusive subscription (``bench-`` and a random suffix; left behind, fully acked).
    ``TimeoutError`` if they do not all arrive within ``timeout`` seconds."""
    received = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    async with Consumer(
        url,
        topic,
        f"bench-{uuid.uuid4().hex[:12]}",
        consumer_name="bench",
        start=max(first_offset, 0),
        max_batch=max_batch,
        tls=tls,
    ) as consumer:
        async with asyncio.timeout(timeout):
            while received < count:
                batch = await consumer.receive()
                consumer.ack(batch)
                received += len(batch.entries)
                if progress is not None:
                    progress.step(len(batch.entries))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return ConsumeFigures(
        messages=received,
        seconds=elapsed,
        msg_per_s=received / elapsed if elapsed > 0 else math.nan,
        cpu_s=cpu,
        cpu_us_per_msg=cpu / received * 1e6 if received else math.nan,
    )


def cpu_pressure() -> float | None:
    """Linux PSI "some" avg10 for CPU (% of the last 10 s some task waited for a CPU)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


# -- the command -------------------------------------------------------------------------------


def register(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure publish (and consume) throughput, latency and CPU against a broker",
        description="Publish --count messages of --size bytes to --topic in batches of --batch "
        "from --concurrency producers (danube-client: --concurrency sends in flight), then "
        "print throughput (durable msg/s, MB/s), publish latency percentiles (send -> durable "
        "answer) and this process's CPU time; --consume then drains them through a new "
        "subscription. --json prints one JSON line instead.",
        formatter_class=DefaultsHelpFormatter,
    )
    cli_client.common(bench, topic_required=False)
    bench.add_argument(
        "--topic", type=cli_client.topic_name, default="/default/bench", help="topic name"
    )
    bench.add_argument("--count", type=cli_client.positive, default=100_000, help="messages")
    bench.add_argument(
        "--size", type=cli_client.non_negative, default=100, help="payload bytes per message"
    )
    bench.add_argument(
        "--concurrency",
        type=cli_client.positive,
        default=4,
        help="producers publishing at once (danube-client: sends in flight)",
    )
    cli_client.batching(bench)
    bench.add_argument(
        "--consume",
        action="store_true",
        help="then consume the messages through a new subscription (batch client only)",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON line of results")
    bench.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    if args.consume and args.client == "danube":
        print(
            "danube-ingest: error: --consume needs the batch client (--client ingest)",
            file=sys.stderr,
        )
        return 2
    return cli_client.run(_run_bench(args))


async def _run_bench(args: argparse.Namespace) -> None:
    tls = tls_options(args)
    await cli_client.check_reachable(args.service_url, args.connect_timeout, tls)
    pressure = cpu_pressure()
    with ProgressLine("published", args.count) as progress:
        if args.client == "danube":
            figures = await publish_danube(
                args.service_url,
                args.topic,
                args.count,
                args.size,
                concurrency=args.concurrency,
                progress=progress,
                builder=danube_builder(args),
            )
        else:
            figures = await publish_ingest(
                args.service_url,
                args.topic,
                args.count,
                args.size,
                batch=args.batch,
                concurrency=args.concurrency,
                in_flight=args.in_flight,
                linger_ms=args.linger_ms,
                progress=progress,
                tls=tls,
            )
    consumed: ConsumeFigures | None = None
    if args.consume:
        with ProgressLine("consumed", figures.stored) as progress:
            consumed = await consume_ingest(
                args.service_url,
                args.topic,
                figures.first_offset,
                figures.stored,
                max_batch=args.batch,
                progress=progress,
                tls=tls,
            )
    result: dict[str, Any] = {
        "benchmark": "cli_bench",
        "service_url": args.service_url,
        "topic": args.topic,
        "in_flight": args.in_flight if args.client == "ingest" else None,
        "publish": asdict(figures),
        "consume": asdict(consumed) if consumed is not None else None,
        "cpu_pressure_avg10": {"start": pressure, "end": cpu_pressure()},
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(_rounded(result)), flush=True)
    else:
        _print_human(figures, consumed, result["cpu_pressure_avg10"], print)


def _print_human(
    figures: PublishFigures,
    consumed: ConsumeFigures | None,
    pressure: dict[str, float | None],
    out: Callable[[str], None],
) -> None:
    lat = figures.latency_ms
    out(
        f"published {figures.stored:,} of {figures.messages:,} messages of {figures.size} B "
        f"({figures.client} client, batch {figures.batch}, concurrency {figures.concurrency}) "
        f"in {figures.seconds:.2f} s"
    )
    out(f"  throughput  {figures.msg_per_s:,.0f} msg/s durable, {figures.mb_per_s:,.2f} MB/s")
    out(
        f"  latency     p50 {lat['p50']:.2f} ms, p90 {lat['p90']:.2f} ms, "
        f"p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms (send -> durable answer)"
    )
    out(f"  client CPU  {figures.cpu_s:.2f} s, {figures.cpu_us_per_msg:.1f} us per message")
    if consumed is not None:
        out(
            f"consumed {consumed.messages:,} messages in {consumed.seconds:.2f} s: "
            f"{consumed.msg_per_s:,.0f} msg/s, client CPU {consumed.cpu_us_per_msg:.1f} us "
            "per message"
        )
    out(f"CPU pressure (avg10) {pressure['start']}% at start, {pressure['end']}% at end")


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        if math.isnan(obj) or math.isinf(obj):
            return None
        return round(obj, 1) if abs(obj) >= 100 else round(obj, 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_rounded(v) for v in obj]
    return obj
