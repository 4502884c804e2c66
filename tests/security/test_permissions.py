"""Authorization on the broker (``auth.permissions``): a principal without the permission for a
topic's namespace, or for the action, is refused with PERMISSION_DENIED naming principal,
action and resource, before anything is created, stored or subscribed; schema registry admin
RPCs need ``admin``."""

from __future__ import annotations

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import SchemaRegistry_pb2 as schema_pb
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc

from danube_ingest.client import ConsumeError, Consumer, Producer, PublishError
from danube_ingest.metadata.records import Records
from danube_ingest.observability.metrics import REGISTRY
from tests.broker.support import consumer_request, producer_request, rpc_error

from .conftest import SecureBroker, Signing, bearer, stored_payloads, subscription


def created(broker: SecureBroker, topic: str) -> bool:
    return broker.store.info(topic) is not None


async def test_wrong_namespace_is_permission_denied(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    alice = bearer(signing.token("alice"))
    topic = "/other/orders"
    async with secure.stubs() as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(topic), metadata=alice)
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        details = error.details() or ""
        assert "'alice'" in details and "produce" in details and topic in details
        error = await rpc_error(raw.consumers.Subscribe(consumer_request(topic), metadata=alice))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "consume" in (error.details() or "")
        error = await rpc_error(
            raw.discovery.TopicLookup(
                pb.TopicLookupRequest(request_id=1, topic=topic), metadata=alice
            )
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not created(secure, topic)
    assert await records.list_clients() == []
    assert await records.list_subscriptions(topic) == []


async def test_wrong_namespace_of_an_existing_topic_stores_and_delivers_nothing(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    """/other/orders exists and holds a message (an operator with ``admin`` published it);
    alice (who may only use namespace shop) is refused PERMISSION_DENIED by danube-client over
    TLS, the batch client and raw gRPC, publishing or consuming: the topic holds what it held,
    no subscription is made, nothing is delivered to her."""
    topic = "/other/orders"
    operator = signing.token("operator", roles=["ops"])
    async with Producer(secure.url, topic, tls=secure.tls, token=operator) as producer:
        assert await (await producer.send(b"operator's")) == 0
    alice = signing.token("alice")
    async with secure.clients(alice) as clients:
        with pytest.raises(grpc.aio.AioRpcError) as produce:
            await clients.producer(topic)
        assert produce.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as consume:
            await clients.consumer(topic, "s", "c")
        assert consume.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with Producer(secure.url, topic, tls=secure.tls, token=alice) as batch:
        future = await batch.send(b"alice's")
        with pytest.raises(PublishError) as published:
            await future
    assert published.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ConsumeError) as consumed:
        async with Consumer(secure.url, topic, "s", start="earliest", tls=secure.tls, token=alice):
            pass
    assert consumed.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert await stored_payloads(secure.store, topic) == [b"operator's"]
    assert await records.list_subscriptions(topic) == []

    # Nor may alice settle a message of the operator's subscription.
    async with secure.clients(operator) as clients:
        reader = await clients.consumer(topic, "ops", "reader")
        producer = await clients.producer(topic, "p2")
        await producer.send(b"second")
        [m] = await reader.take(1)
        async with secure.stubs(own_connection=True) as raw:
            ack = pb.AckRequest(request_id=1, msg_id=m.msg_id, subscription_name="ops")
            error = await rpc_error(raw.consumers.Ack(ack, metadata=bearer(alice)))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert subscription(secure, "ops", topic).unacked == 1
        await reader.ack_all([m])
    assert await stored_payloads(secure.store, topic) == [b"operator's", b"second"]


async def test_produce_only_principal_cannot_consume(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    writer = signing.token("writer")
    topic = "/shop/events"
    async with secure.stubs() as raw:
        await raw.producers.CreateProducer(producer_request(topic), metadata=bearer(writer))
        error = await rpc_error(
            raw.consumers.Subscribe(consumer_request(topic), metadata=bearer(writer))
        )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'writer' may not consume /shop/events" in (error.details() or "")
    assert await records.list_subscriptions(topic) == []
    with pytest.raises(ConsumeError) as refused:
        async with Consumer(secure.url, topic, "batch", tls=secure.tls, token=writer):
            pass
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert await records.list_subscriptions(topic) == []


async def test_batch_publish_to_a_forbidden_topic_stores_nothing(
    secure: SecureBroker, signing: Signing
) -> None:
    writer = signing.token("writer")
    async with Producer(secure.url, "/other/events", tls=secure.tls, token=writer) as producer:
        future = await producer.send(b"not allowed")
        with pytest.raises(PublishError) as refused:
            await future
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not created(secure, "/other/events")
    async with Producer(secure.url, "/shop/events", tls=secure.tls, token=writer) as producer:
        assert await (await producer.send(b"allowed")) == 0


def rpc_count(method: str, code: str) -> float:
    """Calls of ``method`` that ended with ``code`` so far (``danube_ingest_rpc_seconds``)."""
    labels = {"method": method, "code": code}
    return REGISTRY.get_sample_value("danube_ingest_rpc_seconds_count", labels) or 0.0


async def test_schema_admin_rpcs_need_admin(secure: SecureBroker, signing: Signing) -> None:
    """Refused and accepted calls alike are counted in the RPC metrics by their status, those
    the admin rule refuses too."""
    request = schema_pb.SetCompatibilityModeRequest(subject="orders", compatibility_mode="full")
    method = "/danube_schema.SchemaRegistry/SetCompatibilityMode"
    codes = ("OK", "PERMISSION_DENIED", "UNAUTHENTICATED")
    before = {code: rpc_count(method, code) for code in codes}
    async with secure.channel() as channel:
        schema = schema_grpc.SchemaRegistryStub(channel)
        await schema.RegisterSchema(
            schema_pb.RegisterSchemaRequest(
                subject="orders", schema_type="json_schema", schema_definition=b'{"type": "object"}'
            ),
            metadata=bearer(signing.token("alice")),
        )
        error = await rpc_error(
            schema.SetCompatibilityMode(request, metadata=bearer(signing.token("alice")))
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in (error.details() or "")
        await schema.SetCompatibilityMode(
            request, metadata=bearer(signing.token("operator", roles=["ops"]))
        )
        error = await rpc_error(schema.SetCompatibilityMode(request))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert {code: rpc_count(method, code) - before[code] for code in codes} == dict.fromkeys(
        codes, 1.0
    )
