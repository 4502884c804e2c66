"""Durable publish through the batch path (danube_ingest.client) vs danube-client, same run.

Run: ``.venv/bin/python benchmarks/batch_publish.py`` (no arguments, ~30 s on 2 cores).

Part 1, in this process (``micro_*``): the daemon's cost per 1,000-message batch of 100-byte
payloads on a memory-mode ``RegionLog`` (no disk, so only CPU is measured):

* ``block``: ``check_block`` (the vectorised checks, as the Publish handler runs them) plus
  ``stage_block`` until the frame is "durable" (staging, stamping, framing, completion);
* ``entries``: the same messages as 1,000 ``Entry`` objects through ``stage_batch`` (what the
  danube-client path does per message, batched as well as it can be), not counting the cost of
  building the objects from requests.

Part 2, end to end: the real broker in a child process (``BrokerChild`` of
``publish_danube_client.py``: the daemon's default storage, ``wal.fsync: always``) on a local
etcd, loopback gRPC. ``value``: acknowledged (durable) msg/s of ``PRODUCERS`` batch
``Producer`` objects (1,000-message batches, ``IN_FLIGHT`` batches in flight each) for
``SECONDS`` s. ``baseline``: danube-client, 4 producers x 16 tasks (64 sends in flight), the
same payloads, for ``SECONDS`` s, in the same run against the same broker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from _common import bench_dir, emit, machine, median, ratio, say, warn_if_busy
from publish_danube_client import BrokerChild

PAYLOAD = b"x" * 100
BATCH = 1000
PRODUCERS = 4
IN_FLIGHT = 8
SECONDS = 4.0
MICRO_ROUNDS = 200


async def micro() -> dict[str, float]:
    from danube_ingest.wal import RegionLog
    from danube_ingest.wal.block import BlockLimits, check_block, encode_block
    from danube_ingest.wal.framing import Entry

    limits = BlockLimits(max_payload_bytes=4_000_000, max_attributes=64)
    block, sizes = encode_block([Entry(PAYLOAD, producer_name="p") for _ in range(BATCH)])
    log = await RegionLog.open(None)
    check_s: list[float] = []
    block_s: list[float] = []
    entry_s: list[float] = []
    try:
        for _ in range(MICRO_ROUNDS):
            data = bytearray(block)
            t0 = time.perf_counter()
            checked = check_block(data, sizes, BATCH, limits)
            t1 = time.perf_counter()
            await log.stage_block("/bench/block", checked, 0, 0).future
            t2 = time.perf_counter()
            check_s.append(t1 - t0)
            block_s.append(t2 - t0)
            entries = [Entry(PAYLOAD, producer_name="p") for _ in range(BATCH)]
            t3 = time.perf_counter()
            await log.stage_batch("/bench/entries", entries)
            entry_s.append(time.perf_counter() - t3)
    finally:
        await log.close()
    return {
        "micro_check_us_per_1000": median(check_s) * 1e6,
        "micro_block_us_per_1000": median(block_s) * 1e6,
        "micro_entries_us_per_1000": median(entry_s) * 1e6,
    }


async def batch_rate(url: str) -> float:
    """Acknowledged msg/s of PRODUCERS batch producers sending for SECONDS (then flushing)."""
    from danube_ingest.client import Producer

    acked = 0
    stop = time.monotonic() + SECONDS

    async def one(i: int) -> None:
        nonlocal acked
        async with Producer(
            url,
            f"/default/bench-batch-{i}",
            max_batch_messages=BATCH,
            max_batch_bytes=1 << 30,
            max_in_flight=IN_FLIGHT,
            max_buffered=BATCH * (IN_FLIGHT + 2),
        ) as producer:
            futures: list[asyncio.Future[int]] = []
            while time.monotonic() < stop:
                for _ in range(BATCH):
                    futures.append(await producer.send(PAYLOAD))
            await producer.flush()
            acked += sum(1 for f in futures if f.exception() is None)

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(PRODUCERS)))
    return acked / (time.perf_counter() - t)


async def danube_rate(url: str) -> float:
    from danube import DanubeClientBuilder, DispatchStrategy

    client = await DanubeClientBuilder().service_url(url).build()
    producers = []
    for i in range(4):
        producer = (
            client.new_producer()
            .with_topic(f"/default/bench-danube-{i}")
            .with_name(f"p{i}")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .build()
        )
        await producer.create()
        producers.append(producer)
    sent = 0
    stop = time.monotonic() + SECONDS

    async def task(producer: Any) -> None:
        nonlocal sent
        while time.monotonic() < stop:
            await producer.send(PAYLOAD, {})
            sent += 1

    t = time.perf_counter()
    await asyncio.gather(*(task(p) for p in producers for _ in range(16)))
    elapsed = time.perf_counter() - t
    for producer in producers:
        await producer.close()
    for connection in list(client.connection_manager._connections.values()):
        await connection.channel.close()
    return sent / elapsed


async def run() -> None:
    from danube_ingest.testing import LocalEtcd

    say("micro: daemon CPU per 1,000-message batch (memory-mode log)")
    figures = await micro()
    for key, value in figures.items():
        say(f"  {key}: {value:.1f}")
    warn_if_busy("end to end")
    with bench_dir("batch") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        broker.start()
        try:
            batch = await batch_rate(broker.url)
            say(f"batch client: {batch:,.0f} msg/s durable")
            danube = await danube_rate(broker.url)
            say(f"danube-client: {danube:,.0f} msg/s durable")
        finally:
            broker.stop()
    emit(
        {
            "benchmark": "batch_publish",
            "value": batch,
            "unit": "msg/s",
            "baseline": danube,
            "ratio": ratio(batch, danube),
            "ratio_meaning": "durable msg/s, batch Producer / danube-client, same broker, same run",
            **figures,
            "micro_block_vs_entries": ratio(
                figures["micro_entries_us_per_1000"], figures["micro_block_us_per_1000"]
            ),
            "producers": PRODUCERS,
            "in_flight": IN_FLIGHT,
            "batch": BATCH,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    asyncio.run(run())
