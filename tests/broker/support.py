"""Helpers for broker tests that drive the real danube-client (and raw gRPC stubs).

``Clients`` opens a danube-client on a broker, builds producers and consumers the way an
application would, and closes all of them (and the client's channels) on exit, so no receive
loop outlives its test. Waiting helpers wait for a condition with a deadline; none of them
asserts on timing.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc
from danube import (
    Consumer,
    DanubeClient,
    DanubeClientBuilder,
    DispatchStrategy,
    Producer,
    SubType,
)
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import Records
from danube_ingest.testing import BrokerProcess

#: Seconds to wait for a message that is expected (generous: CI machines stall).
RECEIVE_TIMEOUT = 10.0
#: The lease TTL of broker processes started in pairs (the ``start_process`` fixture).
#: BrokerProcess's default, 2 s, leaves a refresh (every TTL/3) 1.3 s to be answered; on a
#: loaded 2-core machine a broker lost its session that way once in ~15 runs (and with it the
#: topic, which is then correctly redelivered, but not what a test expects). 4 s keeps
#: takeovers quick and tolerates 2.6 s stalls.
LEASE_TTL = 4


def wal_cloud_storage(root: Path, segment_seconds: float) -> dict[str, Any]:
    """``storage`` settings of a ``wal_cloud`` broker on the fs object store at ``root``,
    sealing segments every ``segment_seconds`` and looking for WAL to clean every 0.2 s."""
    return {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(root)},
        "wal": {"segment_seconds": segment_seconds, "retention": {"check_seconds": 0.2}},
    }


@dataclass
class Subscribed:
    """A subscribed danube-client consumer and the queue its messages arrive on."""

    consumer: Consumer
    queue: asyncio.Queue[Any]

    async def take(self, n: int, timeout: float = RECEIVE_TIMEOUT) -> list[Any]:
        """The next ``n`` messages (fails if they do not all arrive within ``timeout``)."""
        return await take(self.queue, n, timeout)

    async def ack_all(self, messages: Iterable[Any]) -> None:
        for message in messages:
            await self.consumer.ack(message)


class Clients:
    """A danube-client on one broker plus everything built through it; closed on exit."""

    def __init__(self, url: str, builder: DanubeClientBuilder | None = None) -> None:
        """``builder``: a configured danube-client builder (TLS...); default: plain ``url``."""
        self.url = url
        self._builder = builder
        self._client: DanubeClient | None = None
        self._producers: list[Producer] = []
        self._consumers: list[Consumer] = []

    @property
    def client(self) -> DanubeClient:
        assert self._client is not None, "use Clients as an async context manager"
        return self._client

    async def __aenter__(self) -> Self:
        builder = self._builder or DanubeClientBuilder().service_url(self.url)
        self._client = await builder.build()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for consumer in self._consumers:
            await consumer.close()
        for producer in self._producers:
            await producer.close()
        # danube-client has no close(); its channels live in the connection manager.
        for connection in list(self.client.connection_manager._connections.values()):
            await connection.channel.close()

    async def producer(
        self,
        topic: str,
        name: str = "p1",
        *,
        reliable: bool = True,
        partitions: int = 0,
        schema_subject: str | None = None,
    ) -> Producer:
        """A created producer (``create()`` errors propagate)."""
        builder = (
            self.client.new_producer()
            .with_topic(topic)
            .with_name(name)
            .with_dispatch_strategy(
                DispatchStrategy.RELIABLE if reliable else DispatchStrategy.NON_RELIABLE
            )
        )
        if partitions:
            builder = builder.with_partitions(partitions)
        if schema_subject is not None:
            builder = builder.with_schema_subject(schema_subject)
        producer = builder.build()
        await producer.create()
        self._producers.append(producer)
        return producer

    async def consumer(
        self,
        topic: str,
        subscription: str,
        name: str,
        sub_type: SubType = SubType.EXCLUSIVE,
        key_filters: Iterable[str] = (),
    ) -> Subscribed:
        """A subscribed consumer that is receiving (``subscribe()`` errors propagate)."""
        consumer = (
            self.client.new_consumer()
            .with_topic(topic)
            .with_consumer_name(name)
            .with_subscription(subscription)
            .with_subscription_type(sub_type)
            .with_key_filters(list(key_filters))
            .build()
        )
        await consumer.subscribe()
        self._consumers.append(consumer)
        return Subscribed(consumer, await consumer.receive())


async def take(queue: asyncio.Queue[Any], n: int, timeout: float = RECEIVE_TIMEOUT) -> list[Any]:
    """The next ``n`` items of ``queue``; fails naming how many arrived if time runs out."""
    got: list[Any] = []
    try:
        async with asyncio.timeout(timeout):
            while len(got) < n:
                got.append(await queue.get())
    except TimeoutError:
        raise AssertionError(
            f"expected {n} messages within {timeout}s, got {len(got)}: "
            f"{[(m.msg_id.topic_name, m.msg_id.topic_offset) for m in got]}"
        ) from None
    return got


async def wait_until(
    probe: Callable[[], Awaitable[Any]],
    accept: Callable[[Any], bool],
    what: str,
    timeout: float = RECEIVE_TIMEOUT,
) -> Any:
    """Poll ``probe`` until ``accept(value)``; return that value, or fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await probe()
        if accept(value):
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {value!r}")
        await asyncio.sleep(0.05)


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (a local check, no I/O); fail naming ``what``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def take_over(
    first: Broker, second: Broker, etcd_server: str, prefix: str, topic: str
) -> str:
    """Make in-process broker ``second`` the owner of ``topic`` as after ``first`` was paused
    past its lease (its owner key deleted; waits until ``first`` noticed). Returns the URL
    ``second``'s lookup answers, after asserting it serves the topic itself."""
    assert first.manager is not None and second.manager is not None
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        await kv.delete(Keys(prefix).topic_owner(topic))
    finally:
        await kv.close()
    deadline = time.monotonic() + 5
    while first.manager.owns(topic):
        assert time.monotonic() < deadline, "the first broker never noticed the loss"
        await asyncio.sleep(0.02)
    local, url = await second.manager.lookup(topic)
    assert local
    return url


