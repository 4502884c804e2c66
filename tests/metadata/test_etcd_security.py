"""``EtcdKV`` on a real etcd with TLS (client certificates required) and auth enabled."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from danube_ingest.config import load_config
from danube_ingest.errors import ConfigError
from danube_ingest.metadata import (
    CommitStateUnknownError,
    EtcdKV,
    MetadataError,
    MetadataUnavailableError,
    Put,
)
from danube_ingest.metadata.etcd_security import ENV, EtcdSecurity
from danube_ingest.testing import LocalEtcd
from tests.certs import Certs
from tests.secure_etcd import PASSWORD, PREFIX, USER, secure_etcd, user_security

pytestmark = [pytest.mark.etcd]


@pytest.fixture(scope="module")
def tls_etcd(certs: Certs) -> Iterator[LocalEtcd]:
    with secure_etcd(certs) as etcd:
        yield etcd


async def test_tls_and_user_read_write_lease_and_watch(tls_etcd: LocalEtcd, certs: Certs) -> None:
    kv = await tls_etcd.connect(security=user_security(certs))
    try:
        watch = await kv.watch_prefix(f"{PREFIX}/w/")
        lease = await kv.grant_lease(5)
        await kv.put(f"{PREFIX}/w/a", b"1", lease=lease)
        result = await kv.txn([], [Put(f"{PREFIX}/w/b", b"2")])
        assert result.succeeded
        assert (await kv.get(f"{PREFIX}/w/a")).value == b"1"  # type: ignore[union-attr]
        events = [await asyncio.wait_for(watch.__anext__(), 5) for _ in range(2)]
        assert [e.kv.key for e in events] == [f"{PREFIX}/w/a", f"{PREFIX}/w/b"]
        await watch.cancel()
        await kv.refresh_lease(lease)
        await kv.revoke_lease(lease)
    finally:
        await kv.close()


async def test_wrong_password_is_a_clear_permanent_error(tls_etcd: LocalEtcd, certs: Certs) -> None:
    with pytest.raises(MetadataError, match=r"refused the credentials.*etcd\.password") as info:
        await tls_etcd.connect(security=user_security(certs, password="wrong"))
    assert not info.value.retriable


async def test_no_user_on_an_etcd_with_auth_is_refused(tls_etcd: LocalEtcd, certs: Certs) -> None:
    # etcd then takes the client certificate's name (danube-test-client) as the user, which
    # has no role: every operation is refused, naming what to grant.
    security = replace(user_security(certs), user=None, password=None)
    kv = await tls_etcd.connect(security=security)
    try:
        with pytest.raises(MetadataError, match="permission denied"):
            await kv.put(f"{PREFIX}/x", b"1")
    finally:
        await kv.close()


async def test_outside_the_users_prefix_is_permission_denied(
    tls_etcd: LocalEtcd, certs: Certs
) -> None:
    kv = await tls_etcd.connect(security=user_security(certs))
    try:
        with pytest.raises(MetadataError, match=r"permission denied.*etcd\.prefix"):
            await kv.put("/elsewhere/x", b"1")
    finally:
        await kv.close()


async def test_tls_without_client_certificate_is_refused(tls_etcd: LocalEtcd, certs: Certs) -> None:
    security = replace(user_security(certs), cert_file=None, key_file=None)
    with pytest.raises(MetadataUnavailableError):
        await tls_etcd.connect(security=security, timeout=2.0)


async def test_plain_http_to_a_tls_etcd_does_not_connect(tls_etcd: LocalEtcd) -> None:
    plain = tls_etcd.endpoint.replace("https://", "http://")
    with pytest.raises(MetadataUnavailableError):
        await EtcdKV.connect([plain], timeout=2.0)


async def test_unreadable_ca_file_names_the_file(tls_etcd: LocalEtcd, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(MetadataError, match=f"etcd.ca_file {missing}"):
        await tls_etcd.connect(security=EtcdSecurity(ca_file=missing))


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_expired_token_is_renewed_and_the_call_retriable(certs: Certs) -> None:
    """etcd forgets a token after --auth-token-ttl idle seconds (and on restart): the next
    call fails retriably and the client authenticates again, so a retry succeeds."""
    with secure_etcd(certs, extra_args=("--auth-token-ttl", "1")) as etcd:
        kv = await etcd.connect(security=user_security(certs))
        try:
            await kv.put(f"{PREFIX}/t", b"1")
            await asyncio.sleep(3)  # etcd checks token expiry about once a second
            with pytest.raises(MetadataUnavailableError, match="auth token") as info:
                await kv.put(f"{PREFIX}/t", b"2")
            assert info.value.retriable
            await kv.put(f"{PREFIX}/t", b"3")
            assert (await kv.get(f"{PREFIX}/t")).value == b"3"  # type: ignore[union-attr]
        finally:
            await kv.close()


def test_config_security_from_file(certs: Certs, tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    config = load_config(
        None,
        {
            "etcd.endpoints": "https://127.0.0.1:2379",
            "etcd.ca_file": str(certs.ca),
            "etcd.user": USER,
            "etcd.password_file": str(secret),
        },
    )
    security = EtcdSecurity.from_config(config.etcd)
    assert (security.user, security.password, security.ca_file) == (USER, PASSWORD, certs.ca)
    assert PASSWORD not in repr(security)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"etcd.ca_file": "/x.pem"}, "etcd.endpoints"),
        ({"etcd.user": "u"}, "etcd.password"),
        ({"etcd.password": "p"}, "etcd.user"),
        ({"etcd.cert_file": "/c.pem"}, "etcd.key_file"),
    ],
)
def test_config_refuses_half_settings(values: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, values)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_etcd_restart_forgets_tokens_and_the_client_recovers(certs: Certs) -> None:
    """An etcd restart drops every auth token: a call fails retriably and the client
    authenticates again, so a retry succeeds."""
    with secure_etcd(certs) as etcd:
        kv = await etcd.connect(security=user_security(certs))
        try:
            await kv.put(f"{PREFIX}/r", b"1")
            server = etcd.server
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)
            await asyncio.to_thread(server.wait_healthy)
            refusals: list[MetadataError] = []
            for _ in range(30):  # the channel may also need a moment to reconnect
                try:
                    await kv.put(f"{PREFIX}/r", b"3")
                    break
                except (MetadataUnavailableError, CommitStateUnknownError) as exc:
                    refusals.append(exc)
                    await asyncio.sleep(0.1)
            else:
                pytest.fail(f"no put succeeded after the restart: {refusals[-3:]}")
            assert any("auth token" in str(exc) for exc in refusals), refusals
            assert (await kv.get(f"{PREFIX}/r")).value == b"3"  # type: ignore[union-attr]
        finally:
            await kv.close()


def test_environment_wins_over_config_when_it_sets_anything(
    certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Parquet job started by Dagster gets endpoints and security from the environment;
    its broker YAML's etcd section applies only when the environment says nothing."""
    config = load_config(
        None,
        {"etcd.endpoints": "https://127.0.0.1:2379", "etcd.user": "yaml", "etcd.password": "p"},
    )
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert EtcdSecurity.from_env_or_config(config.etcd).user == "yaml"
    monkeypatch.setenv(ENV["user"], USER)
    monkeypatch.setenv(ENV["password"], PASSWORD)
    monkeypatch.setenv(ENV["ca_file"], str(certs.ca))
    security = EtcdSecurity.from_env_or_config(config.etcd)
    assert (security.user, security.password, security.ca_file) == (USER, PASSWORD, certs.ca)
