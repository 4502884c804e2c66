"""The contract the broker holds both kinds of subscription to."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from danube_ingest.dispatch.consumer import ConsumerHandle
from danube_ingest.dispatch.policy import SubscriptionType


class Subscription(Protocol):
    """A subscription of one topic: consumers attach, receive through their handle, and ack.

    Implemented by :class:`ReliableSubscription` (stored topics, at-least-once) and
    :class:`NonReliableSubscription` (live fan-out, at-most-once; ack and nack do nothing).
    """

    name: str
    topic: str
    sub_type: SubscriptionType

    @property
    def consumers(self) -> tuple[ConsumerHandle, ...]: ...

    @property
    def closed(self) -> bool: ...

    def attach(
        self,
        consumer_id: int,
        name: str,
        key_filters: Iterable[str] = (),
        *,
        sub_type: SubscriptionType | None = None,
        frames: int = 0,
        receiving: bool = True,
    ) -> ConsumerHandle: ...

    def detach(self, consumer_id: int) -> bool: ...

    def ack(self, offset: int) -> bool: ...

    def ack_many(self, offsets: Iterable[int]) -> int: ...

    def ack_range(self, handle: ConsumerHandle, first: int, last: int) -> int: ...

    def nack(self, offset: int, delay_ms: int | None = None, reason: str | None = None) -> bool: ...

    async def close(self) -> None: ...
