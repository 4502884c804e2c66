"""Reliable publish throughput through the real danube-client, broker vs a no-op gRPC server.

Run: ``.venv/bin/python benchmarks/publish_danube_client.py`` (no arguments, ~45 s on 2 cores).

Setup: a real local etcd (``danube_ingest.testing.LocalEtcd``) and the real broker in a child
process: the ``danube-ingest broker`` command ``danube_ingest.testing.BrokerProcess`` runs, with
the daemon's default storage settings (``storage.wal.fsync: always``, 8 MiB segments, one
region) and ``os.fdatasync`` wrapped to count calls and time (``BrokerChild``). The client is
danube-client 0.5 from PyPI, in this process, on the default asyncio loop. Everything is on
loopback; the broker's WAL is in a ``tempfile`` directory.

Baseline: the **same client and workload** against a no-op server in another child process: a
``grpc.aio`` server with the broker's runtime (uvloop and the daemon's garbage-collection
settings, ``danube_ingest.runtime``) that implements the services a producer uses —
TopicLookup (``Connect`` to itself), TopicPartitions, CreateProducer, SendMessage (answers
``MessageResponse(request_id)`` at once, stores nothing) and HealthCheck. It is what the broker
would cost with an infinitely fast publish path, so ``ratio`` is the share of the gRPC/client
ceiling the broker keeps. (For ``e2e_latency.py`` it also relays: Subscribe, ReceiveMessages
and Ack, where every message a producer sends is handed at once to the streams subscribed to
its topic, from memory, and acks are answered and forgotten.)

Reference (``memory_*``): the same broker with ``storage.mode: memory`` (no WAL, nothing on
disk; its own child process and etcd prefix), same client and concurrent workload, in the same
rounds: the share of the ceiling the broker keeps before durability costs anything.

Workloads (100-byte payloads, ``DispatchStrategy.RELIABLE``, one topic):

* ``value`` / ``baseline``: ``PRODUCERS`` producers x ``TASKS_PER_PRODUCER`` tasks, each task
  looping ``await producer.send(payload)`` (64 sends in flight); acknowledged msg/s.
* ``seq_*``: one producer, one task, one send in flight; msg/s and per-send latency p50/p99.

Broker and no-op server run in rounds, interleaved and alternating which goes first (this
machine's speed drifts minute to minute); medians of ``ROUNDS`` windows are reported. CPU time
per message of the client process and of the server child (``/proc/PID/stat``) is reported too:
it is much less distorted by other load than msg/s. After each round, 100 raw 116-byte
``os.write`` + ``os.fdatasync`` calls on the WAL's disk (``disk_*``) show how fast the disk syncs
at that moment (other processes' fsyncs slow it down).

Hidden child mode (used by this script and ``e2e_latency.py``): ``--noop-server PORT`` runs the
no-op server until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import bench_dir, emit, machine, median, percentile, ratio, say, warn_if_busy

PAYLOAD_BYTES = 100
PAYLOAD = bytes(range(PAYLOAD_BYTES))
TOPIC = "/default/bench-publish"
PRODUCERS = 4
TASKS_PER_PRODUCER = 16
ROUNDS = 5
WARMUP = 0.3
CONC_SECONDS = 1.5
SEQ_SECONDS = 1.0
GOAL = 0.8
DISK_PROBES = 100

#: Message size limit of the no-op server, both directions: the broker's send limit
#: (``limits.max_payload_bytes``, 4,000,000 by default, + 64 KiB; ``broker.server`` accepts
#: larger requests so it can refuse oversized publishes itself). Irrelevant for 100-byte
#: payloads; set so that both servers are configured alike.
GRPC_MAX = 4_000_000 + 64 * 1024

#: Broker configuration: the daemon's defaults (fsync always, 8 MiB segments, one region, 10 s
#: segments), only the etcd prefix and storage mode spelled out. (``BrokerProcess`` writes a
#: test configuration with 1 MiB / 2 s segments instead.)
BROKER_YAML = """\
etcd:
  prefix: /danube-bench
storage:
  mode: local_only
  wal:
    fsync: always
