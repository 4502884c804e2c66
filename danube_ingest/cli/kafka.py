"""``danube-ingest kafka``: a local single-node KRaft Kafka for development, run from the
project's Maven-fetched jars (``make setup``), as ``danube-ingest etcd`` runs etcd."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

from danube_ingest.kafka.server import DEFAULT_HEAP, DEFAULT_JARS_DIR, KafkaServer

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def register(commands: Any) -> None:
    kafka = commands.add_parser(
        "kafka",
        help="run a local Kafka for development",
        description=(
            "Run a single-node KRaft Kafka (broker and controller in one JVM) on 127.0.0.1 from "
            "the project's jars (fetched by `make setup`). The storage directory is formatted "
            "with a new cluster id on first use. Runs until Ctrl-C or SIGTERM."
        ),
    )
    kafka.add_argument("--data-dir", default="./data/kafka", help="Kafka data directory")
    kafka.add_argument("--port", type=_port, default=9092, help="client port (default 9092)")
    kafka.add_argument(
        "--controller-port", type=_port, help="KRaft controller port (default: --port + 1)"
    )
    kafka.add_argument(
        "--heap", default=DEFAULT_HEAP, help=f"JVM maximum heap, -Xmx (default {DEFAULT_HEAP})"
    )
    kafka.add_argument(
        "--jars-dir",
        default=str(DEFAULT_JARS_DIR),
        help="folder holding the Kafka jars (default: the checkout's .deps/kafka)",
    )
    kafka.add_argument(
        "--ready-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the node to answer before giving up (default 120)",
    )
    kafka.add_argument(
        "--fast",
        action="store_true",
        help="the test timings: short session and election timeouts, one partition for the "
        "internal topics, fewer threads (a throwaway node; the tests' container uses it)",
    )
    kafka.set_defaults(handler=_kafka)


def _port(text: str) -> int:
    """A TCP port number, 1..65535 (argparse reports anything else as a usage error)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def _kafka(args: argparse.Namespace) -> int:
    """Run the node until SIGINT or SIGTERM, then stop it (controlled shutdown); exit 0, also
    when the signal comes before the node answered.

    Missing jars or Java, or a port in use, raise ``KafkaServerError`` (exit 2) before anything
    is written to the data directory; so does a node that exits or does not answer in time.
    """
    server = KafkaServer(
        Path(args.data_dir),
        port=args.port,
        controller_port=args.controller_port,
        heap=args.heap,
        jars_dir=args.jars_dir,
        fast=args.fast,
    )
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    try:
        server.start()
        if server.wait_ready(args.ready_timeout, cancel=stop):
            print(
                f"kafka serving on {server.bootstrap_servers} (controller "
                f"{server.host}:{server.controller_port}, cluster {server.cluster_id()}, "
                f"data in {args.data_dir})",
                flush=True,
            )
            stop.wait()
    finally:
        server.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0
