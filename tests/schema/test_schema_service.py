"""End to end: the real danube-client SchemaRegistryClient against SchemaRegistryServicer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from danube import CompatibilityMode, DanubeClientBuilder, SchemaRegistryClient, SchemaType
from danube.proto import SchemaRegistry_pb2 as pb
from danube.proto import SchemaRegistry_pb2_grpc as pb_grpc
from schema_samples import avro_record, json_object

from danube_ingest.schema import (
    MemorySchemaStore,
    SchemaConflictError,
    SchemaRegistry,
    SchemaRegistryServicer,
)
from danube_ingest.schema.service import status_for

USER = json_object({"name": {"type": "string"}}, ["name"])
USER_V2 = json_object({"name": {"type": "string"}, "email": {"type": "string"}}, ["name"])


class Server:
    def __init__(self, registry: SchemaRegistry, client: Any, channel: Any) -> None:
        self.registry = registry
        self.client = client
        self.schema: SchemaRegistryClient = client.schema()
        self.stub = pb_grpc.SchemaRegistryStub(channel)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    registry = SchemaRegistry(MemorySchemaStore())
    grpc_server = grpc.aio.server()
    pb_grpc.add_SchemaRegistryServicer_to_server(SchemaRegistryServicer(registry), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    client = await DanubeClientBuilder().service_url(f"http://127.0.0.1:{port}").build()
    connection = await client.connection_manager.get_connection(client.uri, client.uri)
    try:
        yield Server(registry, client, connection.channel)
    finally:
        await connection.channel.close()
        await grpc_server.stop(None)


async def status_of(call: Any) -> Any:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code()


async def test_register_get_and_list(server: Server) -> None:
    schema = server.schema
    schema_id = await (
        schema.register_schema("users")
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(USER)
        .with_description("first")
        .with_tags(["team-a"])
        .execute()
    )
    assert schema_id == 1
    again = schema.register_schema("users").with_type(SchemaType.JSON_SCHEMA)
    assert await again.with_schema_data(USER).execute() == schema_id
    await (
        schema.register_schema("users")
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(USER_V2)
        .execute()
    )

    latest = await schema.get_latest_schema("users")
    assert (latest.schema_id, latest.subject, latest.version) == (1, "users", 2)
    assert latest.schema_type == "json_schema"
    assert latest.schema_definition == USER_V2
    assert json.loads(latest.schema_definition_as_string())["required"] == ["name"]
    assert latest.fingerprint.startswith("sha256:")

    first = await schema.get_schema_version(schema_id, 1)
    assert (first.version, first.schema_definition) == (1, USER)
    assert (await schema.get_schema_by_id(schema_id)).version == 2
    assert await schema.list_versions("users") == [1, 2]

    full = await server.stub.GetSchema(pb.GetSchemaRequest(schema_id=schema_id, version=1))
    assert (full.description, list(full.tags), full.created_by) == (
        "first",
        ["team-a"],
        "danube-py",
    )
    assert full.compatibility_mode == "backward"
    listed = await server.stub.ListVersions(pb.ListVersionsRequest(subject="users"))
    assert [(v.version, v.schema_id, v.description) for v in listed.versions] == [
        (1, 1, "first"),
        (2, 1, ""),
    ]

    registered = await server.stub.RegisterSchema(
        pb.RegisterSchemaRequest(subject="users", schema_type="json_schema", schema_definition=USER)
    )
    assert (registered.version, registered.is_new_version) == (1, False)
    assert registered.fingerprint == first.fingerprint


async def test_pinned_producer_resolution(server: Server) -> None:
    """What TopicProducer does for with_schema_version(subject, 1) once v2 exists."""
    schema = server.schema
    for definition in (USER, USER_V2):
        builder = schema.register_schema("users").with_type(SchemaType.JSON_SCHEMA)
        await builder.with_schema_data(definition).execute()
    latest = await schema.get_latest_schema("users")
    pinned = await schema.get_schema_version(latest.schema_id, 1)
    assert (pinned.schema_id, pinned.version) == (latest.schema_id, 1)


async def test_compatibility_and_modes(server: Server) -> None:
    schema = server.schema
    avro_v1 = avro_record({"name": "name", "type": "string"})
    avro_v2 = avro_record({"name": "name", "type": "string"}, {"name": "age", "type": "int"})
    await (
        schema.register_schema("avro")
        .with_type(SchemaType.AVRO)
        .with_schema_data(avro_v1)
        .execute()
    )

    ok, errors = await schema.check_compatibility("avro", avro_v2, SchemaType.AVRO)
    assert not ok and any("age" in e for e in errors)
    ok, errors = await schema.check_compatibility(
        "avro", avro_v2, SchemaType.AVRO, CompatibilityMode.FORWARD
    )
    assert (ok, errors) == (True, [])

    register_v2 = (
        schema.register_schema("avro").with_type(SchemaType.AVRO).with_schema_data(avro_v2)
    )
    assert await status_of(register_v2.execute()) == grpc.StatusCode.FAILED_PRECONDITION

    success, message = await schema.set_compatibility_mode("avro", CompatibilityMode.NONE)
    assert success and "none" in message
    assert await register_v2.execute() == 1
    assert (await schema.get_latest_schema("avro")).version == 2

    success, message = await schema.delete_schema_version("avro", 2)
    assert success and "2" in message
    assert await schema.list_versions("avro") == [1]


async def test_topic_configuration(server: Server) -> None:
    schema = server.schema
    await (
        schema.register_schema("users")
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(USER)
        .execute()
    )

    success, message = await schema.configure_topic_schema(
        "/default/orders", "users", "enforce", True
    )
    assert success and "/default/orders" in message
    config = await schema.get_topic_schema_config("/default/orders")
    assert (
        config.schema_subject,
        config.validation_policy,
        config.enable_payload_validation,
        config.schema_id,
    ) == ("users", "enforce", True, 1)

    success, _ = await schema.update_topic_validation_policy("/default/orders", "warn")
    assert success
    config = await schema.get_topic_schema_config("/default/orders")
    assert (config.schema_subject, config.validation_policy) == ("users", "warn")
    assert not config.enable_payload_validation

    # Defaults of the client: policy "none", payload validation off.
    await schema.configure_topic_schema("/default/plain", "users")
    plain = await schema.get_topic_schema_config("/default/plain")
    assert (plain.validation_policy, plain.enable_payload_validation) == ("none", False)


async def test_error_statuses(server: Server) -> None:
    schema, stub = server.schema, server.stub
    not_found = grpc.StatusCode.NOT_FOUND
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert await status_of(schema.get_latest_schema("nobody")) == not_found
    assert await status_of(schema.get_schema_by_id(42)) == not_found
    assert await status_of(schema.list_versions("nobody")) == not_found
    assert await status_of(schema.delete_schema_version("nobody", 1)) == not_found
    assert await status_of(schema.set_compatibility_mode("nobody", CompatibilityMode.FULL)) == (
        not_found
    )
    assert await status_of(schema.check_compatibility("nobody", USER, SchemaType.JSON_SCHEMA)) == (
        not_found
    )
    assert await status_of(schema.configure_topic_schema("/default/t", "nobody")) == not_found
    assert await status_of(schema.get_topic_schema_config("/default/t")) == not_found

    protobuf = schema.register_schema("p").with_type(SchemaType.PROTOBUF)
    assert await status_of(protobuf.with_schema_data(b"syntax='proto3';").execute()) == invalid
    bad_json = schema.register_schema("j").with_type(SchemaType.JSON_SCHEMA)
    assert await status_of(bad_json.with_schema_data(b"{nope").execute()) == invalid

    await (
        schema.register_schema("users")
        .with_type(SchemaType.JSON_SCHEMA)
        .with_schema_data(USER)
        .execute()
    )
    bad_mode = pb.SetCompatibilityModeRequest(subject="users", compatibility_mode="sideways")
    assert await status_of(stub.SetCompatibilityMode(bad_mode)) == invalid
    assert await status_of(schema.configure_topic_schema("/default/t", "users", "strict")) == (
        invalid
    )
    assert await status_of(schema.update_topic_validation_policy("/default/t", "loud")) == invalid
    assert await status_of(schema.get_schema_version(1, 9)) == not_found


def test_retriable_errors_map_to_aborted() -> None:
    assert status_for(SchemaConflictError("busy")) == grpc.StatusCode.ABORTED


async def test_error_text_naming_a_long_subject_is_cut(server: Server) -> None:
    """Found by tests/fuzz/test_grpc.py: the error repeated the whole subject (up to 4 MB of
    request), past gRPC's header limit; the text is cut like the broker's own errors."""
    subject = "\U0001f600" * 5_000
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await server.stub.GetLatestSchema(pb.GetLatestSchemaRequest(subject=subject))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(caught.value.details() or "") <= 600
