"""The WAL on Kafka (``storage.wal.backend: kafka``) against confluent-kafka and the local WAL.

Run: ``flock /tmp/danube-bench.lock .venv/bin/python benchmarks/kafka_wal.py`` (no arguments,
about 2.5 minutes on 2 cores, ~4 GB under the temp dir; needs the Kafka jars of ``make setup``).

Setup, all on loopback in temporary directories: one local single-node Kafka for the whole run
(``danube_ingest.testing.LocalKafka``: KRaft, 256 MiB heap, Kafka's default ``log.flush.*``,
i.e. no fsync: a record is "durable" in Kafka once it is in the partition's page cache on
every in-sync replica, here the one node), one local etcd, and two real brokers in child
processes (``BrokerChild`` of ``publish_danube_client.py``), both ``storage.mode: local_only``,
``wal.fsync: always``: ``kafka`` with ``storage.wal.backend: kafka`` (replication factor 1, a
topic prefix unique to the run) and ``local`` with the default local WAL (segment files,
fdatasync before each answer).

Part 1, throughput (``ROUNDS`` interleaved rounds, the order rotating; medians):

* ``ours_kafka``: ``PRODUCERS`` ``danube_ingest.client.Producer`` objects in this process
  (uvloop), one topic each, each looping ``send_many`` of 1,000 100-byte messages (so one
  1,000-message batch per call, ``IN_FLIGHT`` batches in flight) for ``SECONDS`` s, then
  flushing; acknowledged (durable) msg/s over the time to the last answer.
* ``ours_local``: the same load on the local-WAL broker.
* ``peer``: confluent-kafka's ``Producer`` in this process, as a Kafka user would publish the
  same messages: one record per 100-byte message to a topic of one partition (replication
  factor 1) on the same Kafka, ``acks=all``, ``enable.idempotence=True``, librdkafka's defaults
  otherwise (``linger.ms`` 5, ``batch.size`` 1,000,000 bytes, ``batch.num.messages`` 10,000,
  ``queue.buffering.max.messages`` 100,000, no compression), a delivery callback per message
  counting the acknowledged ones, ``poll(0)`` after every 1,000 produced (``poll(0.01)`` on a
  full queue), for ``SECONDS`` s, then ``flush``; acknowledged msg/s over the time to the last
  answer.

CPU seconds per million messages of this process, of the broker child and of the Kafka JVM
(``/proc/PID/stat``) are reported for each: much less distorted by other load than msg/s.

Part 2, publish latency at a paced 100k msg/s (``batch_latency.py --publish-only``'s method, its
``window`` function): one ``Producer`` handing over the messages due every 1 ms with
``send_many``; latency = a batch's oldest message's due time -> the producer's future resolving
(the daemon's durable answer), so a publisher falling behind shows as latency. ``LAT_ROUNDS``
windows of ``LAT_SECONDS`` s on each broker, interleaved, after a warm-up on each; p50 / p99
per window, medians reported (goal: p99 <= 20 ms on the Kafka backend).

Part 2b, what one Kafka transaction costs: ``SINGLE_COMMITS`` 100-message blocks staged one at a
time (each awaited, then ``SINGLE_GAP`` s of quiet) into a ``RegionLog`` on Kafka (one
transaction each: begin, produce, commit) and into a local one (write + fdatasync), in this
process; p50 / p99 ms.

Part 3, recovery per GB, in this process: a ``RegionLog`` with ``kafka=KafkaWal(...)``
(replication factor 1) is filled with 1,000-message blocks of 100-byte messages
(``stage_block``, at most ``RECOVERY_IN_FLIGHT`` blocks unanswered) until ``RECOVERY_BYTES`` or
``RECOVERY_SECONDS`` s, closed (nothing deleted), and ``RegionLog.open`` is timed on a new, empty
cache directory: recovery reads every committed record from Kafka and rebuilds the cache
(``recovery_kafka_empty_region_s``: the same on a region holding nothing, the fixed cost of
taking a region: topic checks, ``init_transactions``, watermarks). The
same blocks go into a local ``RegionLog`` (``fsync: always``), closed and reopened: as it is
(its snapshot bounds the scan) and with the snapshot deleted (every segment scanned). Warm page
caches on both sides (the data was just written). Reported as seconds per GB (10^9 bytes of
block bytes written).

Memory stays bounded: our producers by ``max_buffered`` (``IN_FLIGHT`` + 2 batches each),
librdkafka by its queue (100,000 messages), the recovery writer by ``RECOVERY_IN_FLIGHT`` blocks,
and Kafka by its 256 MiB heap (its data is on disk / in the page cache).

Not measured here: takeover time (another broker taking a region over from Kafka).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

from _common import MIB, bench_dir, cpu_pressure, emit, machine, median, ratio, say, warn_if_busy
from batch_latency import pct
from batch_latency import window as paced_window
from publish_danube_client import BROKER_YAML, BrokerChild, proc_cpu

PAYLOAD = bytes(range(100))
BATCH = 1000
PRODUCERS = 4
IN_FLIGHT = 8
SECONDS = 3.0
ROUNDS = 5
GOAL = 1.0

LAT_RATE = 100_000
LAT_WARMUP = 2.0
LAT_SECONDS = 3.0
LAT_ROUNDS = 5
LAT_GOAL_MS = 20.0

RECOVERY_BYTES = 1024 * MIB
RECOVERY_SECONDS = 30.0
RECOVERY_IN_FLIGHT = 16
GB = 1e9

#: Part 2b: group commits of one 100-message block at a time (nothing else in flight).
SINGLE_COMMITS = 40
SINGLE_GAP = 0.02

#: librdkafka settings of the peer (everything else is librdkafka's default).
PEER_SETTINGS = {"acks": "all", "enable.idempotence": True}

PREFIX = f"kb{uuid.uuid4().hex[:8]}."


def kafka_yaml(bootstrap: str) -> str:
    """``BROKER_YAML`` (the daemon's defaults) with the Kafka backend, its own etcd prefix."""
    return (
        BROKER_YAML.replace("/danube-bench", "/danube-bench-kafka")
        + "    backend: kafka\n"
        + "    kafka:\n"
        + f"      bootstrap_servers: '{bootstrap}'\n"
        + "      replication_factor: 1\n"
        + f"      topic_prefix: '{PREFIX}'\n"
    )


# -- part 1: throughput ----------------------------------------------------------------------


async def ours_rate(url: str, tag: str) -> tuple[int, float]:
    """(acknowledged messages, seconds to the last answer) of PRODUCERS producers doing
    ``send_many`` for SECONDS. Producers are connected (one batch answered each) before the
    clock starts."""
    from danube_ingest.client import Producer

    payloads = [PAYLOAD] * BATCH
    producers = [
        Producer(
            url,
            f"/default/kbench-{tag}-{i}",
            max_batch_messages=BATCH,
            max_batch_bytes=1 << 30,
            max_in_flight=IN_FLIGHT,
            max_buffered=BATCH * (IN_FLIGHT + 2),
        )
        for i in range(PRODUCERS)
    ]
    async with contextlib.AsyncExitStack() as stack:
        for producer in producers:
            await stack.enter_async_context(producer)
        await asyncio.gather(*[await p.send_many(payloads) for p in producers])
        acked = 0

        def count(future: asyncio.Future[list[range]]) -> None:
            nonlocal acked
            if not future.cancelled() and future.exception() is None:
                acked += BATCH

        stop = time.monotonic() + SECONDS

        async def one(producer: Any) -> None:
            while time.monotonic() < stop:
                (await producer.send_many(payloads)).add_done_callback(count)
            await producer.flush()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in producers))
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0)  # (the last done callbacks)
        return acked, elapsed


