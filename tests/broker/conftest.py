"""Fixtures for broker tests: a real broker (in this process) on a real etcd, and the real
danube-client talking to it over loopback gRPC; brokers as child processes on one etcd (for
takeovers between them) with a shared object root."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from danube import DanubeClient, DanubeClientBuilder

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.testing import BrokerProcess, broker_config, running_broker

from .support import LEASE_TTL, stop_all

BrokerFactory = Callable[..., Any]
StartProcess = Callable[..., Awaitable[BrokerProcess]]


@pytest.fixture(autouse=True)
def _quiet_client(caplog: pytest.LogCaptureFixture) -> None:
    """danube-client reopens a failed stream at once, logging a warning each time: thousands
    per second while a broker is down. Keep them out of the captured log."""
    caplog.set_level(logging.ERROR, logger="danube.consumer")


@pytest.fixture
async def kv(etcd_server: str) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([etcd_server], timeout=5.0)
    yield store
    await store.close()


@pytest.fixture
def keys(etcd_prefix: str) -> Keys:
    return Keys(etcd_prefix)


@pytest.fixture
def etcd_prefix() -> str:
    """A fresh key prefix per test, so tests sharing the etcd server never meet."""
    return f"/t{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str, etcd_prefix: str) -> AsyncIterator[Broker]:
    """One broker with default dispatch settings."""
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix)) as b:
        yield b


@pytest.fixture
async def make_broker(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> AsyncIterator[BrokerFactory]:
    """Start brokers with config overrides: ``await make_broker(**{"dispatch.x": ...})``."""
    started: list[Any] = []

    async def make(broker_id: str = "broker-1", **overrides: Any) -> Broker:
        manager = running_broker(
            broker_config(
                tmp_path / broker_id,
                etcd_server,
                broker_id=broker_id,
                prefix=etcd_prefix,
                overrides=overrides,
            )
        )
        started.append(manager)
        return await manager.__aenter__()

    yield make
    for manager in reversed(started):
        await manager.__aexit__(None, None, None)


@pytest.fixture
def objects_root(tmp_path: Path) -> Path:
    """The fs object root the test's ``wal_cloud`` brokers share."""
    return tmp_path / "objects"


@pytest.fixture
async def start_process(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> AsyncIterator[StartProcess]:
    """``await start_process("broker-a", storage=...)``: a started broker child process
    (``BrokerProcess``) with its own data dir and port, on the test's etcd prefix, lease TTL
    ``LEASE_TTL`` (``storage``: its storage settings; default ``local_only``). Every one is
    stopped after the test, also one that failed to start."""
    started: list[BrokerProcess] = []

    async def start(broker_id: str, storage: dict[str, Any] | None = None) -> BrokerProcess:
        broker = BrokerProcess(
            tmp_path / broker_id,
            etcd_server,
            broker_id=broker_id,
            prefix=etcd_prefix,
            lease_ttl=LEASE_TTL,
            storage=storage,
        )
        started.append(broker)
        await asyncio.to_thread(broker.start)
        return broker

    yield start
    await stop_all(started)


@pytest.fixture
async def client(broker: Broker) -> DanubeClient:
    return await DanubeClientBuilder().service_url(broker.url).build()
