"""Draining a 1M-message backlog through the batch consumer, against Redis Streams.

Run: ``flock /tmp/danube-bench.lock .venv/bin/python benchmarks/consume_peers.py`` (no
arguments; ~2.5 min on 2 cores; ``CONSUME_N`` and ``CONSUME_ROUNDS`` shrink it for a try).

Setup, in one run: a local etcd and the real daemon in a child process (``BrokerChild``:
``storage.mode: wal_cloud`` with an fs object store, ``fsync: always``, cache budget
``storage.cache.max_bytes`` = ``topic_max_bytes`` = 256 MiB so a whole 1M backlog of one topic
fits, 16 MiB segments). Two topics of ``N`` 100-byte messages are published with the batch
``Producer``:

* ``/bench/objects``: published first; once its segments are uploaded (the manifest reaches
  ``N``) the control plane's prune mark lets the daemon's cleaner delete its WAL; then the
  daemon is restarted (SIGTERM, same data dir), which empties its cache: this topic is read
  **from objects** only;
* ``/bench/cache``: published after the restart, so its whole backlog is in the cache.

Cases, each a fresh subscription (Exclusive, ``start="earliest"``) drained by one
``danube_ingest.client.Consumer`` (``max_batch`` 1,000, each batch acked as a range once
received), rounds interleaved, medians reported:

* ``cache``: ``/bench/cache``, from the WAL cache;
* ``objects``: ``/bench/objects``, from objects (the WAL pruned beneath it);
* ``redis``: redis-server (Debian's, started here with ``appendonly yes``, ``appendfsync
  always``, in a temp dir, loopback) holding the same ``N`` 100-byte payloads in one stream
  (one field per entry), drained by a fresh consumer group with ``XREADGROUP COUNT 1000`` and
  ``XACK`` of the ids read, the ack of one batch pipelined with the read of the next (redis-py,
  ``redis.asyncio``; one round trip per 1,000 entries, like our consumer).

Memory: the daemon's RSS (``/proc/PID/status`` VmRSS, sampled every 50 ms) while a slow
consumer (one 1,000-message batch every 100 ms, 5 s) reads ``/bench/cache`` with both backlogs
stored, and the daemon's peak RSS since its restart (VmHWM), against the cache budget +
200 MiB; also VmRSS / RssAnon / RssFile after the publish, after the drains and after the slow
consumer.

Figures: msg/s of each case, daemon CPU seconds and client CPU seconds per case (redis-server's
CPU for ``redis``), CPU pressure (``/proc/pressure/cpu``) before and after.
"""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _common import MIB, bench_dir, emit, machine, median, ratio, say, warn_if_busy
from publish_danube_client import BrokerChild, proc_cpu

N = int(os.environ.get("CONSUME_N", 1_000_000))
ROUNDS = int(os.environ.get("CONSUME_ROUNDS", 3))
PAYLOAD = 100
BATCH = 1000
CACHE_BUDGET = 256 * MIB
CACHE, OBJECTS = "/bench/cache", "/bench/objects"
PREFIX = "/danube-bench-consume"


CONFIG = f"""\
etcd:
  prefix: {PREFIX}
storage:
  mode: wal_cloud
  cloud:
    backend: fs
    root: {{objects}}
  wal:
    fsync: always
    segment_bytes: 16MiB
    segment_seconds: 2
    retention:
      check_seconds: 0.5
  cache:
    max_bytes: {CACHE_BUDGET}
    topic_max_bytes: {CACHE_BUDGET}
"""


