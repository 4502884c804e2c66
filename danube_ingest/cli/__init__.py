"""The ``danube-ingest`` command line.

Each command group lives in its own module and registers its subcommands on the shared parser;
``main`` dispatches. Exit codes: 0 success, 1 the command found a problem (e.g. WAL corruption),
2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from danube_ingest.cli import (
    admin,
    bench,
    broker,
    brokers,
    client,
    cluster,
    dagster_ui,
    kafka,
    objects,
    retention,
    schemas,
    tables,
    wal,
)
from danube_ingest.errors import DanubeIngestError
from danube_ingest.observability.logs import formatter

_GROUPS = (
    broker,
    dagster_ui,
    kafka,
    client,
    bench,
    admin,
    schemas,
    brokers,
    wal,
    objects,
    retention,
    tables,
    cluster,
)
#: Long-running commands: their log lines are their output, so they log INFO by default.
_SERVERS = frozenset({"broker", "dev", "etcd", "kafka", "dagster"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="danube-ingest",
        description="Danube-compatible streaming ingest: WAL first, object storage behind it.",
    )
    parser.add_argument(
        "--log-level",
        help="logging level (DEBUG, INFO, WARNING, ERROR); default: INFO for the long-running "
        "commands (broker, dev, etcd, kafka), WARNING for the others",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more: -v logs INFO lines, -vv DEBUG (overridden by --log-level)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log line format: text, or json (one object per line, each key=value of the "
        "message a field of its own)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in _GROUPS:
        group.register(commands)
    return parser


def log_level(command: str, requested: str | None, verbose: int) -> int:
    """The logging level for ``command``: ``--log-level`` if given, else INFO (``-v``) or DEBUG
    (``-vv``), else INFO for the servers, whose log is their output, and WARNING for the
    one-shot commands, whose output is what they print."""
    if requested is not None:
        return int(getattr(logging, requested.upper(), logging.INFO))
    if verbose:
        return logging.DEBUG if verbose > 1 else logging.INFO
    return logging.INFO if command in _SERVERS else logging.WARNING


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(args.log_format))
    logging.basicConfig(
        level=log_level(args.command, args.log_level, args.verbose), handlers=[handler]
    )
    try:
        code: int = args.handler(args)
    except DanubeIngestError as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
