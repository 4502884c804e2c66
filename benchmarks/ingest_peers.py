"""Durable publish throughput of the batch path against Redis Streams, danube-client and the
design's ceiling, in one run (issue 14).

Run: ``flock /tmp/danube-bench.lock .venv/bin/python benchmarks/ingest_peers.py`` (~2 min on
2 cores; no arguments). Every system gets the same 100-byte payloads and the same promise: a
message is counted once the server has answered it, and it answers after fdatasync.

* ``redis``: redis-server (Debian, started here: ``--appendonly yes --appendfsync always
  --save ""``, a temp dir, loopback), 4 redis-py asyncio clients each sending pipelines of
  1,000 ``XADD``s (``transaction=False``), one stream per client.
* ``danube``: danube-client → our daemon (``BrokerChild`` of ``publish_danube_client.py``: the
  real broker in a child process, ``wal.fsync: always``), 4 producers x 16 tasks (64 sends in
  flight).
* ``ours``: ``danube_ingest.client.Producer`` → the same daemon, 4 producers, 1,000-message
  batches, 8 batches in flight each, messages handed over with ``send_many`` (1,000 at a time);
  ``ours_send``: the same with one ``send`` per message.
* ``ceiling``: the design's own ceiling: a minimal grpc.aio server (uvloop, a child process)
  with one unary method taking a batch of 1,000 length-prefixed messages as one bytes field,
  checking its CRC32C and group-committing it (one writer thread, writev + fdatasync),
  answered after the sync; driven by 4 channels x 8 in-flight batches built in Python.
* ``ours_1k`` / ``ours_64k``: ``Producer.send_many`` with 1 KiB and 64 KiB payloads (batches of
  at most 1 MiB), in MB/s of payload, against ``raw_disk``: 1 MiB ``write`` + ``fdatasync`` in
  a loop on the same disk.

Rounds are interleaved (every system once per round, ``ROUNDS`` rounds of ``SECONDS`` s each);
the figures are medians. ``--only ours,ceiling`` measures only the named systems (then no JSON
line: its ratios need them all); ``--rounds N`` sets the number of rounds. CPU: seconds of CPU
(user + system) per million messages of the client (this process) and of the server process,
per system. CPU pressure (PSI) is printed before and after and put in the JSON line. Ratios:
ours / Redis (goal ≥ 10), ours / danube-client (goal ≥ 100), ours / ceiling (goal ≥ 0.4).
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import bench_dir, cpu_pressure, emit, machine, median, ratio, say, warn_if_busy
from publish_danube_client import BrokerChild, _terminate, _wait_ready, proc_cpu

PAYLOAD = b"x" * 100
BATCH = 1000
CLIENTS = 4
IN_FLIGHT = 8
DANUBE_TASKS = 16
ROUNDS = 3
SECONDS = 2.0
#: Payload sizes for the MB/s figures, and the most bytes a batch of them carries.
BIG_PAYLOADS = {"1k": 1024, "64k": 64 * 1024}
BIG_BATCH_BYTES = 1024 * 1024
RAW_WRITE = 1024 * 1024

#: What a measurement returns: (messages acknowledged, payload bytes acknowledged).
Counted = tuple[int, int]


# -- the ceiling server (a child process: ``ingest_peers.py --ceiling-server PORT FILE``) ----


def ceiling_server(port: int, path: str) -> None:
    """One unary method ``/ceiling.Ceiling/Append``: request = CRC32C (u32 LE) of the rest,
    then length-prefixed messages; answered once written and fdatasync'ed by the one writer
    thread, which takes everything queued since its last sync as one group (writev)."""
    import grpc
    import uvloop
    from crc32c import crc32c

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        pending: queue.SimpleQueue[tuple[bytes, asyncio.Future[None]]] = queue.SimpleQueue()

        def done(futures: list[asyncio.Future[None]]) -> None:
            for future in futures:
                if not future.done():
                    future.set_result(None)

        def writer() -> None:
            while True:
                group = [pending.get()]
                while True:
                    try:
                        group.append(pending.get_nowait())
                    except queue.Empty:
                        break
                data = [body for body, _ in group]
                for i in range(0, len(data), 1024):  # (IOV_MAX)
                    os.writev(fd, data[i : i + 1024])
                os.fdatasync(fd)
                loop.call_soon_threadsafe(done, [future for _, future in group])

        threading.Thread(target=writer, daemon=True).start()

        async def append(request: bytes, context: Any) -> bytes:
            body = memoryview(request)[4:]
            if crc32c(body) != int.from_bytes(request[:4], "little"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "CRC32C mismatch")
            future: asyncio.Future[None] = loop.create_future()
            pending.put((request, future))
            await future
            return b""

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "ceiling.Ceiling", {"Append": grpc.unary_unary_rpc_method_handler(append)}
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print(f"serving on 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


class Child:
    """A server child process with its CPU time readable from /proc."""

    def __init__(self, command: list[str], log_path: Path, ready: str | None) -> None:
        with log_path.open("wb") as log_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
        if ready == "serving on":
            _wait_ready(self.process, log_path, 30, command[0])

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        _terminate(self.process, 10)


# -- the systems ------------------------------------------------------------------------------


async def run_for(seconds: float, workers: list[Callable[[float], Awaitable[Counted]]]) -> Counted:
    stop = time.monotonic() + seconds
    results = await asyncio.gather(*(w(stop) for w in workers))
    return sum(r[0] for r in results), sum(r[1] for r in results)


async def redis_rate(port: int, seconds: float) -> Counted:
    import redis.asyncio as aioredis

    clients = [aioredis.Redis(host="127.0.0.1", port=port) for _ in range(CLIENTS)]

    def worker(i: int) -> Callable[[float], Awaitable[Counted]]:
        async def go(stop: float) -> Counted:
            sent = 0
            while time.monotonic() < stop:
                pipe = clients[i].pipeline(transaction=False)
                for _ in range(BATCH):
                    pipe.xadd(f"bench-{i}", {"d": PAYLOAD})
                await pipe.execute()
                sent += BATCH
            return sent, sent * len(PAYLOAD)

        return go

    try:
        return await run_for(seconds, [worker(i) for i in range(CLIENTS)])
    finally:
        for client in clients:
            await client.aclose()


class DanubeClients:
    """danube-client producers on the broker, created once and reused across rounds."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None
        self.producers: list[Any] = []

    async def open(self) -> None:
        from danube import DanubeClientBuilder, DispatchStrategy

        self.client = await DanubeClientBuilder().service_url(self.url).build()
        for i in range(CLIENTS):
            producer = (
                self.client.new_producer()
                .with_topic(f"/default/peers-danube-{i}")
                .with_name(f"p{i}")
                .with_dispatch_strategy(DispatchStrategy.RELIABLE)
                .build()
            )
            await producer.create()
            self.producers.append(producer)

    async def rate(self, seconds: float) -> Counted:
        def worker(producer: Any) -> Callable[[float], Awaitable[Counted]]:
            async def go(stop: float) -> Counted:
                sent = 0
                while time.monotonic() < stop:
                    await producer.send(PAYLOAD, {})
                    sent += 1
                return sent, sent * len(PAYLOAD)

            return go

        return await run_for(
            seconds, [worker(p) for p in self.producers for _ in range(DANUBE_TASKS)]
        )

    async def close(self) -> None:
        for producer in self.producers:
            await producer.close()
        for connection in list(self.client.connection_manager._connections.values()):
            await connection.channel.close()


