"""A real in-memory TopicStore and helpers to publish to it and read what consumers get.

``harness`` opens the store (memory mode), creates subscriptions on it, and closes everything
after the test. Timings: reliable tests that wait for real timers use policies with delays of
a few tens of milliseconds; exact timing tests use a :class:`ManualClock`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.dispatch import (
    Clock,
    ConsumerHandle,
    DeadLetterCallback,
    Delivery,
    DispatchPolicy,
    ReliableSubscription,
    SubscriptionType,
)
from danube_ingest.store import TopicStore
from danube_ingest.wal import Entry

TOPIC = "/default/events"

#: Redelivery delays of a few tens of milliseconds; an ack timeout no test hits by accident
#: (tests of ack timeouts set a short one, or use a ManualClock).
FAST = DispatchPolicy(
    ack_timeout_s=30,
    nack_base_delay_s=0.02,
    redelivery_base_s=0.02,
    redelivery_max_s=0.1,
)


async def next_delivery(handle: ConsumerHandle, timeout: float = 2.0) -> Delivery:
    """The handle's next delivery, failing the test instead of hanging."""
    return await asyncio.wait_for(handle.next(), timeout)


async def take(handle: ConsumerHandle, count: int, timeout: float = 2.0) -> list[Delivery]:
    return [await next_delivery(handle, timeout) for _ in range(count)]


async def offsets(handle: ConsumerHandle, count: int, timeout: float = 2.0) -> list[int]:
    return [d.entry.offset for d in await take(handle, count, timeout)]


async def quiet(*handles: ConsumerHandle, seconds: float = 0.05) -> None:
    """Assert that none of ``handles`` gets a delivery within ``seconds``."""
    await asyncio.sleep(seconds)
    for handle in handles:
        assert handle.queued == 0, f"{handle} unexpectedly got {handle._queue}"


async def settle_loop() -> None:
    """Let the dispatch tasks run until they are idle (appends are durable at once in memory
    mode, so a handful of loop turns suffices)."""
    for _ in range(20):
        await asyncio.sleep(0)


class Harness:
    def __init__(self, store: TopicStore) -> None:
        self.store = store
        self.subscriptions: list[ReliableSubscription] = []
        self.cursors: dict[str, list[int]] = {}

    def subscribe(
        self,
        name: str = "sub",
        sub_type: SubscriptionType = SubscriptionType.SHARED,
        *,
        start: int | None = 0,
        policy: DispatchPolicy = FAST,
        dead_letter: DeadLetterCallback | None = None,
        clock: Clock | None = None,
        topic: str = TOPIC,
    ) -> ReliableSubscription:
        cursors = self.cursors.setdefault(name, [])
        subscription = ReliableSubscription(
            name,
            topic,
            sub_type,
            self.store,
            start,
            policy,
            cursors.append,
            dead_letter,
            clock=clock,
        )
        self.subscriptions.append(subscription)
        return subscription

    async def publish(
        self,
        count: int = 1,
        *,
        keys: Iterable[str | None] | None = None,
        producer: str = "producer",
        topic: str = TOPIC,
        **fields: Any,
    ) -> list[int]:
        """Append ``count`` entries (``keys`` gives their routing keys); return their offsets."""
        key_list: Sequence[str | None] = list(keys) if keys is not None else [None] * count
        assert len(key_list) == count
        out = []
        for i, key in enumerate(key_list):
            entry = Entry(b"m%d" % i, producer_name=producer, routing_key=key, **fields)
            out.append(await self.store.append(topic, entry))
        await settle_loop()
        return out

    async def close(self) -> None:
        for subscription in self.subscriptions:
            await subscription.close()
        await self.store.close()


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness(await TopicStore.open(None))
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture
def wal_dir(tmp_path: Path) -> Path:
    return tmp_path / "wal"