def offsets(messages: Iterable[Any]) -> list[int]:
    return [m.msg_id.topic_offset for m in messages]


def payloads(messages: Iterable[Any]) -> list[bytes]:
    return [m.payload for m in messages]


@asynccontextmanager
async def metadata(etcd_endpoint: str, prefix: str) -> AsyncIterator[Records]:
    """``Records`` over the broker's etcd keys (to check what the broker persisted)."""
    kv = await EtcdKV.connect([etcd_endpoint], timeout=5.0)
    try:
        yield Records(kv, Keys(prefix))
    finally:
        await kv.close()


class RawStubs:
    """Raw gRPC stubs on a broker, for requests danube-client would not send or whose status
    it hides."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.discovery = pb_grpc.DiscoveryStub(channel)
        self.producers = pb_grpc.ProducerServiceStub(channel)
        self.consumers = pb_grpc.ConsumerServiceStub(channel)
        self.health = pb_grpc.HealthCheckStub(channel)


@asynccontextmanager
async def raw_stubs(url: str) -> AsyncIterator[RawStubs]:
    target = url.removeprefix("http://")
    async with grpc.aio.insecure_channel(target) as channel:
        yield RawStubs(channel)


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error ``call`` fails with (fails the test if it succeeds)."""
    try:
        result = await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"expected a gRPC error, got {result!r}")


def producer_request(topic: str, name: str = "raw", *, reliable: bool = True) -> Any:
    return pb.ProducerRequest(
        request_id=1,
        producer_name=name,
        topic_name=topic,
        producer_access_mode=pb.Shared,
        dispatch_strategy=pb.Reliable if reliable else pb.NonReliable,
    )


def consumer_request(
    topic: str,
    subscription: str = "s",
    name: str = "raw",
    sub_type: SubType = SubType.EXCLUSIVE,
) -> Any:
    return pb.ConsumerRequest(
        request_id=1,
        topic_name=topic,
        consumer_name=name,
        subscription=subscription,
        subscription_type=int(sub_type),
    )


def message(producer_id: int, topic: str, payload: bytes = b"x", **fields: Any) -> Any:
    return pb.StreamMessage(
        request_id=fields.pop("request_id", 1),
        msg_id=pb.MsgID(producer_id=producer_id, topic_name=topic),
        payload=payload,
        publish_time=fields.pop("publish_time", 1),
        producer_name=fields.pop("producer_name", "raw"),
        **fields,
    )


async def stop_all(brokers: Iterable[BrokerProcess]) -> None:
    """Stop broker processes (resuming paused ones first); raise the first that hung."""
    hung: list[RuntimeError] = []
    for broker in brokers:
        broker.kill(signal.SIGCONT)  # a paused broker could not act on SIGTERM
        try:
            await asyncio.to_thread(broker.stop)
        except RuntimeError as exc:  # it did not exit (and was killed): stop the others too
            hung.append(exc)
    if hung:
        raise hung[0]