"""

#: The reference broker: the same daemon with ``storage.mode: memory`` (no WAL, no disk; its own
#: etcd prefix, so the two brokers do not share topics).
MEMORY_BROKER_YAML = BROKER_YAML.replace("/danube-bench", "/danube-bench-memory").replace(
    "mode: local_only", "mode: memory"
)
assert MEMORY_BROKER_YAML != BROKER_YAML and "mode: memory" in MEMORY_BROKER_YAML

_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: Servers that also run the sequential (one send in flight) windows.
SEQ_SERVERS = ("broker", "noop")


# -- child processes -------------------------------------------------------------------------


def proc_cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) a process has used so far: all its threads, or thread
    ``tid`` of it alone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def proc_rss_mib(pid: int) -> float:
    """Peak resident set size (VmHWM) of a process, MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


#: Boot code of the broker child: ``danube-ingest broker`` (as ``BrokerProcess`` runs it) with
#: ``os.fdatasync`` wrapped to count calls and time spent into a 24-byte file the benchmark reads
#: (calls, total ns, calls >= 10 ms). Costs ~1 us per fdatasync; the WAL looks ``os.fdatasync``
#: up at call time.
_BROKER_BOOT = r"""
import mmap, os, struct, sys, time
fd = os.open(sys.argv.pop(1), os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 24)
stats = mmap.mmap(fd, 24)
state = [0, 0, 0]
sync, pack, clock = os.fdatasync, struct.Struct("<QQQ").pack_into, time.perf_counter_ns
def fdatasync(f):
    t = clock()
    try:
        sync(f)
    finally:
        d = clock() - t
        state[0] += 1
        state[1] += d
        state[2] += d >= 10_000_000
        pack(stats, 0, *state)
os.fdatasync = fdatasync
from danube_ingest.cli import main
sys.exit(main(sys.argv[1:]))
"""


class BrokerChild:
    """The real broker in a child process: the command ``BrokerProcess`` runs (``danube-ingest
    broker --config ... --listen ... --data-dir ... --etcd ... --broker-id ...``), with the
    daemon's default storage settings (``BROKER_YAML``) and an fdatasync counter (see
    ``_BROKER_BOOT``)."""

    def __init__(
        self,
        work: Path,
        etcd_endpoint: str,
        broker_id: str = "bench-broker",
        config_yaml: str = BROKER_YAML,
    ) -> None:
        from danube_ingest.testing import free_port

        self.config_yaml = config_yaml
        self.data_dir = work / broker_id
        self.etcd_endpoint = etcd_endpoint
        self.broker_id = broker_id
        self.port = free_port()
        self.log_path = work / f"{broker_id}.log"
        self.stats_path = work / f"{broker_id}-fdatasync.bin"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "bench-broker.yml"
        config.write_text(self.config_yaml)
        command = [
            sys.executable,
            "-c",
            _BROKER_BOOT,
            str(self.stats_path),
            "broker",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            str(self.data_dir),
            "--etcd",
            self.etcd_endpoint,
            "--broker-id",
            self.broker_id,
            # A free port: two brokers of one run (and concurrent runs) must not share 9650.
            *("--metrics-listen", "127.0.0.1:0"),
        ]
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        _wait_ready(self.process, self.log_path, timeout, "broker")

    def fdatasync_stats(self) -> tuple[int, float, int]:
        """(fdatasync calls, seconds spent in them, calls that took >= 10 ms) so far."""
        try:
            calls, total_ns, slow = struct.unpack("<QQQ", self.stats_path.read_bytes()[:24])
        except (OSError, struct.error):
            return 0, 0.0, 0
        return calls, total_ns / 1e9, slow

    def stop(self) -> None:
        _terminate(self.process, 30)


def _wait_ready(process: subprocess.Popen[bytes], log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "serving on" in text:
            return
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode}):\n{text[-3000:]}")
        time.sleep(0.05)
    _terminate(process, 10)
    raise RuntimeError(f"{what} did not start within {timeout}s; see {log}")