def rss(pid: int, field: str = "VmRSS") -> int:
    """Bytes of ``field`` (VmRSS, VmHWM) in /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def rss_split(pid: int) -> dict[str, float]:
    """MiB of VmRSS, RssAnon (heap) and RssFile (mapped files) of a process now."""
    return {f: rss(pid, f) / MIB for f in ("VmRSS", "RssAnon", "RssFile")}


class RssSampler:
    """The highest VmRSS of a process seen between ``start`` and ``stop`` (50 ms samples)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            self._stop.wait(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def publish(url: str, topic: str, n: int = N, size: int = PAYLOAD) -> float:
    """Publish ``n`` messages of ``size`` bytes (durable); msg/s."""
    from danube_ingest.client import Producer

    payload = b"x" * size
    start = time.perf_counter()
    async with Producer(url, topic, max_batch_messages=BATCH, max_in_flight=8) as producer:
        futures = [await producer.send(payload) for _ in range(n)]
        await asyncio.gather(*futures)
    return n / (time.perf_counter() - start)


async def drain_ours(url: str, topic: str, subscription: str, pid: int) -> dict[str, float]:
    from danube_ingest.client import Consumer

    cpu0, daemon0 = own_cpu(), proc_cpu(pid)
    start = time.perf_counter()
    got = 0
    async with Consumer(url, topic, subscription, start="earliest", max_batch=BATCH) as consumer:
        while got < N:
            batch = await consumer.receive(timeout=60)
            got += len(batch.entries)
            consumer.ack(batch)
    elapsed = time.perf_counter() - start
    return {
        "msg_s": got / elapsed,
        "server_cpu_s": proc_cpu(pid) - daemon0,
        "client_cpu_s": own_cpu() - cpu0,
        "daemon_rss_mib": rss(pid) / MIB,
    }


async def slow_consumer(url: str, pid: int) -> dict[str, float]:
    """RSS while a consumer takes one batch per 100 ms for 5 s (the backlogs stay stored)."""
    from danube_ingest.client import Consumer

    with RssSampler(pid) as sampler:
        async with Consumer(url, CACHE, "slow", start="earliest", max_batch=BATCH) as consumer:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                batch = await consumer.receive(timeout=60)
                consumer.ack(batch)
                await asyncio.sleep(0.1)
    return {"slow_consumer_rss_mib": sampler.peak / MIB}


class RedisServer:
    def __init__(self, work: Path) -> None:
        from danube_ingest.testing import free_port

        self.port = free_port()
        self.dir = work / "redis"
        self.dir.mkdir()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ]
        with (self.dir / "redis.log").open("wb") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


async def redis_fill(client: Any) -> float:
    """The backlog, written with ``appendfsync no`` (setup, not measured; 4x quicker here),
    then ``always`` again for the drain (whose group reads and acks go to the AOF)."""
    payload = b"x" * PAYLOAD
    await client.config_set("appendfsync", "no")
    start = time.perf_counter()
    for _ in range(0, N, BATCH):
        pipe = client.pipeline(transaction=False)
        for _ in range(BATCH):
            pipe.xadd("stream", {"d": payload})
        await pipe.execute()
    rate = N / (time.perf_counter() - start)
    await client.config_set("appendfsync", "always")
    return rate


async def drain_redis(client: Any, group: str, pid: int) -> dict[str, float]:
    await client.xgroup_create("stream", group, id="0")
    cpu0, server0 = own_cpu(), proc_cpu(pid)
    start = time.perf_counter()
    got = 0
    ids: list[bytes] = []
    while got < N:
        pipe = client.pipeline(transaction=False)
        if ids:
            pipe.xack("stream", group, *ids)
        pipe.xreadgroup(group, "c", {"stream": ">"}, count=BATCH)
        answers = await pipe.execute()
        read = answers[-1]
        entries = read[0][1] if read else []
        ids = [entry_id for entry_id, _fields in entries]
        got += len(entries)
    await client.xack("stream", group, *ids)
    elapsed = time.perf_counter() - start
    return {
        "msg_s": got / elapsed,
        "server_cpu_s": proc_cpu(pid) - server0,
        "client_cpu_s": own_cpu() - cpu0,
    }


async def wait_uploaded(etcd_endpoint: str, topic: str) -> None:
    """Until the manifest covers the topic's N messages; then mark them prunable and wait for
    the daemon to delete their segments."""
    from danube_ingest.metadata import EtcdKV, Keys
    from danube_ingest.metadata.manifest import Manifest
    from danube_ingest.metadata.marks import PruneMarks

    kv = await EtcdKV.connect([etcd_endpoint])
    keys = Keys(PREFIX)
    try:
        manifest = Manifest(kv, keys)
        deadline = time.monotonic() + 90
        while await manifest.end_offset(topic) < N:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic} not uploaded within 90 s")
            await asyncio.sleep(0.2)
        await PruneMarks(kv, keys).set_mark("bench-broker", "r0", topic, N)
    finally:
        await kv.close()


