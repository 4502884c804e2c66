"""Where the danube-client publish -> delivery tail comes from: the same paced workload against
several servers, in interleaved windows of one run.

Run: ``.venv/bin/python benchmarks/e2e_variants.py`` (~2.5 min on 2 cores). ``--rounds N``,
``--seconds S`` (per window), ``--only NAME,...`` pick fewer.

The workload, client and measurement are ``e2e_latency.py``'s (danube-client 0.5 in this
process, one producer starting a send every millisecond, one Exclusive consumer acking every
message; latency = receive - send, same clock). Each server gets its own client connection,
producer and consumer; every round runs one window per server, the order reversed every other
round, so outside load falls on all of them alike.

Servers:

* ``relay``: the no-op server of ``publish_danube_client.py`` (every SendMessage is copied into
  the subscription's stream from memory; acks are answered and forgotten): what gRPC and
  danube-client cost on this machine.
* ``relay+NNNus``: the same relay spending NNN µs of CPU in a busy loop on its event-loop thread
  in every SendMessage (the GIL held): a relay that costs as much CPU per message as the
  broker, with nothing else of the broker (no WAL thread, no dispatch).
* ``memory``, ``never``, ``always``: the real broker (``storage.mode: memory``; ``local_only``
  with ``storage.wal.fsync: never``; and with the default ``fsync: always``, the goal's
  configuration).

Per server and window: e2e and publish p50 / p99; the server's CPU per message (all threads and
its event-loop thread alone); how long its loop thread waited for a CPU (ms per s); its context
switches per message (voluntary: a thread went to sleep, waiting for something; involuntary: a
thread was preempted); and how many of the machine's CPUs were busy over the window
(``/proc/stat``; steal too).

Main figure (``value``): the median over windows of the ``always`` broker's e2e p99;
``baseline`` the same for ``relay``, ``ratio`` = value / baseline (lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from _common import bench_dir, emit, machine, median, percentile, ratio, say, warn_if_busy
from e2e_latency import GOAL_P99_MS, RATE, STORAGE_YAML, Usage, close_pair, open_pair, paced
from publish_danube_client import BrokerChild, NoopServerProcess, proc_cpu

WARMUP = 2.0
DRAIN_TIMEOUT = 3.0
#: The relays' extra CPU per SendMessage, µs (the broker's loop thread spends ~250-300 µs more
#: per message than the relay's at 1,000 msg/s).
BURNS = (250, 450)
SERVERS = ("relay", *(f"relay+{b}us" for b in BURNS), "memory", "never", "always")


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of all threads of ``pid`` so far."""
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except OSError:
            pass  # a thread that ended
    return vol, invol


class Server:
    """One server of the run, its client objects and its per-window figures."""

    def __init__(self, name: str, process: BrokerChild | NoopServerProcess) -> None:
        self.name = name
        self.process = process
        self.pair: tuple[Any, ...] = ()
        self.windows: list[dict[str, float]] = []


def start_server(name: str, work: Path, etcd: str) -> BrokerChild | NoopServerProcess:
    if name.startswith("relay"):
        burn = int(name.removeprefix("relay+").removesuffix("us")) if "+" in name else 0
        return NoopServerProcess(work, burn_us=burn, name=name.replace("+", "-"))
    config = STORAGE_YAML[name].replace("/danube-bench", f"/danube-bench-{name}")
    return BrokerChild(work, etcd, broker_id=f"bench-{name}", config_yaml=config)


async def window(server: Server, rnd: int, seconds: float) -> dict[str, float]:
    process = server.process
    run = server.pair[3]
    pid = process.pid
    run.phase = rnd
    broker = process if isinstance(process, BrokerChild) else None
    use_window = Usage(pid, broker)
    loop0, switches0 = proc_cpu(pid, pid), context_switches(pid)
    await paced(RATE, seconds, run.fire)
    loop1, switches1 = proc_cpu(pid, pid), context_switches(pid)
    messages = int(RATE * seconds)
    use = use_window.done(messages)
    drained = await run.drain(rnd, DRAIN_TIMEOUT)
    e2e, pub = run.e2e.get(rnd, []), run.publish.get(rnd, [])
    return {
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "publish_p50_ms": percentile(pub, 50),
        "publish_p99_ms": percentile(pub, 99),
        "cpu_us_per_msg": use["broker"] * seconds / messages * 1e6,
        "loop_cpu_us_per_msg": (loop1 - loop0) / messages * 1e6,
        "loop_runq_ms_per_s": use["server_runq_ms_per_s"],
        "voluntary_cs_per_msg": (switches1[0] - switches0[0]) / messages,
        "involuntary_cs_per_msg": (switches1[1] - switches0[1]) / messages,
        "machine_busy_cpus": use["machine_busy_cpus"],
        "machine_steal_cpus": use["machine_steal_cpus"],
        "client_cpu_share": use["client"],
        "drained": float(drained),
    }