def _terminate(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def disk_probe(directory: Path, count: int = DISK_PROBES) -> list[float]:
    """Seconds per 116-byte ``os.write`` + ``os.fdatasync`` on a new file in ``directory``
    (same disk as the broker's WAL): how fast the disk syncs right now."""
    path = directory / "disk-probe.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    data = bytes(116)
    out = []
    try:
        for _ in range(count):
            t = time.perf_counter()
            os.write(fd, data)
            os.fdatasync(fd)
            out.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    return out


class NoopServerProcess:
    """The no-op server (``--noop-server``) in a child process."""

    def __init__(self, log_dir: Path, burn_us: int = 0, name: str = "noop-server") -> None:
        """``burn_us``: CPU time each SendMessage spends in a busy loop on the event-loop
        thread before it answers (``e2e_variants.py``: a relay as costly as the broker)."""
        from danube_ingest.testing import free_port

        self.port = free_port()
        self.burn_us = burn_us
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 20.0) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--noop-server", str(self.port)]
        if self.burn_us:
            command += ["--burn-us", str(self.burn_us)]
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        _wait_ready(self.process, self.log_path, timeout, "no-op server")

    def stop(self) -> None:
        _terminate(self.process, 10)


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of CPU time on this thread (a busy loop; the GIL stays held)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _noop_services(url: str, burn_us: int = 0) -> list[tuple[Any, Callable[[Any, Any], None]]]:
    from danube.proto import DanubeApi_pb2 as pb
    from danube.proto import DanubeApi_pb2_grpc as pb_grpc

    producer_ids = itertools.count(1)
    consumer_ids = itertools.count(1)
    producer_topics: dict[int, str] = {}
    #: topic -> subscription -> the queue its ReceiveMessages stream serves (the newest
    #: Subscribe of a subscription takes it over, as an Exclusive reconnect would).
    streams: dict[str, dict[str, asyncio.Queue[Any]]] = {}
    consumers: dict[int, asyncio.Queue[Any]] = {}
    offsets = itertools.count()

    class Discovery(pb_grpc.DiscoveryServicer):  # type: ignore[misc]
        async def TopicLookup(self, request: Any, context: Any) -> Any:
            return pb.TopicLookupResponse(
                request_id=request.request_id,
                response_type=pb.TopicLookupResponse.Connect,
                connect_url=url,
                broker_url=url,
                proxy=False,
            )

        async def TopicPartitions(self, request: Any, context: Any) -> Any:
            return pb.TopicPartitionsResponse(
                request_id=request.request_id, partitions=[request.topic]
            )

    class Producers(pb_grpc.ProducerServiceServicer):  # type: ignore[misc]
        async def CreateProducer(self, request: Any, context: Any) -> Any:
            producer_id = next(producer_ids)
            producer_topics[producer_id] = request.topic_name
            return pb.ProducerResponse(
                request_id=request.request_id,
                producer_id=producer_id,
                producer_name=request.producer_name,
            )

        async def SendMessage(self, request: Any, context: Any) -> Any:
            if burn_us:
                _burn(burn_us / 1e6)
            subscribed = streams.get(producer_topics.get(request.msg_id.producer_id, ""))
            if subscribed:
                offset = next(offsets)
                for subscription, queue in subscribed.items():
                    out = pb.StreamMessage()
                    out.CopyFrom(request)
                    out.msg_id.topic_offset = offset
                    out.subscription_name = subscription
                    queue.put_nowait(out)
            return pb.MessageResponse(request_id=request.request_id)

    class Consumers(pb_grpc.ConsumerServiceServicer):  # type: ignore[misc]
        async def Subscribe(self, request: Any, context: Any) -> Any:
            consumer_id = next(consumer_ids)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            consumers[consumer_id] = queue
            streams.setdefault(request.topic_name, {})[request.subscription] = queue
            return pb.ConsumerResponse(
                request_id=request.request_id,
                consumer_id=consumer_id,
                consumer_name=request.consumer_name,
            )

        async def ReceiveMessages(self, request: Any, context: Any) -> Any:
            queue = consumers[request.consumer_id]
            while True:
                yield await queue.get()

        async def Ack(self, request: Any, context: Any) -> Any:
            return pb.AckResponse(request_id=request.request_id)

    class Health(pb_grpc.HealthCheckServicer):  # type: ignore[misc]
        async def HealthCheck(self, request: Any, context: Any) -> Any:
            return pb.HealthCheckResponse(status=pb.HealthCheckResponse.OK)

    return [
        (Discovery(), pb_grpc.add_DiscoveryServicer_to_server),
        (Producers(), pb_grpc.add_ProducerServiceServicer_to_server),
        (Consumers(), pb_grpc.add_ConsumerServiceServicer_to_server),
        (Health(), pb_grpc.add_HealthCheckServicer_to_server),
    ]