async def wait_pruned(broker: BrokerChild) -> None:
    deadline = time.monotonic() + 60
    while "wal segment deleted" not in broker.log_path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no WAL segment pruned within 60 s; see {broker.log_path}")
        await asyncio.sleep(0.2)


async def run() -> None:
    import redis.asyncio as aioredis

    from danube_ingest.testing import LocalEtcd

    before = warn_if_busy("start")
    say(f"consume_peers: N={N:,} messages of {PAYLOAD} B per backlog, {ROUNDS} rounds")
    with bench_dir("consume") as work, LocalEtcd() as etcd:
        broker = BrokerChild(
            work, etcd.endpoint, config_yaml=CONFIG.format(objects=work / "objects")
        )
        server = RedisServer(work)
        broker.start()
        server.start()
        client = aioredis.Redis(port=server.port)
        try:
            for _ in range(100):
                try:
                    await client.ping()
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            rates = {"publish_objects": await publish(broker.url, OBJECTS)}
            await wait_uploaded(etcd.endpoint, OBJECTS)
            await wait_pruned(broker)
            # A restart empties the cache: what is left of /bench/objects is in objects only.
            broker.stop()
            broker.start()
            rates["publish_cache"] = await publish(broker.url, CACHE)
            rss_points = {"after_publish": rss_split(broker.pid)}
            rates["redis_fill"] = await redis_fill(client)
            for key, value in rates.items():
                say(f"  {key}: {value:,.0f} msg/s")
            results: dict[str, list[dict[str, float]]] = {"cache": [], "objects": [], "redis": []}
            for r in range(ROUNDS):
                cases = [
                    ("cache", drain_ours(broker.url, CACHE, f"c{r}", broker.pid)),
                    ("objects", drain_ours(broker.url, OBJECTS, f"o{r}", broker.pid)),
                    ("redis", drain_redis(client, f"g{r}", server.process.pid)),  # type: ignore[union-attr]
                ]
                # Interleaved, in a rotating order, so drift in outside load hits every case.
                for name, case in cases[r % 3 :] + cases[: r % 3]:
                    figure = await case
                    results[name].append(figure)
                    say(
                        f"  round {r} {name}: {figure['msg_s']:,.0f} msg/s, server CPU "
                        f"{figure['server_cpu_s']:.2f} s, client CPU {figure['client_cpu_s']:.2f} s"
                        f", daemon RSS {rss(broker.pid) / MIB:.0f} MiB"
                    )
            rss_points["after_drains"] = rss_split(broker.pid)
            memory: dict[str, Any] = await slow_consumer(broker.url, broker.pid)
            rss_points["after_slow_consumer"] = rss_split(broker.pid)
            memory["rss_mib_at"] = rss_points
            memory["daemon_peak_rss_mib"] = rss(broker.pid, "VmHWM") / MIB
            memory["budget_mib"] = CACHE_BUDGET / MIB + 200
            say(f"  memory: {memory}")
        finally:
            await client.aclose()
            server.stop()
            broker.stop()
    after = warn_if_busy("end")
    med = {
        name: {key: median([f[key] for f in figures]) for key in figures[0]}
        for name, figures in results.items()
    }
    emit(
        {
            "benchmark": "consume_peers",
            "value": med["cache"]["msg_s"],
            "unit": "msg/s",
            "baseline": med["redis"]["msg_s"],
            "ratio": ratio(med["cache"]["msg_s"], med["redis"]["msg_s"]),
            "ratio_meaning": "1M-message backlog drained: batch Consumer from the WAL cache / "
            "Redis XREADGROUP COUNT 1000 + XACK, same run (goal >= 3)",
            "objects_msg_s": med["objects"]["msg_s"],
            "objects_vs_cache": ratio(med["objects"]["msg_s"], med["cache"]["msg_s"]),
            "objects_vs_redis": ratio(med["objects"]["msg_s"], med["redis"]["msg_s"]),
            "medians": med,
            "rounds": {name: [f["msg_s"] for f in figures] for name, figures in results.items()},
            "setup_msg_s": rates,
            **memory,
            "rss_within_budget": memory["daemon_peak_rss_mib"] <= memory["budget_mib"],
            "n": N,
            "payload_bytes": PAYLOAD,
            "load_before": before,
            "load_after": after,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    asyncio.run(run())
