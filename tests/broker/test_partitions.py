"""Partitioned topics through the real danube-client: ``/ns/topic-part-{i}`` topics, per-partition
offsets, acks routed back to the right partition, keyed sends pinned to one partition."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.server import Broker

from .support import Clients, metadata, offsets, raw_stubs, wait_until

TOPIC = "/default/orders"
PARTS = [f"{TOPIC}-part-{i}" for i in range(3)]


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


def by_partition(messages: list[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = defaultdict(list)
    for m in messages:
        grouped[m.msg_id.topic_name].append(m)
    return dict(grouped)


async def test_partitioned_topic_delivers_per_partition_and_routes_acks(
    clients: Clients, broker: Broker, etcd_server: str, etcd_prefix: str
) -> None:
    producer = await clients.producer(TOPIC, "pp", partitions=3)
    async with raw_stubs(broker.url) as raw:
        listed = await raw.discovery.TopicPartitions(
            pb.TopicLookupRequest(request_id=7, topic=TOPIC)
        )
    assert list(listed.partitions) == PARTS
    assert listed.request_id == 7

    sub = await clients.consumer(TOPIC, "s", "c1")
    for i in range(9):
        await producer.send(f"m{i}".encode())  # round robin: partitions 0, 1, 2, 0, ...
    got = by_partition(await sub.take(9))
    assert sorted(got) == PARTS
    for index, part in enumerate(PARTS):
        assert offsets(got[part]) == [0, 1, 2], part
        assert [m.payload for m in got[part]] == [f"m{index + 3 * k}".encode() for k in range(3)]
        assert {m.producer_name for m in got[part]} == {f"pp-{index}"}
        await sub.ack_all(got[part])

    # Consumer.ack routes by msg_id.topic_name: each partition's cursor moved past its acks.
    async with metadata(etcd_server, etcd_prefix) as records:

        async def cursors() -> list[int | None]:
            return [await records.get_cursor(part, "s") for part in PARTS]

        await wait_until(cursors, lambda c: c == [3, 3, 3], "cursors of every partition at 3")

    # A consumer reopened on the subscription gets nothing it acked, only what came later.
    await sub.consumer.close()
    reopened = await clients.consumer(TOPIC, "s", "c1")
    for i in range(9, 12):
        await producer.send(f"m{i}".encode())
    later = by_partition(await reopened.take(3))
    assert {part: offsets(ms) for part, ms in later.items()} == {part: [3] for part in PARTS}
    await reopened.ack_all(m for ms in later.values() for m in ms)


async def test_keyed_sends_stay_on_one_partition(clients: Clients) -> None:
    producer = await clients.producer(TOPIC, "pk", partitions=3)
    sub = await clients.consumer(TOPIC, "s", "c1")
    keys = [f"user-{k}" for k in range(8)]
    for round_ in range(3):
        for key in keys:
            await producer.send_with_key(f"{key}/{round_}".encode(), None, key)

    got = await sub.take(24)
    partitions_of: dict[str, set[str]] = defaultdict(set)
    for m in got:
        assert m.routing_key == m.payload.decode().split("/")[0]
        partitions_of[m.routing_key].add(m.msg_id.topic_name)
    assert set(partitions_of) == set(keys)
    assert all(len(parts) == 1 for parts in partitions_of.values()), dict(partitions_of)
    for part, ms in by_partition(got).items():
        assert offsets(ms) == list(range(len(ms))), part
    await sub.ack_all(got)