def peer_rate(bootstrap: str, topic: str) -> tuple[int, float]:
    """(delivery-acknowledged messages, seconds to the last answer) of confluent-kafka producing
    one record per message for SECONDS."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, **PEER_SETTINGS})
    acked = 0
    failed = 0

    def delivered(err: Any, _msg: Any) -> None:
        nonlocal acked, failed
        if err is None:
            acked += 1
        else:
            failed += 1

    # Warm-up: connected, idempotent producer id fetched, one record acknowledged.
    producer.produce(topic, PAYLOAD)
    producer.flush(30)
    produce, poll = producer.produce, producer.poll
    stop = time.monotonic() + SECONDS
    t0 = time.perf_counter()
    while time.monotonic() < stop:
        for _ in range(BATCH):
            while True:
                try:
                    produce(topic, PAYLOAD, on_delivery=delivered)
                    break
                except BufferError:
                    poll(0.01)
        poll(0)
    left = producer.flush(60)
    elapsed = time.perf_counter() - t0
    if left or failed:
        raise RuntimeError(f"peer: {left} messages not delivered, {failed} failed")
    return acked, elapsed


def create_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)


async def throughput(kafka_pid: int, bootstrap: str, brokers: dict[str, BrokerChild]) -> dict:
    topic = f"{PREFIX}peer"
    create_topic(bootstrap, topic)
    names = ["ours_kafka", "peer", "ours_local"]
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for round_no in range(ROUNDS):
        order = names[round_no % 3 :] + names[: round_no % 3]
        for name in order:
            broker = brokers["kafka" if name == "ours_kafka" else "local"]
            self0, kafka0, broker0 = time.process_time(), proc_cpu(kafka_pid), proc_cpu(broker.pid)
            if name == "peer":
                n, elapsed = peer_rate(bootstrap, topic)
            else:
                n, elapsed = await ours_rate(broker.url, f"{name}-{round_no}")
            rate = n / elapsed
            figures = {
                "msg_per_s": rate,
                "client_cpu_s_per_1m": (time.process_time() - self0) / n * 1e6,
                "kafka_cpu_s_per_1m": (proc_cpu(kafka_pid) - kafka0) / n * 1e6,
                "broker_cpu_s_per_1m": (
                    (proc_cpu(broker.pid) - broker0) / n * 1e6 if name != "peer" else 0.0
                ),
                "cpu_pressure": cpu_pressure() or 0.0,
            }
            samples[name].append(figures)
            say(
                f"round {round_no + 1}/{ROUNDS} {name}: {rate:,.0f} msg/s durable; CPU s per 1M "
                f"msgs client {figures['client_cpu_s_per_1m']:.2f}, broker "
                f"{figures['broker_cpu_s_per_1m']:.2f}, Kafka {figures['kafka_cpu_s_per_1m']:.2f}"
                f"; pressure {figures['cpu_pressure']}%"
            )
    return {
        name: {key: median([s[key] for s in rows]) for key in rows[0]}
        | {"rounds_msg_per_s": [s["msg_per_s"] for s in rows]}
        for name, rows in samples.items()
    }


# -- part 2: latency at 100k msg/s -----------------------------------------------------------


async def latency(brokers: dict[str, BrokerChild]) -> dict:
    import batch_latency

    from danube_ingest.client import Producer

    assert batch_latency.RATE == LAT_RATE, batch_latency.RATE  # (its window paces at RATE)
    producers = {}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in brokers}
    async with contextlib.AsyncExitStack() as stack:
        for name, broker in brokers.items():
            producer = Producer(
                broker.url,
                f"/default/kbench-latency-{name}",
                max_batch_messages=10_000,
                max_in_flight=64,
                max_buffered=LAT_RATE,
            )
            producers[name] = await stack.enter_async_context(producer)
            await (await producer.send_many([bytes(100)]))  # (creates the topic)
            await paced_window(producer, None, LAT_WARMUP, [], [])
        for round_no in range(LAT_ROUNDS):
            for name in list(brokers)[:: 1 if round_no % 2 == 0 else -1]:
                broker = brokers[name]
                acks: list[float] = []
                broker0, self0 = proc_cpu(broker.pid), time.process_time()
                published, _ = await paced_window(producers[name], None, LAT_SECONDS, [], acks)
                n = published * LAT_SECONDS
                row = {
                    "published_per_s": published,
                    "p50_ms": pct(acks, 50),
                    "p99_ms": pct(acks, 99),
                    "max_ms": max(acks),
                    "broker_cpu_s_per_1m": (proc_cpu(broker.pid) - broker0) / n * 1e6,
                    "client_cpu_s_per_1m": (time.process_time() - self0) / n * 1e6,
                    "cpu_pressure": cpu_pressure() or 0.0,
                }
                rows[name].append(row)
                say(
                    f"latency round {round_no + 1}/{LAT_ROUNDS} {name}: {published:,.0f} msg/s; "
                    f"durable answer p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, "
                    f"max {row['max_ms']:.1f} ms; broker {row['broker_cpu_s_per_1m']:.2f} CPU s "
                    f"per 1M; pressure {row['cpu_pressure']}%"
                )
    return {
        name: {key: median([r[key] for r in rs]) for key in rs[0]}
        | {"rounds_p99_ms": [r["p99_ms"] for r in rs]}
        for name, rs in rows.items()
    }


async def single_commits(bootstrap: str, work: Path) -> dict[str, float]:
    """p50 / p99 ms of one durable group commit with nothing else in flight: a 100-message
    block staged, awaited, ``SINGLE_GAP`` s of quiet, ``SINGLE_COMMITS`` times; a Kafka
    ``RegionLog`` (one transaction each) and a local one (``fsync: always``)."""
    from danube_ingest.wal import RegionLog
    from danube_ingest.wal.block import BlockLimits, check_block, encode_block
    from danube_ingest.wal.framing import Entry
    from danube_ingest.wal.kafka import KafkaWal

    block, sizes = encode_block([Entry(PAYLOAD, producer_name="p") for _ in range(100)])
    limits = BlockLimits(max_payload_bytes=4_000_000, max_attributes=64)
    settings = KafkaWal(bootstrap, wal="bench-single", topic_prefix=PREFIX, replication_factor=1)
    out: dict[str, float] = {}
    for name, kafka in (("kafka", settings), ("local", None)):
        log = await RegionLog.open(work / f"single-{name}", kafka=kafka)
        times: list[float] = []
        try:
            for _ in range(SINGLE_COMMITS + 1):  # (the first one warms up)
                await asyncio.sleep(SINGLE_GAP)
                t0 = time.perf_counter()
                checked = check_block(bytearray(block), sizes, 100, limits)
                await log.stage_block("/bench/single", checked, 0, 0).future
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            await log.close()
        out[f"single_commit_{name}_p50_ms"] = pct(times[1:], 50)
        out[f"single_commit_{name}_p99_ms"] = pct(times[1:], 99)
        say(
            f"one block at a time, {name}: durable in p50 {pct(times[1:], 50):.2f} ms, p99 "
            f"{pct(times[1:], 99):.2f} ms ({SINGLE_COMMITS} commits)"
        )
    return out


# -- part 3: recovery per GB -----------------------------------------------------------------


async def fill(log: Any, deadline: float, limit: int) -> int:
    """Stage 1,000-message blocks into ``log`` until ``limit`` bytes or ``deadline``; bytes."""
    from danube_ingest.wal.block import BlockLimits, check_block, encode_block
    from danube_ingest.wal.framing import Entry

    block, sizes = encode_block([Entry(PAYLOAD, producer_name="p") for _ in range(BATCH)])
    limits = BlockLimits(max_payload_bytes=4_000_000, max_attributes=64)
    pending: collections.deque[Any] = collections.deque()
    written = 0
    while written < limit and time.monotonic() < deadline:
        checked = check_block(bytearray(block), sizes, BATCH, limits)
        pending.append(log.stage_block("/bench/recovery", checked, 0, 0).future)
        written += len(block)
        if len(pending) >= RECOVERY_IN_FLIGHT:
            await pending.popleft()
    for future in pending:
        await future
    return written


async def recovery(bootstrap: str, work: Path) -> dict[str, float]:
    from danube_ingest.wal import RegionLog
    from danube_ingest.wal.kafka import KafkaWal
    from danube_ingest.wal.meta import SNAPSHOT_NAME

    settings = KafkaWal(bootstrap, wal="bench-recovery", topic_prefix=PREFIX, replication_factor=1)
    empty = KafkaWal(bootstrap, wal="bench-empty", topic_prefix=PREFIX, replication_factor=1)
    # The fixed cost: recovering a region that holds nothing (topics created by the first open).
    await (await RegionLog.open(work / "empty-writer", kafka=empty)).close()
    t0 = time.perf_counter()
    await (await RegionLog.open(work / "empty-cache", kafka=empty)).close()
    fixed_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    log = await RegionLog.open(work / "kafka-writer", kafka=settings)
    written = await fill(log, time.monotonic() + RECOVERY_SECONDS, RECOVERY_BYTES)
    await log.close()
    write_s = time.perf_counter() - t0
    commits = log._backend.commits
    say(
        f"recovery: {written / MIB:,.0f} MiB written through Kafka in {write_s:.1f} s "
        f"({written / MIB / write_s:,.0f} MiB/s, {commits:,} transactions, "
        f"{written / MIB / max(commits, 1):.2f} MiB each)"
    )

    cache = work / "kafka-empty-cache"
    t0, cpu0 = time.perf_counter(), time.process_time()
    log = await RegionLog.open(cache, kafka=settings)
    kafka_s, kafka_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await log.close()
    rebuilt = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    say(
        f"recovery from Kafka (empty cache): {kafka_s:.2f} s ({kafka_s / written * GB:.2f} s per "
        f"GB; an empty region {fixed_s:.2f} s; this process {kafka_cpu:.2f} CPU s; cache "
        f"rebuilt: {rebuilt / MIB:,.0f} MiB)"
    )

    local_dir = work / "local"
    t0 = time.perf_counter()
    log = await RegionLog.open(local_dir, fsync="always")
    await fill(log, time.monotonic() + 4 * RECOVERY_SECONDS, written)
    await log.close()
    local_write_s = time.perf_counter() - t0
    say(f"recovery: the same {written / MIB:,.0f} MiB into the local WAL in {local_write_s:.1f} s")
    t0 = time.perf_counter()
    log = await RegionLog.open(local_dir, fsync="always")
    local_s = time.perf_counter() - t0
    await log.close()
    for snapshot in local_dir.rglob(SNAPSHOT_NAME):
        snapshot.unlink()
    t0 = time.perf_counter()
    log = await RegionLog.open(local_dir, fsync="always")
    local_full_s = time.perf_counter() - t0
    local_scanned = log.recovered.bytes_scanned
    await log.close()
    say(
        f"recovery local: {local_s:.2f} s with its snapshot ({local_s / written * GB:.2f} s per "
        f"GB), {local_full_s:.2f} s without ({local_full_s / written * GB:.2f} s per GB)"
    )
    return {
        "recovery_bytes": written,
        "recovery_write_s": write_s,
        "recovery_kafka_s": kafka_s,
        "recovery_kafka_s_per_gb": kafka_s / written * GB,
        "recovery_kafka_cpu_s": kafka_cpu,
        "recovery_kafka_empty_region_s": fixed_s,
        "recovery_kafka_cache_rebuilt_bytes": rebuilt,
        "recovery_kafka_transactions": commits,
        "recovery_local_write_s": local_write_s,
        "recovery_local_s": local_s,
        "recovery_local_s_per_gb": local_s / written * GB,
        "recovery_local_full_scan_s": local_full_s,
        "recovery_local_full_scan_s_per_gb": local_full_s / written * GB,
        "recovery_local_full_scanned_bytes": local_scanned,
    }


async def run() -> None:
    from danube_ingest.testing import LocalEtcd, LocalKafka

    pressure_before = cpu_pressure()
    warn_if_busy("start")
    with bench_dir("kafka-wal") as work, LocalKafka() as kafka, LocalEtcd() as etcd:
        bootstrap = kafka.bootstrap_servers
        kafka_pid = kafka.server.pid
        assert kafka_pid is not None
        say(f"Kafka at {bootstrap} (pid {kafka_pid}), topic prefix {PREFIX}")
        brokers = {
            "kafka": BrokerChild(work, etcd.endpoint, "kbench-kafka", kafka_yaml(bootstrap)),
            "local": BrokerChild(
                work,
                etcd.endpoint,
                "kbench-local",
                BROKER_YAML.replace("/danube-bench", "/danube-bench-local"),
            ),
        }
        try:
            for broker in brokers.values():
                broker.start(90.0)
            tput = await throughput(kafka_pid, bootstrap, brokers)
            warn_if_busy("latency")
            lat = await latency(brokers)
        finally:
            for broker in brokers.values():
                broker.stop()
        single = await single_commits(bootstrap, work)
        warn_if_busy("recovery")
        rec = await recovery(bootstrap, work)
    ours, peer, local = (tput[k]["msg_per_s"] for k in ("ours_kafka", "peer", "ours_local"))
    say(
        f"ours_kafka {ours:,.0f} msg/s, peer {peer:,.0f}, ours_local {local:,.0f}; "
        f"ours_kafka/peer {ratio(ours, peer):.3f} (goal >= {GOAL}), ours_kafka/ours_local "
        f"{ratio(ours, local):.3f}; p99 at {LAT_RATE:,} msg/s: kafka "
        f"{lat['kafka']['p99_ms']:.2f} ms (goal <= {LAT_GOAL_MS}), local "
        f"{lat['local']['p99_ms']:.2f} ms"
    )
    emit(
        {
            "benchmark": "kafka_wal",
            "value": ours,
            "unit": "msg/s",
            "baseline": peer,
            "ratio": ratio(ours, peer),
            "ratio_meaning": (
                "durable msg/s, batch Producer.send_many through the broker on the Kafka WAL / "
                "confluent-kafka (acks=all, idempotent, one record per message) to the same "
                f"Kafka, medians of {ROUNDS} interleaved rounds (>= {GOAL} meets the goal)"
            ),
            "kafka_vs_local": ratio(ours, local),
            "throughput": tput,
            "latency": lat,
            "latency_p99_goal_ms": LAT_GOAL_MS,
            **single,
            **rec,
            "producers": PRODUCERS,
            "in_flight": IN_FLIGHT,
            "batch": BATCH,
            "seconds": SECONDS,
            "rounds": ROUNDS,
            "peer_settings": PEER_SETTINGS,
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": cpu_pressure(),
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    import uvloop

    uvloop.run(run())
