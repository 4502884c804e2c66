"""Fixtures for security tests: signing keys, tokens, and a real broker (real etcd) with
``auth.enabled``, reached by the real danube-client and raw gRPC stubs over loopback.

danube-client switches to TLS whenever it has a token; until the broker's TLS listener is
merged these tests send its token over plain loopback gRPC (``token_client``), which exercises
exactly the same metadata the broker checks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import grpc
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from danube import DanubeClient, DanubeClientBuilder

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import Records
from danube_ingest.security import hash_api_key
from danube_ingest.testing import broker_config, running_broker
from tests.broker.support import Clients, RawStubs

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


def auth_overrides(signing: Signing) -> dict[str, Any]:
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


@pytest.fixture
async def secure(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, signing: Signing
) -> AsyncIterator[Broker]:
    """A broker with ``auth.enabled`` (HMAC, RSA and EC tokens, an API key, PERMISSIONS)."""
    config = broker_config(
        tmp_path / "b1", etcd_server, prefix=etcd_prefix, overrides=auth_overrides(signing)
    )
    async with running_broker(config) as broker:
        yield broker


@pytest.fixture
async def open_broker(tmp_path: Path, etcd_server: str, etcd_prefix: str) -> AsyncIterator[Broker]:
    """A broker with auth off (the default)."""
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix)) as b:
        yield b


async def token_client(url: str, token: str) -> DanubeClient:
    """danube-client with ``with_token(token)``, over plain loopback gRPC (see the module
    docstring): it sends ``authorization: Bearer <token>`` on every call."""
    builder = DanubeClientBuilder().service_url(url).with_token(token)
    builder._options.use_tls = False
    return await builder.build()


class TokenClients(Clients):
    """``Clients`` whose danube-client sends ``token``."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(url)
        self._token = token

    async def __aenter__(self) -> Self:
        self._client = await token_client(self.url, self._token)
        return self


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` as danube-client sends it."""
    return (("authorization", f"Bearer {token}"),)


@asynccontextmanager
async def other_process_stubs(url: str) -> AsyncIterator[RawStubs]:
    """Raw stubs on a connection of their own, as another client process would have (gRPC
    shares one connection between channels of a process that have the same target and
    options; a process on another host never shares the victim's)."""
    target = url.removeprefix("http://")
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        yield RawStubs(channel)
