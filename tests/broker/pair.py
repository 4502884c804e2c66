"""Helpers for tests of two brokers on one etcd (``test_cluster``, ``test_cluster_cold``,
``test_takeover``): the topic ``TOPIC``'s lookup answer, owner, reserved offsets and cursors as
etcd holds them, and danube-client producers and Exclusive consumers of it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

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

from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.records import decode_cursor

from .support import LEASE_TTL

TOPIC = "/default/cluster"


async def lookup(url: str, topic: str = TOPIC) -> Any:
    """The TopicLookup answer of the broker at ``url`` for ``topic``."""
    async with grpc.aio.insecure_channel(url.removeprefix("http://")) as channel:
        return await pb_grpc.DiscoveryStub(channel).TopicLookup(
            pb.TopicLookupRequest(request_id=7, topic=topic), timeout=5
        )


async def owner_of(kv: EtcdKV, keys: Keys, topic: str = TOPIC) -> dict[str, Any] | None:
    """The owner record of ``topic`` (broker, url, epoch); None: not owned."""
    stored = await kv.get(keys.topic_owner(topic))
    return None if stored is None else dict(json.loads(stored.value))


async def reserved_end(kv: EtcdKV, keys: Keys, topic: str = TOPIC) -> int:
    """The end of the offset block its owner reserved for ``topic``."""
    stored = await kv.get(keys.topic_offsets(topic))
    assert stored is not None
    return int(json.loads(stored.value)["reserved"])


async def cursor_of(kv: EtcdKV, keys: Keys, subscription: str, topic: str = TOPIC) -> int | None:
    """The stored cursor of ``subscription`` (the next offset to deliver); None: none."""
    stored = await kv.get(keys.subscription_cursor(topic, subscription))
    return None if stored is None else decode_cursor(stored.value)


async def wait_cursor(kv: EtcdKV, keys: Keys, subscription: str, expected: int) -> None:
    """Wait (10 s at most) until the stored cursor of ``subscription`` is ``expected``."""
    deadline = time.monotonic() + 10
    while await cursor_of(kv, keys, subscription) != expected:
        assert time.monotonic() < deadline, f"cursor of {subscription} never reached {expected}"
        await asyncio.sleep(0.1)


async def danube_client(url: str) -> DanubeClient:
    """A danube-client on ``url``."""
    return await DanubeClientBuilder().service_url(url).build()


async def reliable_producer(client: DanubeClient, name: str) -> Producer:
    """A created reliable producer ``name`` of ``TOPIC``."""
    producer = (
        client.new_producer()
        .with_topic(TOPIC)
        .with_name(name)
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .build()
    )
    await producer.create()
    return producer


async def exclusive_consumer(
    client: DanubeClient, name: str = "c1", subscription: str = "s1"
) -> tuple[Consumer, asyncio.Queue[pb.StreamMessage]]:
    """A subscribed Exclusive consumer of ``TOPIC`` and the queue its messages arrive on."""
    consumer = (
        client.new_consumer()
        .with_topic(TOPIC)
        .with_consumer_name(name)
        .with_subscription(subscription)
        .with_subscription_type(SubType.EXCLUSIVE)
        .build()
    )
    await consumer.subscribe()
    return consumer, await consumer.receive()


async def next_messages(
    queue: asyncio.Queue[pb.StreamMessage], count: int
) -> list[pb.StreamMessage]:
    """The next ``count`` messages of ``queue``, each within 20 s."""
    return [await asyncio.wait_for(queue.get(), 20) for _ in range(count)]


async def wait_connect(url: str, timeout: float = LEASE_TTL + 8) -> tuple[Any, float, list[int]]:
    """Look the topic up on ``url`` until it answers Connect: (response, seconds, the answer
    types seen before)."""
    started = time.monotonic()
    seen: list[int] = []
    while True:
        response = await lookup(url)
        if response.response_type == pb.TopicLookupResponse.Connect:
            return response, time.monotonic() - started, seen
        seen.append(response.response_type)
        assert time.monotonic() - started < timeout, f"{url} never took the topic over"
        await asyncio.sleep(0.1)
