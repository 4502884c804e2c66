"""The smallest end-to-end path: danube-client publishes, subscribes and receives."""

from __future__ import annotations

import asyncio

from danube import DanubeClient, DispatchStrategy, SubType


async def test_publish_then_consume(client: DanubeClient) -> None:
    producer = (
        client.new_producer()
        .with_topic("/default/smoke")
        .with_name("p1")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .build()
    )
    await producer.create()
    consumer = (
        client.new_consumer()
        .with_topic("/default/smoke")
        .with_consumer_name("c1")
        .with_subscription("s1")
        .with_subscription_type(SubType.EXCLUSIVE)
        .build()
    )
    await consumer.subscribe()
    queue = await consumer.receive()
    for i in range(10):
        await producer.send(f"m{i}".encode(), {"i": str(i)})
    got = []
    for _ in range(10):
        message = await asyncio.wait_for(queue.get(), 10)
        got.append((message.msg_id.topic_offset, message.payload, dict(message.attributes)))
        await consumer.ack(message)
    assert got == [(i, f"m{i}".encode(), {"i": str(i)}) for i in range(10)]
    await producer.close()
    await consumer.close()
