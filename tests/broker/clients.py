"""One test-side interface over the two client libraries, so that the behaviour tests in
``test_both_clients.py`` run unchanged against both publish/consume paths:

* ``DanubeSide``: danube-client (Danube's protocol, one RPC per message and per ack);
* ``BatchSide``: ``danube_ingest.client`` (the batch protocol, ``danube_ingest.v1``).

Each uses only its library's public API. What a test sees is the same for both: ``publish``
returns when every message is acknowledged (durable), a refused message raises ``Refused``
with its gRPC status, a subscription is a queue of ``Received`` messages that the test acks
explicitly. Everything opened is closed by ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
from danube import SubType as DanubeSubType

from danube_ingest.client import Batch, ConsumeError, Consumer, Producer, PublishError
from danube_ingest.wal.framing import Entry

from .support import RECEIVE_TIMEOUT, Clients

SubKind = Literal["exclusive", "shared", "failover", "key_shared"]
_DANUBE_TYPES = {
    "exclusive": DanubeSubType.EXCLUSIVE,
    "shared": DanubeSubType.SHARED,
    "failover": DanubeSubType.FAILOVER,
    "key_shared": DanubeSubType.KEY_SHARED,
}


@dataclass(frozen=True)
class Message:
    """A message to publish."""

    payload: bytes
    routing_key: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Received:
    """A delivered message, whichever client received it; ``native`` is the client's own
    object (what its ack takes)."""

    offset: int
    payload: bytes
    routing_key: str | None
    attributes: dict[str, str]
    native: Any = field(compare=False, repr=False)


class Refused(Exception):
    """A publish or subscribe the daemon (or the client, for what no frame can hold) refused."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Subscription:
    """A subscribed consumer; delivered messages wait in ``queue`` until taken."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Received] = asyncio.Queue()

    async def take(self, n: int, timeout: float = RECEIVE_TIMEOUT) -> list[Received]:
        """The next ``n`` messages (fails naming what arrived if they do not within
        ``timeout``)."""
        got: list[Received] = []
        try:
            async with asyncio.timeout(timeout):
                while len(got) < n:
                    got.append(await self.queue.get())
        except TimeoutError:
            raise AssertionError(
                f"expected {n} messages within {timeout}s, got {[m.offset for m in got]}"
            ) from None
        return got

    def available(self) -> list[Received]:
        """What has arrived and was not taken yet (does not wait)."""
        got = []
        while not self.queue.empty():
            got.append(self.queue.get_nowait())
        return got

    async def ack(self, messages: Iterable[Received]) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Leave the subscription (what is unacknowledged goes back to the dispatcher)."""
        raise NotImplementedError


