"""Fixtures for security tests: signing keys, tokens, and a real broker (real etcd) with
``auth.enabled`` serving TLS (``broker.tls``, certificates from ``tests.certs``), reached the
documented way: danube-client with ``with_tls(ca)`` + ``with_token(token)``, our batch client
with ``tls=TlsOptions(ca_file=...)`` + ``token=``, raw gRPC stubs on a TLS channel.

``loopback_auth`` is the one broker without TLS (auth on plain loopback is allowed); only the
batch client and raw stubs can reach it with a token, since danube-client turns TLS on with one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from danube import DanubeClientBuilder

from danube_ingest.broker.server import Broker
from danube_ingest.client import TlsOptions
from danube_ingest.dispatch import ReliableSubscription
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import Records
from danube_ingest.security import hash_api_key
from danube_ingest.store import TopicStore
from danube_ingest.testing import broker_config, running_broker
from tests.broker.support import Clients, RawStubs
from tests.broker.test_tls import tls_overrides
from tests.certs import Certs

HMAC_SECRET = "test-only-hmac-secret-0123456789abcdef"
API_KEY = "svc-key-7d1c0b8e0f5e4a4f"

#: alice and mallory may both produce and consume in namespace shop (mallory is the attacker:
#: a legitimate user of the namespace trying to use alice's ids); writer may only produce.
PERMISSIONS: list[dict[str, Any]] = [
    {"principal": "alice", "resource": "shop", "actions": ["produce", "consume"]},
    {"principal": "mallory", "resource": "shop", "actions": ["produce", "consume"]},
    {"principal": "writer", "resource": "/shop/*", "actions": ["produce"]},
    {"role": "svc", "resource": "shop", "actions": ["produce", "consume"]},
    {"role": "ops", "resource": "*", "actions": ["admin"]},
]


@dataclass(frozen=True)
class Signing:
    """Key material: the broker trusts ``rsa``/``ec`` (public halves in ``public_key_files``)
    and ``HMAC_SECRET``; ``other_*`` are keys it does not know."""

    rsa: Any
    ec: Any
    other_rsa: Any
    other_ec: Any
    public_key_files: list[str]
    api_keys_file: str

    def token(
        self,
        sub: str = "alice",
        *,
        alg: str = "HS256",
        key: Any = None,
        expires_in: float | None = 300,
        **claims: Any,
    ) -> str:
        """A JWT for ``sub``, signed with ``key`` (default: the broker's key for ``alg``)."""
        if key is None:
            key = {"HS256": HMAC_SECRET, "RS256": self.rsa, "ES256": self.ec}[alg]
        payload: dict[str, Any] = {"sub": sub, "iat": int(time.time()), **claims}
        if expires_in is not None:
            payload["exp"] = int(time.time() + expires_in)
        return jwt.encode(payload, key, algorithm=alg)


def _public_pem(key: Any, path: Path) -> str:
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return str(path)


@pytest.fixture(scope="session")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Signing:
    root = tmp_path_factory.mktemp("keys")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    api_keys = root / "api_keys"
    api_keys.write_text(f"# service accounts\ningest-svc {hash_api_key(API_KEY)} svc\n")
    return Signing(
        rsa=rsa_key,
        ec=ec_key,
        other_rsa=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        other_ec=ec.generate_private_key(ec.SECP256R1()),
        public_key_files=[
            _public_pem(rsa_key, root / "rsa.pem"),
            _public_pem(ec_key, root / "ec.pem"),
        ],
        api_keys_file=str(api_keys),
    )


def auth_section(signing: Signing) -> dict[str, Any]:
    """The broker's ``auth`` section: HMAC, RSA and EC tokens, the API key, PERMISSIONS."""
    return {
        "enabled": True,
        "jwt": {"hmac_secret": HMAC_SECRET, "public_key_files": signing.public_key_files},
        "api_keys_file": signing.api_keys_file,
        "permissions": PERMISSIONS,
    }


def auth_overrides(signing: Signing) -> dict[str, Any]:
    """``auth_section`` as ``broker_config`` overrides."""
    return {
        "auth.enabled": True,
        "auth.jwt.hmac_secret": HMAC_SECRET,
        "auth.jwt.public_key_files": signing.public_key_files,
        "auth.api_keys_file": signing.api_keys_file,
        "auth.permissions": PERMISSIONS,
    }


@pytest.fixture
def etcd_prefix() -> str:
    return f"/t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def records(etcd_server: str, etcd_prefix: str) -> AsyncIterator[Records]:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    yield Records(kv, Keys(etcd_prefix))
    await kv.close()


class SecureBroker:
    """A broker with ``auth.enabled`` and TLS, and the ways clients reach it."""

    def __init__(self, broker: Broker, certs: Certs) -> None:
        self.broker = broker
        self.certs = certs
        self.tls = TlsOptions(ca_file=certs.ca)

    @property
    def url(self) -> str:
        return self.broker.url

    @property
    def store(self) -> TopicStore:
        assert self.broker.store is not None
        return self.broker.store

    def danube_builder(self, token: str | None = None) -> DanubeClientBuilder:
        """danube-client's builder as an application sets it up: ``with_tls(ca)``, then
        ``with_token(token)`` (if given)."""
        builder = DanubeClientBuilder().service_url(self.url).with_tls(str(self.certs.ca))
        return builder if token is None else builder.with_token(token)

    def clients(self, token: str | None) -> Clients:
        """``Clients`` whose danube-client uses TLS and sends ``token``."""
        return Clients(self.url, self.danube_builder(token))

    def channel(self, *, own_connection: bool = False) -> grpc.aio.Channel:
        """A TLS channel to the broker. ``own_connection``: on a connection of its own, as
        another client process would have (gRPC shares one connection between channels of a
        process that have the same target and options; another host never shares the
        victim's)."""
        options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        target = self.url.removeprefix("https://")
        return grpc.aio.secure_channel(target, self.tls.credentials(), options=options)

    @asynccontextmanager
    async def stubs(self, *, own_connection: bool = False) -> AsyncIterator[RawStubs]:
        """Raw stubs on ``channel(own_connection=...)``."""
        async with self.channel(own_connection=own_connection) as channel:
            yield RawStubs(channel)


@pytest.fixture
async def secure(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, signing: Signing, certs: Certs
) -> AsyncIterator[SecureBroker]:
    """A broker with ``auth.enabled`` (HMAC, RSA and EC tokens, an API key, PERMISSIONS) and
    ``broker.tls`` (the session's server certificate)."""
    overrides = {**auth_overrides(signing), **tls_overrides(certs)}
    config = broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix, overrides=overrides)
    async with running_broker(config) as broker:
        assert broker.url.startswith("https://")
        yield SecureBroker(broker, certs)


