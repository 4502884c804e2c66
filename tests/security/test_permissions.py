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

from danube_ingest.broker.server import Broker
from danube_ingest.client import ConsumeError, Consumer, Producer, PublishError
from danube_ingest.metadata.records import Records
from tests.broker.support import consumer_request, producer_request, raw_stubs, rpc_error

from .conftest import Signing, bearer


def created(broker: Broker, topic: str) -> bool:
    assert broker.store is not None
    return broker.store.info(topic) is not None


async def test_wrong_namespace_is_permission_denied(
    secure: Broker, records: Records, signing: Signing
) -> None:
    alice = bearer(signing.token("alice"))
    topic = "/other/orders"
    async with raw_stubs(secure.url) as raw:
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


async def test_produce_only_principal_cannot_consume(
    secure: Broker, records: Records, signing: Signing
) -> None:
    writer = signing.token("writer")
    topic = "/shop/events"
    async with raw_stubs(secure.url) as raw:
        await raw.producers.CreateProducer(producer_request(topic), metadata=bearer(writer))
        error = await rpc_error(
            raw.consumers.Subscribe(consumer_request(topic), metadata=bearer(writer))
        )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'writer' may not consume /shop/events" in (error.details() or "")
    assert await records.list_subscriptions(topic) == []
    with pytest.raises(ConsumeError) as refused:
        async with Consumer(secure.url, topic, "batch", token=writer):
            pass
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert await records.list_subscriptions(topic) == []


async def test_batch_publish_to_a_forbidden_topic_stores_nothing(
    secure: Broker, signing: Signing
) -> None:
    writer = signing.token("writer")
    async with Producer(secure.url, "/other/events", token=writer) as producer:
        future = await producer.send(b"not allowed")
        with pytest.raises(PublishError) as refused:
            await future
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not created(secure, "/other/events")
    async with Producer(secure.url, "/shop/events", token=writer) as producer:
        assert await (await producer.send(b"allowed")) == 0


async def test_schema_admin_rpcs_need_admin(secure: Broker, signing: Signing) -> None:
    request = schema_pb.SetCompatibilityModeRequest(subject="orders", compatibility_mode="full")
    async with grpc.aio.insecure_channel(secure.url.removeprefix("http://")) as channel:
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
