"""Fixtures for fault tests: a fresh etcd prefix, a ``History`` logged to the test's temp dir
(kept there for a failed run), and broker child processes stopped after the test."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.testing import BrokerProcess, History
from tests.broker.support import stop_all

BrokerFactory = Callable[..., BrokerProcess]


@pytest.fixture(autouse=True)
def _quiet_client(caplog: pytest.LogCaptureFixture) -> None:
    """danube-client logs a warning per reconnect attempt while a daemon is down."""
    caplog.set_level(logging.ERROR, logger="danube.consumer")
    caplog.set_level(logging.ERROR, logger="danube.producer")


@pytest.fixture
def etcd_prefix() -> str:
    return f"/f{uuid.uuid4().hex[:12]}"


@pytest.fixture
def history(tmp_path: Path) -> Iterator[History]:
    """The test's history, also written to ``tmp_path/history.jsonl``."""
    h = History(tmp_path / "history.jsonl")
    yield h
    h.close()


@pytest.fixture
async def brokers(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> AsyncIterator[BrokerFactory]:
    """``brokers(broker_id="broker-1", **kwargs)``: a ``BrokerProcess`` (not started) on the
    session etcd and this test's prefix, lease TTL 4 s, a warm spare interpreter for fast
    restarts (``BrokerProcess(warm=True)``); all stopped after the test."""
    made: list[BrokerProcess] = []

    def make(broker_id: str = "broker-1", **kwargs: Any) -> BrokerProcess:
        kwargs.setdefault("lease_ttl", 4)
        kwargs.setdefault("prefix", etcd_prefix)
        kwargs.setdefault("warm", True)  # restarts without the ~1.5 s of imports
        broker = BrokerProcess(tmp_path / broker_id, etcd_server, broker_id=broker_id, **kwargs)
        made.append(broker)
        return broker

    yield make
    await stop_all(made)