async def bench(servers: list[Server], rounds: int, seconds: float) -> None:
    for server in servers:
        server.pair = await open_pair(server.process.url)
        run = server.pair[3]
        # One flag per sequence number this run sends (e2e_latency sizes it for its own run).
        run.seen = bytearray(int(RATE * (WARMUP + rounds * seconds)) + 1000)
        server.pair = (*server.pair, asyncio.create_task(run.consume()))
    try:
        for server in servers:
            run = server.pair[3]
            run.phase = -1
            await paced(RATE, WARMUP, run.fire)
            await run.drain(-1, DRAIN_TIMEOUT)
        for rnd in range(rounds):
            for server in servers if rnd % 2 == 0 else servers[::-1]:
                w = await window(server, rnd, seconds)
                server.windows.append(w)
                say(
                    f"  round {rnd + 1} {server.name:>12}: e2e p50 {w['e2e_p50_ms']:.2f} p99 "
                    f"{w['e2e_p99_ms']:.2f} ms, publish p99 {w['publish_p99_ms']:.2f} ms; CPU "
                    f"{w['cpu_us_per_msg']:.0f} µs/msg (loop {w['loop_cpu_us_per_msg']:.0f}); "
                    f"loop waited {w['loop_runq_ms_per_s']:.0f} ms/s; context switches "
                    f"{w['voluntary_cs_per_msg']:.1f} + {w['involuntary_cs_per_msg']:.1f} /msg; "
                    f"machine {w['machine_busy_cpus']:.2f} CPUs busy"
                )
    finally:
        for server in servers:
            client, producer, consumer, run, task = server.pair
            await close_pair(client, producer, consumer, run, task)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0, help="per window")
    parser.add_argument("--only", default=",".join(SERVERS), help="servers, comma-separated")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        parser.error(f"unknown server(s) {unknown}; choose from {', '.join(SERVERS)}")
    t_start = time.perf_counter()
    say(
        f"e2e_variants: {RATE} msg/s through danube-client, {args.rounds} rounds of "
        f"{args.seconds:g} s per server ({', '.join(names)}), interleaved"
    )
    load_start = warn_if_busy("start")
    from danube_ingest.testing import LocalEtcd

    with bench_dir("e2e-variants") as work, LocalEtcd() as etcd:
        servers = [Server(n, start_server(n, work, etcd.endpoint)) for n in names]
        try:
            for server in servers:
                server.process.start()
            asyncio.run(bench(servers, args.rounds, args.seconds))
            cpu_total = {s.name: proc_cpu(s.process.pid) for s in servers}
        finally:
            for server in servers:
                server.process.stop()

    per_server: dict[str, Any] = {}
    for server in servers:
        ws = server.windows
        summary = {key: median([w[key] for w in ws]) for key in ws[0]}
        summary["e2e_p99_ms_windows"] = [w["e2e_p99_ms"] for w in ws]
        summary["windows_meeting_goal"] = sum(w["e2e_p99_ms"] <= GOAL_P99_MS for w in ws)
        summary["cpu_s_total"] = cpu_total[server.name]
        per_server[server.name] = summary
        say(
            f"{server.name:>12}: median of windows: e2e p50 {summary['e2e_p50_ms']:.2f} p99 "
            f"{summary['e2e_p99_ms']:.2f} ms ({summary['windows_meeting_goal']} of {len(ws)} "
            f"windows <= {GOAL_P99_MS:g} ms); CPU {summary['cpu_us_per_msg']:.0f} µs/msg (loop "
            f"{summary['loop_cpu_us_per_msg']:.0f}); loop waited "
            f"{summary['loop_runq_ms_per_s']:.0f} ms/s; context switches "
            f"{summary['voluntary_cs_per_msg']:.1f} + {summary['involuntary_cs_per_msg']:.1f} "
            f"/msg; machine {summary['machine_busy_cpus']:.2f} CPUs busy"
        )
    value = per_server.get("always", {}).get("e2e_p99_ms", float("nan"))
    baseline = per_server.get("relay", {}).get("e2e_p99_ms", float("nan"))
    emit(
        {
            "benchmark": "e2e_variants",
            "value": value,
            "unit": "ms",
            "baseline": baseline,
            "ratio": ratio(value, baseline),
            "ratio_meaning": (
                "median over windows of the e2e p99 through danube-client at 1,000 msg/s: the "
                "broker (fsync always) / the no-op relay, lower is better"
            ),
            "goal_p99_ms": GOAL_P99_MS,
            "rounds": args.rounds,
            "window_s": args.seconds,
            "servers": per_server,
            "load_start": load_start,
            "load_end": warn_if_busy("end"),
            "elapsed_s": time.perf_counter() - t_start,
            **machine(),
        }
    )


if __name__ == "__main__":
    main()
