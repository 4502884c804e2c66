"""A producer of a broker that lost its topic reaches the new owner at once (issue 15).

Two in-process brokers on one etcd. The first owns the topic and a danube-client producer
publishes through it; the first then loses the topic as a paused owner does (its owner key
vanishes: its lease ran out) and the second takes it over. danube-client looks the topic up
again only after its retry budget is spent, so with the budget an application uses to bridge
restarts (300 tries) the producer kept sending to the old owner for about 45 s; the old owner
now forwards its publishes to the new owner (``broker.forward``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from danube import DanubeClientBuilder, DispatchStrategy, ProducerOptions
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.forward import FORWARDED_HEADER

from .conftest import BrokerFactory
from .support import raw_stubs, rpc_error, take_over

pytestmark = [pytest.mark.etcd]

T = "/default/moved"
#: The fault harness's budget (tests/faults/harness.py): about 45 s of UNAVAILABLE answers
#: before danube-client looks the topic up again.
RETRY_BUDGET = {"max_retries": 300, "base_backoff_ms": 100, "max_backoff_ms": 200}
#: How soon after the takeover the producer must be acknowledged again (seconds).
MOVED_WITHIN = 5.0


@pytest.mark.timeout(60)
async def test_a_producer_of_the_fenced_owner_is_acknowledged_by_the_new_owner_at_once(
    make_broker: BrokerFactory, etcd_server: str, etcd_prefix: str
) -> None:
    first = await make_broker("broker-1")
    second = await make_broker("broker-2")
    assert first.store is not None and second.store is not None
    client = await DanubeClientBuilder().service_url(first.url).build()
    producer = (
        client.new_producer()
        .with_topic(T)
        .with_name("p1")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .with_options(ProducerOptions(**RETRY_BUDGET))
        .build()
    )
    try:
        await producer.create()
        for i in range(10):
            await producer.send(f"a{i}".encode(), {})
        assert first.store.next_offset(T) == 10

        assert await take_over(first, second, etcd_server, etcd_prefix, T) == second.url
        on_second = second.store.next_offset(T)
        started = time.monotonic()
        async with asyncio.timeout(MOVED_WITHIN):
            for i in range(10):
                await producer.send(f"b{i}".encode(), {})
        took = time.monotonic() - started
        # Stored and acknowledged by the new owner; nothing more in the old owner's WAL.
        assert second.store.next_offset(T) == on_second + 10
        assert first.store.next_offset(T) == 10
        assert took < MOVED_WITHIN
    finally:
        await producer.close()
        for connection in list(client.connection_manager._connections.values()):
            await connection.channel.close()


@pytest.mark.timeout(60)
async def test_a_forwarded_publish_is_not_forwarded_again(
    make_broker: BrokerFactory, etcd_server: str, etcd_prefix: str
) -> None:
    first = await make_broker("broker-1")
    second = await make_broker("broker-2")
    assert second.store is not None
    async with raw_stubs(first.url) as raw:
        created = await raw.producers.CreateProducer(
            pb.ProducerRequest(
                request_id=1,
                producer_name="raw",
                topic_name=T,
                producer_access_mode=pb.Shared,
                dispatch_strategy=pb.Reliable,
            )
        )
        assert await take_over(first, second, etcd_server, etcd_prefix, T) == second.url
        message = pb.StreamMessage(
            request_id=7,
            msg_id=pb.MsgID(producer_id=created.producer_id, topic_name=T),
            payload=b"x",
        )
        on_second = second.store.next_offset(T)
        # A call another broker forwarded already: answered UNAVAILABLE, naming the owner.
        err = await rpc_error(
            raw.producers.SendMessage(message, metadata=[(FORWARDED_HEADER, "1")])
        )
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert T in (err.details() or "") and second.url in (err.details() or "")
        assert second.store.next_offset(T) == on_second
        # The client's own call: forwarded, the owner's answer relayed.
        answer = await raw.producers.SendMessage(message)
        assert answer.request_id == 7
        assert second.store.next_offset(T) == on_second + 1
