"""A real etcd with TLS on its client port (client certificates required) and auth enabled,
for the tests of ``EtcdSecurity`` and of brokers on a secured etcd.

Users: ``root`` (password ``ROOT_PASSWORD``) and ``USER`` (password ``PASSWORD``), whose only
role may read and write keys under ``PREFIX`` — what a broker with ``etcd.prefix: /secure``
needs, and nothing else.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.server import EtcdServerTls, find_etcd_binary
from danube_ingest.testing import LocalEtcd
from tests.certs import Certs

USER = "danube"
PASSWORD = "s3cret-pw"
ROOT_PASSWORD = "root-pw"
PREFIX = "/secure"


def etcdctl(etcd: LocalEtcd, certs: Certs, *args: str) -> str:
    """Run etcdctl (shipped beside the etcd binary) against ``etcd`` as root with the
    server's certificate (which allows client authentication)."""
    binary = find_etcd_binary().with_name("etcdctl")
    command = [
        str(binary),
        f"--endpoints={etcd.endpoint}",
        f"--cacert={certs.ca}",
        f"--cert={certs.server_cert}",
        f"--key={certs.server_key}",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
    return done.stdout


def user_security(certs: Certs, *, password: str = PASSWORD) -> EtcdSecurity:
    """TLS with the client certificate, as ``USER``."""
    return EtcdSecurity(
        ca_file=certs.ca,
        cert_file=certs.client_cert,
        key_file=certs.client_key,
        user=USER,
        password=password,
    )


@contextmanager
def secure_etcd(
    certs: Certs, *, auth: bool = True, extra_args: tuple[str, ...] = ()
) -> Iterator[LocalEtcd]:
    """A started ``LocalEtcd`` with TLS (client certificates required) and, with ``auth``,
    auth enabled and the users of the module docstring."""
    tls = EtcdServerTls(
        cert_file=certs.server_cert,
        key_file=certs.server_key,
        ca_file=certs.ca,
        client_cert_auth=True,
    )
    with LocalEtcd(tls=tls, extra_args=extra_args) as etcd:
        if auth:
            etcdctl(etcd, certs, "user", "add", f"root:{ROOT_PASSWORD}")
            etcdctl(etcd, certs, "role", "add", "ingest")
            etcdctl(
                etcd,
                certs,
                "role",
                "grant-permission",
                "ingest",
                "--prefix=true",
                "readwrite",
                PREFIX,
            )
            etcdctl(etcd, certs, "user", "add", f"{USER}:{PASSWORD}")
            etcdctl(etcd, certs, "user", "grant-role", USER, "ingest")
            etcdctl(etcd, certs, "auth", "enable")
        yield etcd
