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

from danube_ingest.cli import admin, broker, client, objects, wal
from danube_ingest.errors import DanubeIngestError

_GROUPS = (broker, client, admin, wal, objects)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="danube-ingest",
        description="Danube-compatible streaming ingest: WAL first, object storage behind it.",
    )
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ERROR)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in _GROUPS:
        group.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        code: int = args.handler(args)
    except DanubeIngestError as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
