"""SIGKILL -> first acknowledged publish of a broker restarted at once on a 1 GiB WAL.

Run: ``.venv/bin/python benchmarks/restart_after_kill.py`` (no arguments; about 1 to 2 min on
2 cores, most of it writing the WAL; ~1.1 GiB of disk under the system temp dir).

Setup: a real local etcd (``LocalEtcd``). A ``TopicStore`` writes ``WAL_BYTES`` of entries
(100 B to 1 KiB, 8 topics, default 8 MiB segments, ``fsync="never"``, then closed) into the
broker's WAL directory. The broker runs in a child process, the ``danube-ingest broker``
command ``BrokerProcess`` runs, with a 10 s lease and a WAL retention above the WAL's size (so
nothing is pruned). Each round: the broker serves; a danube-client producer that stays
connected (the retry budget of ``tests/broker/test_restart.py``) has published; the broker is
killed with SIGKILL and, at once, started again with the same command and data directory (a
supervisor's restart).

Main figure (``value``): seconds from the SIGKILL to the first acknowledged publish of a client
that starts trying at the kill: every 20 ms a new gRPC channel sends ``CreateProducer`` and
``SendMessage`` (1 s deadline each); a fresh channel with a subchannel pool of its own per try,
so gRPC's reconnect backoff is not counted. Median of ``ROUNDS``. Goal: at most 2 s
(``baseline``); ``ratio`` = value / 2 s.

Extras: kill -> the port accepting TCP, kill -> the "serving on" line, the answers seen while
starting (gRPC codes), and kill -> acknowledgement of the send the connected producer issued
right after the kill (it includes gRPC's channel reconnect backoff: ~1 s after a failure).
Before the data-directory lock (issue 11), a restart waited up to the lease TTL (10 s here)
for its own previous registration to expire, and calls hung meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

from _common import MIB, bench_dir, emit, machine, median, ratio, say, warn_if_busy

WAL_BYTES = 1024 * MIB
TOPICS = 8
TASKS = 64
MIN_PAYLOAD = 100
MAX_PAYLOAD = 1024
ROUNDS = 3
LEASE_TTL = 10
GOAL_SECONDS = 2.0
TOPIC = "/default/restart-bench"
RETRY_BUDGET = {"max_retries": 120, "base_backoff_ms": 100, "max_backoff_ms": 500}


async def fill(wal_dir: Path) -> int:
    """Write ~``WAL_BYTES`` of payload into ``wal_dir``; return the bytes on disk."""
    from danube_ingest.store.topic_store import TopicStore
    from danube_ingest.wal.framing import Entry

    pool = os.urandom(2 * MAX_PAYLOAD * 64)
    store = await TopicStore.open(wal_dir, fsync="never")
    per_task = WAL_BYTES // TASKS

    async def writer(i: int) -> None:
        rng = random.Random(i)
        name = f"/default/fill-{i % TOPICS}"
        written = 0
        while written < per_task:
            size = rng.randint(MIN_PAYLOAD, MAX_PAYLOAD)
            start = rng.randrange(0, len(pool) - size)
            await store.append(name, Entry(pool[start : start + size]))
            written += size

    await asyncio.gather(*(writer(i) for i in range(TASKS)))
    await store.close()
    return sum(p.stat().st_size for p in wal_dir.rglob("*") if p.is_file())


async def try_publish(target: str, codes: dict[str, int]) -> bool:
    """One try on a fresh channel: create a producer and send one message."""
    import grpc
    from danube.proto import DanubeApi_pb2 as pb
    from danube.proto import DanubeApi_pb2_grpc as pb_grpc

    # A subchannel pool of its own: channels otherwise share one subchannel per address, and
    # with it the reconnect backoff (~1 s) of the tries that found the port closed.
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.ProducerServiceStub(channel)
        try:
            created = await stub.CreateProducer(
                pb.ProducerRequest(
                    request_id=1,
                    producer_name=f"probe-{time.monotonic_ns()}",
                    topic_name=TOPIC,
                    producer_access_mode=pb.Shared,
                    dispatch_strategy=pb.Reliable,
                ),
                timeout=1.0,
            )
            await stub.SendMessage(
                pb.StreamMessage(
                    request_id=1,
                    msg_id=pb.MsgID(producer_id=created.producer_id, topic_name=TOPIC),
                    payload=b"after the kill",
                    publish_time=1,
                    producer_name="probe",
                ),
                timeout=1.0,
            )
        except grpc.aio.AioRpcError as exc:
            answer = f"{exc.code().name}: {(exc.details() or '')[:70]}"
            codes[answer] = codes.get(answer, 0) + 1
            return False
    return True


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def one_round(broker: Any, producer: Any) -> dict[str, Any]:
    target = broker.url.removeprefix("http://")
    codes: dict[str, int] = {}
    marks: dict[str, float] = {}
    assert broker.process is not None
    broker.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    pending = asyncio.create_task(producer.send(b"sent at the kill", {}))
    await asyncio.to_thread(broker.process.wait)
    restart = asyncio.create_task(asyncio.to_thread(broker.start, 60.0))
    restart.add_done_callback(lambda _: marks.setdefault("serving", time.monotonic() - killed))
    while not await try_publish(target, codes):
        if "bound" not in marks and port_open(broker.port):
            marks["bound"] = time.monotonic() - killed
        await asyncio.sleep(0.02)
    acknowledged = time.monotonic() - killed
    marks.setdefault("bound", acknowledged)
    await restart
    await asyncio.wait_for(pending, 60)
    connected = time.monotonic() - killed
    return {
        "first_ack_s": acknowledged,
        "bound_s": marks["bound"],
        "serving_line_s": marks.get("serving", acknowledged),
        "connected_producer_ack_s": connected,
        "codes_while_starting": codes,
    }


async def bench(data_dir: Path, etcd_endpoint: str, wal_bytes: int) -> list[dict[str, Any]]:
    from danube import DanubeClientBuilder, DispatchStrategy, ProducerOptions

    from danube_ingest.testing import BrokerProcess

    broker = BrokerProcess(
        data_dir,
        etcd_endpoint,
        lease_ttl=LEASE_TTL,
        storage={
            "wal": {
                "segment_bytes": "8MiB",
                "segment_seconds": 10,
                "retention": {"max_bytes": f"{4 * wal_bytes // MIB}MiB"},
            }
        },
    )
    await asyncio.to_thread(broker.start, 120.0)
    results = []
    try:
        client = await DanubeClientBuilder().service_url(broker.url).build()
        producer = (
            client.new_producer()
            .with_topic(TOPIC)
            .with_name("connected")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .with_options(ProducerOptions(**RETRY_BUDGET))
            .build()
        )
        await producer.create()
        await producer.send(b"before", {})
        for i in range(ROUNDS):
            result = await one_round(broker, producer)
            say(
                f"  round {i + 1}: first ack {result['first_ack_s']:.2f}s, port bound "
                f"{result['bound_s']:.2f}s, serving line {result['serving_line_s']:.2f}s, "
                f"connected producer {result['connected_producer_ack_s']:.2f}s, answers while "
                f"starting {result['codes_while_starting']}"
            )
            results.append(result)
            await asyncio.sleep(1.0)
        await producer.close()
    finally:
        await asyncio.to_thread(broker.stop)
    return results


def main() -> None:
    from danube_ingest.testing import LocalEtcd

    say(
        f"restart_after_kill: SIGKILL -> first acknowledged publish, {WAL_BYTES // MIB} MiB WAL, "
        f"lease TTL {LEASE_TTL}s, {ROUNDS} rounds, {os.cpu_count()} CPUs"
    )
    load_start = warn_if_busy("start")
    with bench_dir("restart") as work, LocalEtcd() as etcd:
        data_dir = work / "data"
        started = time.monotonic()
        wal_bytes = asyncio.run(fill(data_dir / "wal"))
        say(f"  WAL written: {wal_bytes / MIB:,.0f} MiB in {time.monotonic() - started:.1f}s")
        results = asyncio.run(bench(data_dir, etcd.endpoint, wal_bytes))
    load_end = warn_if_busy("end")
    value = median([r["first_ack_s"] for r in results])
    say(f"median SIGKILL -> first acknowledged publish: {value:.2f}s (goal <= {GOAL_SECONDS}s)")
    emit(
        {
            "benchmark": "restart_after_kill",
            "value": value,
            "unit": "s",
            "baseline": GOAL_SECONDS,
            "ratio": ratio(value, GOAL_SECONDS),
            "ratio_meaning": "SIGKILL -> first acknowledged publish / the 2 s goal (<= 1 meets it)",
            "wal_mib": wal_bytes / MIB,
            "lease_ttl_s": LEASE_TTL,
            "bound_s": median([r["bound_s"] for r in results]),
            "serving_line_s": median([r["serving_line_s"] for r in results]),
            "connected_producer_ack_s": median([r["connected_producer_ack_s"] for r in results]),
            "rounds": results,
            "load_start": load_start,
            "load_end": load_end,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
