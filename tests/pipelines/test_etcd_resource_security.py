"""``EtcdResource`` on an etcd with TLS and auth: its own connection and the environment it
hands to the Spark job (read back by ``EtcdSecurity.from_env``, as the job does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from danube_ingest.metadata.etcd_security import ENV, EtcdSecurity
from pipelines.resources import EtcdResource
from tests.certs import Certs
from tests.secure_etcd import PASSWORD, PREFIX, USER, secure_etcd

pytestmark = [pytest.mark.etcd]


async def test_resource_connects_and_passes_security_on(
    certs: Certs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    with secure_etcd(certs) as etcd:
        resource = EtcdResource(
            endpoints=etcd.endpoint,
            prefix=PREFIX,
            ca_file=str(certs.ca),
            cert_file=str(certs.client_cert),
            key_file=str(certs.client_key),
            user=USER,
            password_file=str(password_file),
        )
        async with resource.connect() as (kv, _keys):
            await kv.put(f"{PREFIX}/from-dagster", b"1")
        env = resource.child_env()
        assert PASSWORD not in env.values()
        assert env[ENV["password_file"]] == str(password_file)
        child = EtcdSecurity.from_env(env)
        assert (child.user, child.password, child.ca_file) == (USER, PASSWORD, certs.ca)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        again = EtcdResource.from_env()
        async with again.connect() as (kv, _keys):
            assert await kv.get(f"{PREFIX}/from-dagster") is not None
