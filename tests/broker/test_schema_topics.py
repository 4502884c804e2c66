"""The schema registry served by the broker, used through danube-client's
``SchemaRegistryClient``, and topics whose validation policy enforces a JSON schema."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest
from danube import SchemaType

from danube_ingest.broker.server import Broker

from .support import Clients, offsets, payloads

ORDER_V1 = json.dumps(
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "item": {"type": "string"}},
        "required": ["id", "item"],
    }
).encode()
ORDER_V2 = json.dumps(
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "item": {"type": "string"},
            "note": {"type": "string"},
        },
        "required": ["id", "item"],
    }
).encode()


@pytest.fixture
async def clients(broker: Broker) -> AsyncIterator[Clients]:
    async with Clients(broker.url) as opened:
        yield opened


async def register(clients: Clients, subject: str, definition: bytes) -> int:
    return await (
        clients.client.schema()
        .register_schema(subject)
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(definition)
        .execute()
    )


async def test_register_get_and_latest_through_the_client(clients: Clients) -> None:
    registry = clients.client.schema()
    schema_id = await register(clients, "orders", ORDER_V1)
    assert schema_id > 0
    assert await register(clients, "orders", ORDER_V1) == schema_id  # same definition: no-op

    latest = await registry.get_latest_schema("orders")
    assert (latest.schema_id, latest.subject, latest.version) == (schema_id, "orders", 1)
    assert latest.schema_type == "json_schema"
    assert latest.schema_definition == ORDER_V1
    assert latest.fingerprint

    assert await register(clients, "orders", ORDER_V2) == schema_id  # a subject keeps its id
    assert await registry.list_versions("orders") == [1, 2]
    assert (await registry.get_latest_schema("orders")).version == 2
    first = await registry.get_schema_version(schema_id, 1)
    assert (first.version, first.schema_definition) == (1, ORDER_V1)
    by_id = await registry.get_schema_by_id(schema_id)
    assert (by_id.version, by_id.schema_definition) == (2, ORDER_V2)

    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await registry.get_latest_schema("no-such-subject")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_enforced_json_schema_rejects_invalid_payloads(clients: Clients) -> None:
    topic = "/default/orders"
    registry = clients.client.schema()
    schema_id = await register(clients, "orders", ORDER_V1)
    ok, _ = await registry.configure_topic_schema(topic, "orders", "enforce", True)
    assert ok
    config = await registry.get_topic_schema_config(topic)
    assert (config.schema_subject, config.validation_policy) == ("orders", "enforce")
    assert config.enable_payload_validation

    producer = await clients.producer(topic, "p1", schema_subject="orders")
    sub = await clients.consumer(topic, "s", "c1")
    valid = [
        json.dumps({"id": 1, "item": "tea"}).encode(),
        json.dumps({"id": 2, "item": "cake"}).encode(),
    ]
    await producer.send(valid[0])
    for invalid in (
        json.dumps({"id": "three", "item": "jam"}).encode(),  # wrong type
        json.dumps({"id": 4}).encode(),  # missing field
        b"not json",
    ):
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await producer.send(invalid)
        assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT, invalid
    # A producer that names no schema cannot bypass the policy.
    plain = await clients.producer(topic, "p2")
    with pytest.raises(grpc.aio.AioRpcError) as unlabelled:
        await plain.send(valid[1])
    assert unlabelled.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await producer.send(valid[1])

    got = await sub.take(2)
    assert payloads(got) == valid
    assert offsets(got) == [0, 1]  # rejected messages took no offset
    assert {(m.schema_id, m.schema_version) for m in got} == {(schema_id, 1)}
    await sub.ack_all(got)


async def test_first_schema_producer_binds_the_topic_to_its_subject(clients: Clients) -> None:
    topic = "/default/bound"
    registry = clients.client.schema()
    await register(clients, "orders", ORDER_V1)
    await register(clients, "invoices", ORDER_V2)
    producer = await clients.producer(topic, "p1", schema_subject="orders")
    config = await registry.get_topic_schema_config(topic)
    assert (config.schema_subject, config.validation_policy) == ("orders", "warn")

    with pytest.raises(grpc.aio.AioRpcError) as other:
        await clients.producer(topic, "p2", schema_subject="invoices")
    assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    sub = await clients.consumer(topic, "s", "c1")
    await producer.send(b"not json")  # warn: logged, accepted (payload validation is off)
    assert payloads(await sub.take(1)) == [b"not json"]