async def serve_noop(port: int, burn_us: int = 0) -> None:
    """Serve the no-op services on 127.0.0.1:PORT until SIGTERM/SIGINT (``burn_us``: see
    ``NoopServerProcess``)."""
    import grpc

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX),
            ("grpc.max_send_message_length", GRPC_MAX),
        ]
    )
    url = f"http://127.0.0.1:{port}"
    for servicer, add in _noop_services(url, burn_us):
        add(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound != port:
        raise SystemExit(f"could not bind 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"no-op danube server serving on {url}", flush=True)
    await stop.wait()
    await server.stop(0.5)


# -- client side -----------------------------------------------------------------------------


async def open_client(url: str) -> Any:
    from danube import DanubeClientBuilder

    return await DanubeClientBuilder().service_url(url).build()


async def close_client(client: Any, producers: list[Any]) -> None:
    for producer in producers:
        await producer.close()
    for conn in list(client.connection_manager._connections.values()):
        await conn.channel.close()


async def make_producers(client: Any, count: int, prefix: str) -> list[Any]:
    from danube import DispatchStrategy

    producers = []
    for i in range(count):
        producer = (
            client.new_producer()
            .with_topic(TOPIC)
            .with_name(f"{prefix}-{i}")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .build()
        )
        await producer.create()
        producers.append(producer)
    return producers


class Server:
    """What the client side needs to know about a server child."""

    def __init__(self, name: str, url: str, pid: int, fsync: Callable[[], Any] | None) -> None:
        self.name = name
        self.url = url
        self.pid = pid
        self.fsync = fsync


class Window:
    """Counts completed sends; measures rate, CPU (this process and the server child) and the
    broker's fdatasyncs over a window after a warm-up."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.done = 0
        self.measuring = False
        self.latencies: list[float] = []

    async def measure(self, warmup: float, seconds: float) -> dict[str, float]:
        await asyncio.sleep(warmup)
        pid = self.server.pid
        fsync = self.server.fsync
        f0 = fsync() if fsync else (0, 0.0, 0)
        c0, t0 = self.done, time.perf_counter()
        cpu0, scpu0 = time.process_time(), proc_cpu(pid)
        self.measuring = True
        await asyncio.sleep(seconds)
        self.measuring = False
        c1, t1 = self.done, time.perf_counter()
        cpu1, scpu1 = time.process_time(), proc_cpu(pid)
        f1 = fsync() if fsync else (0, 0.0, 0)
        n, wall = c1 - c0, t1 - t0
        syncs = f1[0] - f0[0]
        nan = float("nan")
        return {
            "rate": n / wall,
            "client_cpu_us_per_msg": (cpu1 - cpu0) / n * 1e6 if n else nan,
            "server_cpu_us_per_msg": (scpu1 - scpu0) / n * 1e6 if n else nan,
            "client_cpu_share": (cpu1 - cpu0) / wall,
            "server_cpu_share": (scpu1 - scpu0) / wall,
            "fdatasyncs_per_s": syncs / wall,
            "msgs_per_fdatasync": n / syncs if syncs else nan,
            "fdatasync_mean_ms": (f1[1] - f0[1]) / syncs * 1e3 if syncs else nan,
            "fdatasync_busy_share": (f1[1] - f0[1]) / wall,
            "fdatasyncs_over_10ms": f1[2] - f0[2],
        }


async def run_concurrent(producers: list[Any], server: Server) -> dict[str, float]:
    """``TASKS_PER_PRODUCER`` tasks per producer, each looping ``await producer.send``."""
    window = Window(server)
    stop = False

    async def worker(producer: Any) -> None:
        send = producer.send
        while not stop:
            await send(PAYLOAD)
            window.done += 1

    tasks = [asyncio.create_task(worker(p)) for p in producers for _ in range(TASKS_PER_PRODUCER)]
    try:
        res = await window.measure(WARMUP, CONC_SECONDS)
    finally:
        stop = True
        await asyncio.gather(*tasks)
    return res


async def run_sequential(producer: Any, server: Server) -> tuple[dict[str, float], list[float]]:
    """One task, one send in flight; also the latency of every send in the window."""
    window = Window(server)
    stop = False
    lat = window.latencies

    async def worker() -> None:
        send = producer.send
        clock = time.perf_counter
        while not stop:
            t = clock()
            await send(PAYLOAD)
            if window.measuring:
                lat.append(clock() - t)
            window.done += 1

    task = asyncio.create_task(worker())
    try:
        res = await window.measure(WARMUP, SEQ_SECONDS)
    finally:
        stop = True
        await task
    return res, lat


def fmt(res: dict[str, float]) -> str:
    text = (
        f"{res['rate']:,.0f} msg/s, CPU-us/msg client {res['client_cpu_us_per_msg']:.0f} server "
        f"{res['server_cpu_us_per_msg']:.0f} (CPU share {res['client_cpu_share']:.2f} / "
        f"{res['server_cpu_share']:.2f})"
    )
    if res["fdatasyncs_per_s"]:
        text += (
            f", {res['msgs_per_fdatasync']:.1f} msgs/fdatasync, fdatasync mean "
            f"{res['fdatasync_mean_ms']:.2f} ms ({res['fdatasyncs_over_10ms']} >= 10 ms)"
        )
    return text


async def bench(servers: dict[str, Server], probe_dir: Path) -> dict[str, Any]:
    """Interleaved rounds: every server's concurrent window (the first server goes first in
    even rounds, last in odd ones), then the sequential windows of "broker" and "noop"."""
    clients: dict[str, Any] = {}
    producers: dict[str, list[Any]] = {}
    for name, server in servers.items():
        clients[name] = await open_client(server.url)
        producers[name] = await make_producers(clients[name], PRODUCERS, f"bench-{name}")
    conc: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    seq: dict[str, list[dict[str, float]]] = {name: [] for name in SEQ_SERVERS}
    seq_lat: dict[str, list[float]] = {name: [] for name in SEQ_SERVERS}
    disk: list[float] = []
    try:
        for rnd in range(ROUNDS):
            order = list(servers) if rnd % 2 == 0 else list(reversed(servers))
            for name in order:
                res = await run_concurrent(producers[name], servers[name])
                conc[name].append(res)
                say(f"  round {rnd + 1} {name:6} {PRODUCERS}x{TASKS_PER_PRODUCER}: {fmt(res)}")
            for name in (n for n in order if n in SEQ_SERVERS):
                res, lat = await run_sequential(producers[name][0], servers[name])
                seq[name].append(res)
                seq_lat[name] += lat
                say(
                    f"  round {rnd + 1} {name:6} sequential: {fmt(res)}; send p50 "
                    f"{percentile(lat, 50) * 1e3:.3f} ms p99 {percentile(lat, 99) * 1e3:.3f} ms"
                )
            probe = disk_probe(probe_dir)
            disk += probe
            say(
                f"  round {rnd + 1} disk probe (116 B write + fdatasync): p50 "
                f"{percentile(probe, 50) * 1e3:.3f} ms p99 {percentile(probe, 99) * 1e3:.3f} ms"
            )
    finally:
        for name in servers:
            await close_client(clients[name], producers[name])
    return {"conc": conc, "seq": seq, "seq_lat": seq_lat, "disk": disk}


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: median([r[key] for r in runs]) for key in runs[0]}


def main() -> None:
    t_start = time.perf_counter()
    say(
        f"publish_danube_client: danube-client producer.send, {PAYLOAD_BYTES}-byte payloads, "
        f"reliable topic, broker fsync=always, {os.cpu_count()} CPUs"
    )
    say(
        f"  concurrent: {PRODUCERS} producers x {TASKS_PER_PRODUCER} tasks "
        f"({PRODUCERS * TASKS_PER_PRODUCER} sends in flight), {CONC_SECONDS}s windows; "
        f"sequential: 1 producer, 1 in flight, {SEQ_SECONDS}s windows; {ROUNDS} rounds"
    )
    say("  baseline: the same client and workload against a no-op gRPC server (child process)")
    load_start = warn_if_busy("start")
    from danube_ingest.testing import LocalEtcd

    with bench_dir("publish") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        memory = BrokerChild(
            work, etcd.endpoint, "bench-broker-memory", config_yaml=MEMORY_BROKER_YAML
        )
        noop = NoopServerProcess(work)
        try:
            broker.start()
            memory.start()
            noop.start()
            servers = {
                "broker": Server("broker", broker.url, broker.pid, broker.fdatasync_stats),
                "memory": Server("memory", memory.url, memory.pid, None),
                "noop": Server("noop", noop.url, noop.pid, None),
            }
            out = asyncio.run(bench(servers, work))
            broker_rss = proc_rss_mib(broker.pid)
            noop_rss = proc_rss_mib(noop.pid)
        finally:
            noop.stop()
            memory.stop()
            broker.stop()

    conc_b = summarize(out["conc"]["broker"])
    conc_n = summarize(out["conc"]["noop"])
    conc_m = summarize(out["conc"]["memory"])
    seq_b = summarize(out["seq"]["broker"])
    seq_n = summarize(out["seq"]["noop"])
    lat_b = out["seq_lat"]["broker"]
    lat_n = out["seq_lat"]["noop"]
    disk = out["disk"]
    value, baseline = conc_b["rate"], conc_n["rate"]
    main_ratio = ratio(value, baseline)
    seq_ratio = ratio(seq_b["rate"], seq_n["rate"])
    cpu_b = conc_b["server_cpu_us_per_msg"] + conc_b["client_cpu_us_per_msg"]
    cpu_n = conc_n["server_cpu_us_per_msg"] + conc_n["client_cpu_us_per_msg"]
    ms = 1000.0
    say(
        f"concurrent (median of {ROUNDS}): broker {value:,.0f} msg/s, no-op {baseline:,.0f} "
        f"msg/s, ratio {main_ratio:.3f} (goal >= {GOAL})"
    )
    say(
        f"  CPU-us/msg: broker child {conc_b['server_cpu_us_per_msg']:.0f} vs no-op child "
        f"{conc_n['server_cpu_us_per_msg']:.0f}; client {conc_b['client_cpu_us_per_msg']:.0f} vs "
        f"{conc_n['client_cpu_us_per_msg']:.0f}; (client+no-op)/(client+broker) "
        f"{ratio(cpu_n, cpu_b):.3f}; broker {conc_b['msgs_per_fdatasync']:.1f} msgs/fdatasync, "
        f"{conc_b['fdatasyncs_per_s']:,.0f} fdatasync/s"
    )
    say(
        f"  reference: the same broker with storage.mode memory (no WAL) "
        f"{conc_m['rate']:,.0f} msg/s, ratio {ratio(conc_m['rate'], baseline):.3f}, "
        f"{conc_m['server_cpu_us_per_msg']:.0f} CPU-us/msg: what the broker keeps of the "
        f"ceiling before durability costs anything"
    )
    say(
        f"sequential (median of {ROUNDS}): broker {seq_b['rate']:,.0f} msg/s, no-op "
        f"{seq_n['rate']:,.0f} msg/s, ratio {seq_ratio:.3f}; send latency broker p50 "
        f"{percentile(lat_b, 50) * ms:.3f} ms p99 {percentile(lat_b, 99) * ms:.3f} ms | no-op p50 "
        f"{percentile(lat_n, 50) * ms:.3f} ms p99 {percentile(lat_n, 99) * ms:.3f} ms | disk "
        f"write+fdatasync p50 {percentile(disk, 50) * ms:.3f} ms p99 "
        f"{percentile(disk, 99) * ms:.3f} ms"
    )
    result: dict[str, Any] = {
        "benchmark": "publish_danube_client",
        "value": value,
        "unit": "msg/s",
        "baseline": baseline,
        "ratio": main_ratio,
        "ratio_meaning": "value/baseline, higher is better (acknowledged reliable sends/s of "
        "danube-client against the broker, fsync always, vs the same client and workload against "
        "a no-op gRPC server; both servers in child processes)",
        "goal_ratio": GOAL,
        "goal_met": main_ratio >= GOAL,
        "payload_bytes": PAYLOAD_BYTES,
        "producers": PRODUCERS,
        "tasks_per_producer": TASKS_PER_PRODUCER,
        "in_flight": PRODUCERS * TASKS_PER_PRODUCER,
        "fsync": "always",
        "value_runs": [r["rate"] for r in out["conc"]["broker"]],
        "baseline_runs": [r["rate"] for r in out["conc"]["noop"]],
        "broker_cpu_us_per_msg": conc_b["server_cpu_us_per_msg"],
        "noop_cpu_us_per_msg": conc_n["server_cpu_us_per_msg"],
        "client_cpu_us_per_msg": conc_b["client_cpu_us_per_msg"],
        "client_cpu_us_per_msg_noop": conc_n["client_cpu_us_per_msg"],
        "cpu_ratio": ratio(cpu_n, cpu_b),
        "cpu_ratio_meaning": "(client + no-op server) CPU-us per msg / (client + broker) CPU-us "
        "per msg, concurrent case; higher is better; less sensitive to other load",
        "broker_cpu_share": conc_b["server_cpu_share"],
        "noop_cpu_share": conc_n["server_cpu_share"],
        "client_cpu_share": conc_b["client_cpu_share"],
        "broker_msgs_per_fdatasync": conc_b["msgs_per_fdatasync"],
        "broker_fdatasyncs_per_s": conc_b["fdatasyncs_per_s"],
        "broker_fdatasync_mean_ms": conc_b["fdatasync_mean_ms"],
        "broker_fdatasync_busy_share": conc_b["fdatasync_busy_share"],
        "memory_value": conc_m["rate"],
        "memory_ratio": ratio(conc_m["rate"], baseline),
        "memory_runs": [r["rate"] for r in out["conc"]["memory"]],
        "memory_cpu_us_per_msg": conc_m["server_cpu_us_per_msg"],
        "memory_client_cpu_us_per_msg": conc_m["client_cpu_us_per_msg"],
        "memory_meaning": "the same broker with storage.mode memory (no WAL, nothing on disk), "
        "same client and workload, concurrent case; memory_ratio = memory_value / baseline",
        "seq_value": seq_b["rate"],
        "seq_baseline": seq_n["rate"],
        "seq_ratio": seq_ratio,
        "seq_value_runs": [r["rate"] for r in out["seq"]["broker"]],
        "seq_baseline_runs": [r["rate"] for r in out["seq"]["noop"]],
        "seq_broker_cpu_us_per_msg": seq_b["server_cpu_us_per_msg"],
        "seq_noop_cpu_us_per_msg": seq_n["server_cpu_us_per_msg"],
        "seq_client_cpu_us_per_msg": seq_b["client_cpu_us_per_msg"],
        "seq_broker_fdatasync_mean_ms": seq_b["fdatasync_mean_ms"],
        "seq_p50_ms": percentile(lat_b, 50) * ms,
        "seq_p99_ms": percentile(lat_b, 99) * ms,
        "seq_max_ms": max(lat_b) * ms,
        "seq_noop_p50_ms": percentile(lat_n, 50) * ms,
        "seq_noop_p99_ms": percentile(lat_n, 99) * ms,
        "seq_latency_samples": len(lat_b),
        "disk_fdatasync_p50_ms": percentile(disk, 50) * ms,
        "disk_fdatasync_p99_ms": percentile(disk, 99) * ms,
        "broker_max_rss_mib": broker_rss,
        "noop_max_rss_mib": noop_rss,
        "elapsed_s": time.perf_counter() - t_start,
        "load_start": load_start,
        "load_end": warn_if_busy("end"),
        **machine(),
    }
    emit(result)


def _child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="no-op Danube server (child process mode)")
    parser.add_argument("--noop-server", type=int, metavar="PORT", required=True)
    parser.add_argument("--burn-us", type=int, default=0, metavar="US")
    args = parser.parse_args(argv)
    from danube_ingest.runtime import run_daemon, tune_gc

    tune_gc()  # the broker's runtime: its GC settings and (below) its event loop
    run_daemon(serve_noop(args.noop_server, args.burn_us))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _child_main(sys.argv[1:])
    else:
        main()