@pytest.fixture
async def loopback_auth(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, signing: Signing
) -> AsyncIterator[Broker]:
    """A broker with ``auth.enabled`` and no TLS, on loopback (allowed there)."""
    config = broker_config(
        tmp_path / "b1", etcd_server, prefix=etcd_prefix, overrides=auth_overrides(signing)
    )
    async with running_broker(config) as broker:
        assert broker.url.startswith("http://")
        yield broker


@pytest.fixture
async def open_broker(tmp_path: Path, etcd_server: str, etcd_prefix: str) -> AsyncIterator[Broker]:
    """A broker with auth off (the default)."""
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix)) as b:
        yield b


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` as danube-client sends it."""
    return (("authorization", f"Bearer {token}"),)


@asynccontextmanager
async def other_process_stubs(url: str) -> AsyncIterator[RawStubs]:
    """Plain-loopback raw stubs on a connection of their own (see ``SecureBroker.channel``)."""
    target = url.removeprefix("http://")
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        yield RawStubs(channel)


async def stored_payloads(store: TopicStore, topic: str) -> list[bytes]:
    """Every payload ``topic`` holds in the WAL, offset 0 on ([] for an unknown topic)."""
    info = store.info(topic)
    if info is None:
        return []
    reader = store.create_reader(topic, 0)
    got: list[bytes] = []
    try:
        async with asyncio.timeout(10):
            while len(got) < info.high_watermark:
                got += [entry.payload for entry in await reader.next_batch()]
    finally:
        reader.close()
    return got


def subscription(broker: Broker | SecureBroker, name: str, topic: str) -> ReliableSubscription:
    """The broker's reliable subscription ``name`` on ``topic`` (to read its cursor and how
    many of its messages are unacknowledged)."""
    if isinstance(broker, SecureBroker):
        broker = broker.broker
    assert broker.manager is not None
    sub = broker.manager._subscription_of(topic, name)
    assert isinstance(sub, ReliableSubscription)
    return sub
