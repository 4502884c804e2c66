"""Fixtures for the WAL tests: region logs and topic stores on real files, always closed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.store import TopicStore
from danube_ingest.wal import RegionLog

OpenLog = Callable[..., Awaitable[RegionLog]]
OpenStore = Callable[..., Awaitable[TopicStore]]


@pytest.fixture
async def open_log() -> AsyncIterator[OpenLog]:
    """``await open_log(region_dir, **options)``: a RegionLog closed at teardown if still open."""
    opened: list[RegionLog] = []

    async def open_(region_dir: Path, **options: Any) -> RegionLog:
        log = await RegionLog.open(region_dir, **options)
        opened.append(log)
        return log

    yield open_
    for log in opened:
        await log.close()


@pytest.fixture
async def open_store() -> AsyncIterator[OpenStore]:
    """``await open_store(wal_dir, **options)``: a TopicStore closed at teardown if still open."""
    opened: list[TopicStore] = []

    async def open_(wal_dir: Path, **options: Any) -> TopicStore:
        store = await TopicStore.open(wal_dir, **options)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        await store.close()
