"""Fixtures and helpers of the metadata tests: brokers made of a session and an ownership."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import pytest

from danube_ingest.metadata import KV, BrokerSession, Keys, OffsetReservation, Ownership

#: Offset reservation block of the test brokers: small, so tests cross block boundaries.
OFFSET_BLOCK = 100


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Stop process ``pid`` (SIGSTOP) for the duration of the block, as a partition would."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        # kill() returns before the process has really stopped; wait until it has ("T").
        with open(f"/proc/{pid}/stat") as stat:
            while stat.read().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, f"process {pid} did not stop"
                time.sleep(0.001)
                stat.seek(0)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class Broker:
    """A broker's metadata side: session + ownership, recording lost topics."""

    def __init__(self, kv: KV, keys: Keys, broker_id: str, ttl: int = 5) -> None:
        self.session = BrokerSession(kv, keys, broker_id, f"http://{broker_id}:6650", ttl=ttl)
        self.ownership = Ownership(kv, keys, self.session)
        self.offsets = OffsetReservation(self.ownership, block=OFFSET_BLOCK)
        self.lost: list[str] = []
        self.ownership.on_lost(self.lost.append)

    async def start(self) -> Broker:
        await self.session.start()
        return self

    async def close(self) -> None:
        await self.ownership.close()
        await self.session.close()


@pytest.fixture
async def brokers(kv: KV, keys: Keys) -> AsyncIterator[tuple[Broker, Broker]]:
    """Two brokers sharing one metadata store."""
    a = await Broker(kv, keys, "a").start()
    b = await Broker(kv, keys, "b").start()
    yield a, b
    await a.close()
    await b.close()
