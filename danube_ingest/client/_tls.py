"""TLS for the batch client's channel (``TlsOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from danube_ingest.client._errors import ClientError


@dataclass(frozen=True)
class TlsOptions:
    """How to reach a broker serving TLS (``broker.tls``).

    ``ca_file``: PEM CA certificates the broker's certificate is checked against (None: the
    system's roots). ``cert_file`` and ``key_file``: this client's certificate and key, for a
    broker that requires client certificates (mutual TLS).
    """

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials; ``ClientError`` naming a file that cannot be read."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ClientError("TLS: give both a client certificate and its key, or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA file"),
            private_key=_read(self.key_file, "key file"),
            certificate_chain=_read(self.cert_file, "certificate file"),
        )


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ClientError(f"TLS: cannot read the {what} {path}: {exc.strerror or exc}") from exc


def open_channel(url: str, tls: TlsOptions | None) -> grpc.aio.Channel:
    """A channel to the broker at ``url``: TLS when ``tls`` is given or the URL is
    ``https://`` (then with the system's roots unless ``tls`` names a CA), plain otherwise."""
    target = url.split("://", 1)[-1].rstrip("/")
    if tls is None and not url.startswith("https://"):
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, (tls or TlsOptions()).credentials())
