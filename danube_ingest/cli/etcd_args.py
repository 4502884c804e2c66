"""``--etcd-ca-file`` and friends: how commands that take ``--etcd`` reach a secured etcd.

Each option defaults to its ``DANUBE_INGEST_ETCD_*`` variable (``EtcdSecurity.from_env``), the
same ones the Dagster code location reads; the password comes only from a file or from
``DANUBE_INGEST_ETCD_PASSWORD`` (never from the command line, where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from danube_ingest.metadata.etcd_security import ENV, EtcdSecurity, read_password_file


def add_etcd_security(parser: argparse.ArgumentParser) -> None:
    """Add the etcd TLS and user options to ``parser``."""
    group = parser.add_argument_group(
        "etcd security", "TLS applies to https:// endpoints; see docs/security.md"
    )
    group.add_argument(
        "--etcd-ca-file", type=Path, help=f"CA of etcd's certificate (${ENV['ca_file']})"
    )
    group.add_argument(
        "--etcd-cert-file", type=Path, help=f"client certificate (${ENV['cert_file']})"
    )
    group.add_argument("--etcd-key-file", type=Path, help=f"its key (${ENV['key_file']})")
    group.add_argument("--etcd-user", help=f"etcd user (${ENV['user']})")
    group.add_argument(
        "--etcd-password-file",
        type=Path,
        help=f"file holding the user's password (${ENV['password_file']}, or the password "
        f"itself in ${ENV['password']})",
    )


def etcd_security(args: argparse.Namespace) -> EtcdSecurity:
    """The options of ``add_etcd_security`` over the environment's."""
    security = EtcdSecurity.from_env()
    password = security.password
    if args.etcd_password_file is not None:
        password = read_password_file(args.etcd_password_file)
    return replace(
        security,
        ca_file=args.etcd_ca_file or security.ca_file,
        cert_file=args.etcd_cert_file or security.cert_file,
        key_file=args.etcd_key_file or security.key_file,
        user=args.etcd_user or security.user,
        password=password,
    )