class ClientSide:
    """Publishing and subscribing through one client library; ``close`` closes all."""

    name: str

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self) -> None:
        """Open what the client needs before its first use."""

    async def publish(
        self, topic: str, messages: Sequence[Message], producer: str = "p1"
    ) -> list[int] | None:
        """Publish ``messages`` in order from producer ``producer`` and return once all are
        acknowledged: their offsets where the client's answer names them (batch client), else
        None (danube-client answers with its own request ids). Raises ``Refused``."""
        raise NotImplementedError

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer: str,
        sub_type: SubKind = "exclusive",
        key_filters: Iterable[str] = (),
    ) -> Subscription:
        """A consumer receiving from a new subscription's latest position (Danube's default),
        or after an existing subscription's cursor. Raises ``Refused``."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _DanubeSubscription(Subscription):
    def __init__(self, consumer: Any, messages: asyncio.Queue[Any]) -> None:
        super().__init__()
        self.consumer = consumer
        self._forward = asyncio.get_running_loop().create_task(self._run(messages))

    async def _run(self, messages: asyncio.Queue[Any]) -> None:
        while True:
            m = await messages.get()
            key = m.routing_key or None
            self.queue.put_nowait(
                Received(m.msg_id.topic_offset, m.payload, key, dict(m.attributes), m)
            )

    async def ack(self, messages: Iterable[Received]) -> None:
        for message in messages:
            await self.consumer.ack(message.native)

    async def close(self) -> None:
        self._forward.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._forward
        await self.consumer.close()


class DanubeSide(ClientSide):
    """danube-client: a producer per (topic, name), built once; one ``send`` per message."""

    name = "danube"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._clients = Clients(url)
        self._producers: dict[tuple[str, str], Any] = {}
        self._subscriptions: list[_DanubeSubscription] = []

    async def open(self) -> None:
        await self._clients.__aenter__()

    async def publish(
        self, topic: str, messages: Sequence[Message], producer: str = "p1"
    ) -> list[int] | None:
        try:
            sender = self._producers.get((topic, producer))
            if sender is None:
                sender = await self._clients.producer(topic, producer)
                self._producers[(topic, producer)] = sender
            for m in messages:
                if m.routing_key is None:
                    await sender.send(m.payload, m.attributes)
                else:
                    await sender.send_with_key(m.payload, m.attributes, m.routing_key)
        except grpc.aio.AioRpcError as exc:
            raise Refused(exc.code(), exc.details() or "") from None
        return None

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer: str,
        sub_type: SubKind = "exclusive",
        key_filters: Iterable[str] = (),
    ) -> Subscription:
        try:
            subscribed = await self._clients.consumer(
                topic, subscription, consumer, _DANUBE_TYPES[sub_type], key_filters
            )
        except grpc.aio.AioRpcError as exc:
            raise Refused(exc.code(), exc.details() or "") from None
        sub = _DanubeSubscription(subscribed.consumer, subscribed.queue)
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        for sub in self._subscriptions:
            sub._forward.cancel()
        await self._clients.__aexit__(None, None, None)


class _BatchSubscription(Subscription):
    def __init__(self, consumer: Consumer) -> None:
        super().__init__()
        self.consumer = consumer
        self.error: ConsumeError | None = None
        self._receiver = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for batch in self.consumer:
                for e in batch.entries:
                    self.queue.put_nowait(
                        Received(e.offset, e.payload, e.routing_key, dict(e.attributes or {}), e)
                    )
        except ConsumeError as exc:
            self.error = exc

    async def ack(self, messages: Iterable[Received]) -> None:
        # Batch.ack is cumulative for Exclusive / Failover: ack one message at a time, in the
        # order given, so that a test acks exactly what it names.
        for message in messages:
            entry: Entry = message.native
            self.consumer.ack(Batch(self.consumer.topic, [entry]))

    async def close(self) -> None:
        await self.consumer.close()  # (the receiver's iteration then ends)
        self._receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._receiver


class BatchSide(ClientSide):
    """danube_ingest.client: a ``Producer`` per (topic, name), flushed after each
    ``publish``; a ``Consumer`` per subscription, its batches unpacked into the queue."""

    name = "batch"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._producers: dict[tuple[str, str], Producer] = {}
        self._subscriptions: list[_BatchSubscription] = []

    async def publish(
        self, topic: str, messages: Sequence[Message], producer: str = "p1"
    ) -> list[int] | None:
        sender = self._producers.get((topic, producer))
        if sender is None:
            sender = Producer(self.url, topic, producer_name=producer, linger_ms=1)
            await sender.start()
            self._producers[(topic, producer)] = sender
        futures = [
            await sender.send(m.payload, routing_key=m.routing_key, attributes=m.attributes)
            for m in messages
        ]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*futures), RECEIVE_TIMEOUT))
        except PublishError as exc:
            raise Refused(exc.code, exc.details) from None

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer: str,
        sub_type: SubKind = "exclusive",
        key_filters: Iterable[str] = (),
    ) -> Subscription:
        receiver = Consumer(
            self.url,
            topic,
            subscription,
            consumer_name=consumer,
            sub_type=sub_type,
            key_filters=key_filters,
        )
        try:
            await receiver.start()
        except ConsumeError as exc:
            await receiver.close()
            raise Refused(exc.code, exc.details) from None
        sub = _BatchSubscription(receiver)
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        for sub in self._subscriptions:
            await sub.close()
        for producer in self._producers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.close(), RECEIVE_TIMEOUT)


SIDES = {"danube": DanubeSide, "batch": BatchSide}


def side(name: str, url: str) -> ClientSide:
    return SIDES[name](url)
