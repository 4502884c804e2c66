"""Transport security of the gRPC port: TLS credentials and the secure-listen rule.

Rule: a broker serves plain gRPC only on a loopback address (``127.0.0.0/8``, ``::1``,
``localhost``) unless ``broker.allow_insecure`` says otherwise; anywhere else it needs
``broker.tls`` (cert_file + key_file) or refuses to start (``InsecureListenError``), so a
config copied from a laptop never exposes unencrypted traffic on a network by accident.
With ``broker.tls.client_ca_file`` clients' certificates are verified against that CA, and
with ``require_client_cert`` a client without one is refused in the TLS handshake (mutual TLS).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from danube_ingest.broker.errors import InsecureListenError, TlsSetupError
from danube_ingest.config.models import BrokerSection, TlsConfig

#: PEM markers checked before handing the files to gRPC, which reports a bad file only as
#: "Failed to bind to address" (indistinguishable from a port in use).
_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKER = b"PRIVATE KEY-----"


def listen_host(listen: str) -> str:
    """The host part of ``host:port`` (``[::1]:6650`` → ``::1``)."""
    host = listen.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only reaches this machine.

    Any other name counts as not loopback: what it resolves to may change.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(section: BrokerSection) -> None:
    """Raise ``InsecureListenError`` if ``section`` would serve plain gRPC beyond loopback."""
    if section.tls.enabled or section.allow_insecure or is_loopback(listen_host(section.listen)):
        return
    raise InsecureListenError(
        f"refusing to serve plain (unencrypted) gRPC on {section.listen}: it is not a loopback "
        "address. Set broker.tls.cert_file and broker.tls.key_file to serve TLS, listen on "
        "127.0.0.1, or set broker.allow_insecure: true if the network is trusted"
    )


def _read_pem(path: Path, key: str, marker: bytes, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsSetupError(
            f"cannot read {key} {path}: {exc.strerror or exc}; fix the path or the file's "
            "permissions"
        ) from exc
    if marker not in data:
        raise TlsSetupError(f"{key} {path} holds no PEM {what} (no '{marker.decode()}' line)")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """gRPC server credentials of ``tls`` (which must be enabled).

    Raises ``TlsSetupError`` naming the key and file when a file cannot be read or is not
    PEM of the right kind. Whether the key matches the certificate is found when binding.
    """
    assert tls.cert_file is not None and tls.key_file is not None
    cert = _read_pem(tls.cert_file, "broker.tls.cert_file", _CERT_MARKER, "certificate")
    key = _read_pem(tls.key_file, "broker.tls.key_file", _KEY_MARKER, "private key")
    roots = None
    if tls.client_ca_file is not None:
        roots = _read_pem(
            tls.client_ca_file, "broker.tls.client_ca_file", _CERT_MARKER, "certificate"
        )
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=roots,
        require_client_auth=tls.require_client_cert,
    )
