"""Stores for the topic store tests (one factory per storage mode, all held to one contract),
and the helpers the tests share.

``stores`` is parametrized over every mode (``memory``, ``file`` with fsync ``always``, ``file``
with fsync ``never``); ``file_stores`` over the file modes only, for what must survive a close.
Every store a test opens is closed after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from danube_ingest.config.models import RetentionConfig
from danube_ingest.objects.cleaner import CLEAN_INTERVAL, WalCleaner
from danube_ingest.store import TopicInfo, TopicReader, TopicStore
from danube_ingest.wal import Entry

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB


def now_ms() -> int:
    return int(time.time() * 1000)


async def within(awaitable: Awaitable[T], seconds: float = 10.0) -> T:
    """``await awaitable``, failing the test instead of hanging when it takes too long."""
    return await asyncio.wait_for(awaitable, seconds)


async def read_until(reader: TopicReader, stop: int, timeout: float = 30.0) -> list[Entry]:
    """Every entry the reader yields before offset ``stop`` (waiting for live appends)."""
    out: list[Entry] = []

    async def run() -> None:
        while reader.position < stop:
            batch = await reader.next_batch()
            assert batch, f"reader ended at {reader.position}, before offset {stop}"
            out.extend(batch)

    await asyncio.wait_for(run(), timeout)
    return out


def assert_sequence(entries: Sequence[Entry], start: int, payloads: Sequence[bytes]) -> None:
    """``entries`` are exactly offsets ``start..`` with ``payloads``, ingest time monotone."""
    offsets = [e.offset for e in entries]
    assert offsets == list(range(start, start + len(payloads)))
    assert [e.payload for e in entries] == list(payloads)
    times = [e.ingest_ms for e in entries]
    assert times == sorted(times), "ingest_ms decreased within a topic"


def local_cleaner(
    store: TopicStore, retention: RetentionConfig, interval: float = CLEAN_INTERVAL
) -> WalCleaner:
    """The cleaner of a ``local_only`` broker: no etcd, no uploads to wait for, and only the
    retention maximums (and the free-space floor) prune."""
    return WalCleaner(
        store,
        broker_id="b1",
        retention=retention,
        kv=None,
        keys=None,
        require_upload=False,
        prune_consumed=False,
        interval=interval,
    )


def info_of(store: TopicStore, topic: str) -> TopicInfo:
    info = store.info(topic)
    assert info is not None, f"topic {topic} does not exist"
    return info


class SteppedClock:
    """Stands in for the ``time`` module of the WAL: a wall clock the test sets, steps back too."""

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.monotonic = time.monotonic

    def time(self) -> float:
        return self.ms / 1000


async def append_all(store: TopicStore, topic: str, payloads: Sequence[bytes]) -> list[int]:
    return [await store.append(topic, Entry(p)) for p in payloads]


class StoreFactory:
    """Opens stores of one mode on one WAL directory (reopening continues where it stopped)."""

    def __init__(self, mode: str, wal_dir: Path | None) -> None:
        self.mode = mode
        self.wal_dir = wal_dir
        self.fsync = "never" if mode == "file-nofsync" else "always"
        self.opened: list[TopicStore] = []

    async def open(self, **options: Any) -> TopicStore:
        options.setdefault("fsync", self.fsync)
        store = await TopicStore.open(self.wal_dir, **options)
        self.opened.append(store)
        return store

    async def close_all(self) -> None:
        for store in self.opened:
            await store.close()


FILE_MODES = ["file", "file-nofsync"]
MODES = ["memory", *FILE_MODES]


async def _factory(mode: str, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    factory = StoreFactory(mode, None if mode == "memory" else tmp_path / "wal")
    try:
        yield factory
    finally:
        await factory.close_all()


@pytest.fixture(params=MODES)
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    async for factory in _factory(request.param, tmp_path):
        yield factory


@pytest.fixture(params=FILE_MODES)
async def file_stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StoreFactory]:
    async for factory in _factory(request.param, tmp_path):
        yield factory