async def ours_rate(url: str, seconds: float, payload: bytes, *, bulk: bool, topic: str) -> Counted:
    """Acknowledged messages of CLIENTS producers sending for ``seconds``, then flushing."""
    from danube_ingest.client import Producer

    per_batch = min(BATCH, max(1, BIG_BATCH_BYTES // len(payload)))
    payloads = [payload] * per_batch

    def worker(i: int) -> Callable[[float], Awaitable[Counted]]:
        async def go(stop: float) -> Counted:
            async with Producer(
                url,
                f"{topic}-{i}",
                max_batch_messages=per_batch,
                max_batch_bytes=BIG_BATCH_BYTES,
                max_in_flight=IN_FLIGHT,
                max_buffered=per_batch * (IN_FLIGHT + 2),
            ) as producer:
                futures: list[asyncio.Future[Any]] = []
                while time.monotonic() < stop:
                    if bulk:
                        futures.append(await producer.send_many(payloads))
                    else:
                        for p in payloads:
                            futures.append(await producer.send(p))
                await producer.flush()
            if bulk:
                done = sum(sum(map(len, f.result())) for f in futures if f.exception() is None)
            else:
                done = sum(1 for f in futures if f.exception() is None)
            return done, done * len(payload)

        return go

    return await run_for(seconds, [worker(i) for i in range(CLIENTS)])


async def ceiling_rate(port: int, seconds: float) -> Counted:
    import grpc
    from crc32c import crc32c

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(CLIENTS)]
    prefix = len(PAYLOAD).to_bytes(4, "little")

    def worker(channel: Any) -> Callable[[float], Awaitable[Counted]]:
        append = channel.unary_unary("/ceiling.Ceiling/Append")

        async def go(stop: float) -> Counted:
            sent = 0
            while time.monotonic() < stop:
                body = b"".join([prefix + PAYLOAD for _ in range(BATCH)])
                await append(crc32c(body).to_bytes(4, "little") + body)
                sent += BATCH
            return sent, sent * len(PAYLOAD)

        return go

    try:
        return await run_for(seconds, [worker(c) for c in channels for _ in range(IN_FLIGHT)])
    finally:
        for channel in channels:
            await channel.close()


def raw_disk(path: Path, seconds: float) -> Counted:
    """1 MiB write + fdatasync in a loop: the disk's durable write rate (bytes)."""
    data = os.urandom(RAW_WRITE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    try:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            os.write(fd, data)
            os.fdatasync(fd)
            written += RAW_WRITE
    finally:
        os.close(fd)
        path.unlink()
    return 0, written


# -- the run ----------------------------------------------------------------------------------


def free_port() -> int:
    from danube_ingest.testing import free_port as free

    return free()


async def run(only: set[str] | None = None, rounds: int = ROUNDS) -> None:
    from danube_ingest.testing import LocalEtcd

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    pressure_before = cpu_pressure()
    warn_if_busy("start")
    rates: dict[str, list[float]] = {}
    mbps: dict[str, list[float]] = {}
    cpu_client: dict[str, list[float]] = {}
    cpu_server: dict[str, list[float]] = {}
    with bench_dir("peers") as work, LocalEtcd() as etcd:
        broker = BrokerChild(work, etcd.endpoint)
        broker.start()
        redis_port = free_port()
        (work / "redis").mkdir()
        redis = Child(
            [
                "redis-server",
                "--port",
                str(redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(work / "redis"),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            work / "redis.log",
            None,
        )
        ceiling_port = free_port()
        ceiling = Child(
            [
                sys.executable,
                __file__,
                "--ceiling-server",
                str(ceiling_port),
                str(work / "ceiling.log.bin"),
            ],
            work / "ceiling.log",
            "serving on",
        )
        danube = DanubeClients(broker.url)
        try:
            await _wait_redis(redis_port)
            await danube.open()
            systems: list[tuple[str, int, Callable[[], Awaitable[Counted]]]] = [
                ("redis", redis.pid, lambda: redis_rate(redis_port, SECONDS)),
                ("danube", broker.pid, lambda: danube.rate(SECONDS)),
                (
                    "ours_send",
                    broker.pid,
                    lambda: ours_rate(
                        broker.url, SECONDS, PAYLOAD, bulk=False, topic="/default/peers-send"
                    ),
                ),
                (
                    "ours",
                    broker.pid,
                    lambda: ours_rate(
                        broker.url, SECONDS, PAYLOAD, bulk=True, topic="/default/peers-bulk"
                    ),
                ),
                ("ceiling", ceiling.pid, lambda: ceiling_rate(ceiling_port, SECONDS)),
                *(
                    (
                        f"ours_{name}",
                        broker.pid,
                        _big(broker.url, size, f"/default/peers-{name}"),
                    )
                    for name, size in BIG_PAYLOADS.items()
                ),
                ("raw_disk", os.getpid(), lambda: _raw(work / "raw.bin")),
            ]
            if only is not None:
                systems = [system for system in systems if system[0] in only]
            for round_no in range(rounds):
                say(f"round {round_no + 1}/{rounds} (CPU pressure {cpu_pressure()}%)")
                for name, pid, measure in systems:
                    server0, client0, t0 = proc_cpu(pid), time.process_time(), time.perf_counter()
                    messages, nbytes = await measure()
                    elapsed = time.perf_counter() - t0
                    server_s = proc_cpu(pid) - server0
                    client_s = time.process_time() - client0
                    mbps.setdefault(name, []).append(nbytes / elapsed / 1e6)
                    if not messages:  # (raw_disk: bytes only)
                        say(f"  {name:>10}: {nbytes / elapsed / 1e6:>31.1f} MB/s")
                        continue
                    rates.setdefault(name, []).append(messages / elapsed)
                    cpu_client.setdefault(name, []).append(client_s / messages * 1e6)
                    cpu_server.setdefault(name, []).append(server_s / messages * 1e6)
                    say(
                        f"  {name:>10}: {messages / elapsed:>12,.0f} msg/s "
                        f"{nbytes / elapsed / 1e6:>8.1f} MB/s  CPU s per 1M msgs: client "
                        f"{client_s / messages * 1e6:.2f}, server {server_s / messages * 1e6:.2f}"
                    )
        finally:
            await danube.close()
            ceiling.stop()
            redis.stop()
            broker.stop()
    pressure_after = cpu_pressure()
    rate = {k: median(v) for k, v in rates.items()}
    if only is not None:
        for name in rate:
            say(
                f"median {name}: {rate[name]:,.0f} msg/s, CPU s per 1M msgs: client "
                f"{median(cpu_client[name]):.2f}, server {median(cpu_server[name]):.2f}"
            )
        if "ours" in rate and "ceiling" in rate:
            say(f"ours / ceiling: {ratio(rate['ours'], rate['ceiling']):.3f}")
        return
    mb = {k: median(v) for k, v in mbps.items()}
    emit(
        {
            "benchmark": "ingest_peers",
            "value": rate["ours"],
            "unit": "msg/s",
            "baseline": rate["redis"],
            "ratio": ratio(rate["ours"], rate["redis"]),
            "ratio_meaning": (
                "durable msg/s, danube_ingest.client Producer.send_many / Redis Streams "
                "(appendfsync always, pipelines of 1,000 XADDs), 100-byte payloads, same run"
            ),
            "msg_per_s": rate,
            "ours_vs_danube": ratio(rate["ours"], rate["danube"]),
            "ours_vs_ceiling": ratio(rate["ours"], rate["ceiling"]),
            "ours_send_vs_redis": ratio(rate["ours_send"], rate["redis"]),
            "mb_per_s": {k: mb[k] for k in ("ours_1k", "ours_64k", "raw_disk")},
            "ours_1k_vs_raw_disk": ratio(mb["ours_1k"], mb["raw_disk"]),
            "ours_64k_vs_raw_disk": ratio(mb["ours_64k"], mb["raw_disk"]),
            "cpu_s_per_1m_msgs_client": {k: median(v) for k, v in cpu_client.items()},
            "cpu_s_per_1m_msgs_server": {k: median(v) for k, v in cpu_server.items()},
            "rounds": ROUNDS,
            "seconds": SECONDS,
            "clients": CLIENTS,
            "in_flight": IN_FLIGHT,
            "batch": BATCH,
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": pressure_after,
            "machine": machine(),
        }
    )


def _big(url: str, size: int, topic: str) -> Callable[[], Awaitable[Counted]]:
    payload = os.urandom(size)
    return lambda: ours_rate(url, SECONDS, payload, bulk=True, topic=topic)


async def _raw(path: Path) -> Counted:
    return await asyncio.to_thread(raw_disk, path, SECONDS)


async def _wait_redis(port: int) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        for _ in range(200):
            try:
                await client.ping()
                return
            except OSError:
                await asyncio.sleep(0.05)
            except Exception as exc:
                if "Connection" not in type(exc).__name__:
                    raise
                await asyncio.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {port}")
    finally:
        await client.aclose()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ceiling-server":
        ceiling_server(int(sys.argv[2]), sys.argv[3])
    else:
        import argparse

        import uvloop

        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        parser.add_argument("--only", help="comma-separated systems to measure (default: all)")
        parser.add_argument("--rounds", type=int, default=ROUNDS)
        args = parser.parse_args()
        uvloop.run(run(set(args.only.split(",")) if args.only else None, args.rounds))
