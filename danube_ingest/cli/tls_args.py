"""``--ca-file``, ``--cert-file``, ``--key-file``: client commands against a broker serving TLS.

An ``https://`` ``--service-url`` turns TLS on by itself (checked against the system's trusted
roots unless ``--ca-file`` names the CA); ``--ca-file`` or a client certificate turn it on for
any URL. Both clients are set up the same way: ours through ``TlsOptions``, danube-client
through ``with_tls`` / ``with_mtls``.
"""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

from danube import DanubeClientBuilder

from danube_ingest.client import ClientError, TlsOptions


def add_tls_options(parser: argparse.ArgumentParser) -> None:
    """Add the TLS options of a client command."""
    parser.add_argument(
        "--ca-file",
        type=Path,
        help="PEM CA of the broker's certificate: connect with TLS (an https:// service URL "
        "does too, with the system's trusted roots by default)",
    )
    parser.add_argument(
        "--cert-file", type=Path, help="PEM client certificate, for a broker requiring mutual TLS"
    )
    parser.add_argument("--key-file", type=Path, help="PEM private key of --cert-file")


def tls_options(args: argparse.Namespace) -> TlsOptions | None:
    """The TLS the options ask for; None: plain (unless the URL is ``https://``)."""
    if (args.cert_file is None) != (args.key_file is None):
        raise ClientError("--cert-file and --key-file go together: give both or neither")
    if args.ca_file is None and args.cert_file is None:
        return TlsOptions() if args.service_url.startswith("https://") else None
    return TlsOptions(ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)


def danube_builder(args: argparse.Namespace) -> DanubeClientBuilder:
    """A danube-client builder for ``--service-url`` with the TLS of the options."""
    builder = DanubeClientBuilder().service_url(args.service_url)
    tls = tls_options(args)
    if tls is None:
        return builder
    ca = tls.ca_file or ssl.get_default_verify_paths().cafile
    if ca is None:
        raise ClientError("TLS: no system CA bundle found; pass the broker's CA with --ca-file")
    if tls.cert_file is not None and tls.key_file is not None:
        return builder.with_mtls(str(ca), str(tls.cert_file), str(tls.key_file))
    return builder.with_tls(str(ca))
