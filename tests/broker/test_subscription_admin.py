"""``danube_ingest.admin.v1.SubscriptionAdmin`` called directly: malformed requests and a
non-reliable topic are INVALID_ARGUMENT, unknown topics and subscriptions NOT_FOUND, never
INTERNAL; a reset on a partition moves only that partition's cursor."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from danube_ingest.broker.admin_service import DELETE, RESET, encode
from danube_ingest.broker.server import Broker
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.records import Records, SubscriptionRecord, TopicRecord
from tests.broker.support import Clients

pytestmark = pytest.mark.etcd


async def _call(broker: Broker, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(broker.url.removeprefix("http://")) as channel:
        try:
            answer = await channel.unary_unary(method)(body)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, answer.decode()


async def test_bad_requests_are_answered_clearly(
    broker: Broker, etcd_server: str, etcd_prefix: str
) -> None:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    records = Records(kv, Keys(etcd_prefix))
    try:
        await records.create_topic_if_absent(TopicRecord("/default/live", reliable=False))
        await records.put_subscription(SubscriptionRecord("/default/live", "s", "Exclusive"))
    finally:
        await kv.close()
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (RESET, b"\xff\xfe", invalid, "not JSON"),
        (RESET, b"[1, 2]", invalid, "must be a JSON object"),
        (RESET, encode({"topic": 7}), invalid, "needs 'topic'"),
        (RESET, encode({"topic": "/default/x", "subscription": "s"}), invalid, "needs 'start'"),
        (RESET, encode({"topic": "/default/x", "subscription": "s", "start": "soon"}), invalid,
         "start position 'soon'"),
        (RESET, encode({"topic": "bad", "subscription": "s", "start": "0"}), invalid, "bad"),
        (RESET, encode({"topic": "/default/x", "subscription": "s", "start": "0"}),
         grpc.StatusCode.NOT_FOUND, "topic /default/x does not exist"),
        (DELETE, encode({"topic": "/default/live", "subscription": "s"}), invalid,
         "non-reliable"),
        (DELETE, encode({"topic": "/default/x"}), invalid, "needs 'subscription'"),
    ]  # fmt: skip
    for method, body, code, text in cases:
        got, details = await _call(broker, method, body)
        assert (got, text in details) == (code, True), (body, got, details)


async def test_reset_moves_one_partition(broker: Broker) -> None:
    async with Clients(broker.url) as clients:
        for i in (0, 1):
            producer = await clients.producer(f"/default/p-part-{i}", "p")
            # (danube-client subscribes at the end: before the messages are sent.)
            consumer = await clients.consumer(f"/default/p-part-{i}", "s", f"c{i}")
            for n in range(3):
                await producer.send(f"m{n}".encode())
            await consumer.ack_all(await consumer.take(3))
    # The consumers closed with the client; their streams end on the broker shortly after.
    request = encode({"topic": "/default/p-part-1", "subscription": "s", "start": "earliest"})
    for _ in range(50):
        code, answer = await _call(broker, RESET, request)
        if code != grpc.StatusCode.FAILED_PRECONDITION:
            break
        await asyncio.sleep(0.1)
    assert code == grpc.StatusCode.OK, answer
    assert json.loads(answer) == {"previous": 3, "cursor": 0}
    assert broker.manager is not None
    subs = [broker.manager._subscription_of(f"/default/p-part-{i}", "s") for i in (0, 1)]
    # Partition 0 is untouched; partition 1's subscription is rebuilt from etcd when next used.
    assert subs[0] is not None and subs[0].cursor == 3 and subs[1] is None
