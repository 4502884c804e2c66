"""Fixtures for broker tests: a real broker (in this process) on a real etcd, and the real
danube-client talking to it over loopback gRPC."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from danube import DanubeClient, DanubeClientBuilder

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.testing import broker_config, running_broker

BrokerFactory = Callable[..., Any]


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
async def client(broker: Broker) -> DanubeClient:
    return await DanubeClientBuilder().service_url(broker.url).build()
