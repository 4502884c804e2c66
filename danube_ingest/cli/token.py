"""``--token`` / ``--token-file`` (or ``DANUBE_INGEST_TOKEN``): the credentials client commands
send to a daemon with ``auth.enabled`` (a JWT or an API key; docs/security.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from danube_ingest.errors import ConfigError

#: Environment variable read when neither option is given.
TOKEN_ENV = "DANUBE_INGEST_TOKEN"


def add_token_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--token`` and ``--token-file`` to a client command."""
    parser.add_argument(
        "--token",
        help=f"JWT or API key sent as 'authorization: Bearer' (default: ${TOKEN_ENV}); "
        "with --client danube it also switches danube-client to TLS",
    )
    parser.add_argument("--token-file", type=Path, help="file holding the token")


def token_of(args: argparse.Namespace) -> str | None:
    """The token the command sends: ``--token``, else ``--token-file``'s content (stripped),
    else ``$DANUBE_INGEST_TOKEN``; ``None`` if none is given. ``ConfigError`` naming the file
    if it cannot be read."""
    if getattr(args, "token", None):
        return str(args.token)
    path: Path | None = getattr(args, "token_file", None)
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"--token-file: cannot read {path}: {exc.strerror}") from None
    return os.environ.get(TOKEN_ENV) or None
