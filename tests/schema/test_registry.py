"""SchemaRegistry semantics on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest
from schema_samples import avro_record, json_object

from danube_ingest.schema import (
    CompatibilityMode,
    IncompatibleSchemaError,
    InvalidSchemaError,
    MemorySchemaStore,
    PayloadValidationError,
    SchemaMismatchError,
    SchemaNotFoundError,
    SchemaRegistry,
    SchemaType,
    TopicSchemaConfig,
    ValidationPolicy,
)

NAME = {"name": "name", "type": "string"}
AGE_DEFAULT = {"name": "age", "type": "int", "default": 0}
AGE = {"name": "age", "type": "int"}


class YieldingStore(MemorySchemaStore):
    """Yields to the event loop before every operation, so concurrent callers interleave."""

    async def get(self, key: str) -> bytes | None:
        await asyncio.sleep(0)
        return await super().get(key)

    async def put(self, key: str, value: bytes) -> None:
        await asyncio.sleep(0)
        await super().put(key, value)

    async def create_if_absent(self, key: str, value: bytes) -> bool:
        await asyncio.sleep(0)
        return await super().create_if_absent(key, value)

    async def compare_and_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        await asyncio.sleep(0)
        return await super().compare_and_set(key, expected, value)


async def test_first_registration_creates_subject_version_one(registry: SchemaRegistry) -> None:
    result = await registry.register(
        "users", "avro", avro_record(NAME), description="v1", created_by="me", tags=["a", "b"]
    )
    assert (result.schema_id, result.version, result.is_new_version) == (1, 1, True)
    assert result.fingerprint.startswith("sha256:") and len(result.fingerprint) == 71

    latest = await registry.get_latest("users")
    assert latest.schema_id == 1 and latest.version == 1
    assert latest.subject == "users"
    assert latest.schema_type is SchemaType.AVRO
    assert latest.definition == avro_record(NAME)
    assert latest.fingerprint == result.fingerprint
    assert (latest.description, latest.created_by, latest.tags) == ("v1", "me", ("a", "b"))
    assert latest.created_at == 1_700_000_000
    assert latest.compatibility_mode is CompatibilityMode.BACKWARD


async def test_same_definition_returns_existing_version(registry: SchemaRegistry) -> None:
    first = await registry.register("users", SchemaType.JSON_SCHEMA, json_object({"a": {}}))
    # Same document, different key order and whitespace: same canonical fingerprint.
    again = await registry.register(
        "users", "json_schema", b'{ "properties" : {"a": {}},\n "type": "object" }'
    )
    assert again == (first.schema_id, 1, False, first.fingerprint)
    assert [v.version for v in await registry.list_versions("users")] == [1]
    # The definition served is the one first registered.
    assert (await registry.get_latest("users")).definition == json_object({"a": {}})


async def test_schema_id_per_subject_stable_across_versions(registry: SchemaRegistry) -> None:
    a1 = await registry.register("a", "avro", avro_record(NAME))
    b1 = await registry.register("b", "avro", avro_record(NAME))
    a2 = await registry.register("a", "avro", avro_record(NAME, AGE_DEFAULT))
    assert a1.schema_id == a2.schema_id != b1.schema_id
    assert (a1.version, a2.version, b1.version) == (1, 2, 1)


async def test_get_by_id_and_version(registry: SchemaRegistry) -> None:
    v1 = await registry.register("users", "avro", avro_record(NAME))
    await registry.register("users", "avro", avro_record(NAME, AGE_DEFAULT))
    assert (await registry.get(v1.schema_id, 1)).definition == avro_record(NAME)
    assert (await registry.get(v1.schema_id)).version == 2
    assert (await registry.get(v1.schema_id, 0)).version == 2  # 0 means latest
    assert (await registry.get_version("users", 1)).version == 1
    with pytest.raises(SchemaNotFoundError):
        await registry.get(v1.schema_id, 3)
    with pytest.raises(SchemaNotFoundError):
        await registry.get(99)
    with pytest.raises(SchemaNotFoundError):
        await registry.get_latest("nobody")
    with pytest.raises(SchemaNotFoundError):
        await registry.list_versions("nobody")


async def test_list_versions_describes_each_version(registry: SchemaRegistry) -> None:
    await registry.register("users", "avro", avro_record(NAME), description="one", created_by="x")
    await registry.register("users", "avro", avro_record(NAME, AGE_DEFAULT), description="two")
    infos = await registry.list_versions("users")
    assert [(i.version, i.description, i.schema_id) for i in infos] == [
        (1, "one", 1),
        (2, "two", 1),
    ]
    assert infos[0].created_by == "x" and infos[0].fingerprint != infos[1].fingerprint


async def test_list_subjects_names_every_subject_in_order(registry: SchemaRegistry) -> None:
    assert await registry.list_subjects() == []
    await registry.register("users", "avro", avro_record(NAME))
    await registry.register("a/b c", "avro", avro_record(NAME))  # names are percent-encoded
    await registry.register("orders", "avro", avro_record(NAME))
    await registry.delete_version("orders", 1)
    assert await registry.list_subjects() == ["a/b c", "orders", "users"]


async def test_incompatible_version_is_rejected_and_not_stored(registry: SchemaRegistry) -> None:
    await registry.register("users", "avro", avro_record(NAME))
    with pytest.raises(IncompatibleSchemaError) as caught:
        await registry.register("users", "avro", avro_record(NAME, AGE))
    assert caught.value.mode == "backward"
    assert any("age" in e for e in caught.value.errors)
    assert "users" in str(caught.value)
    assert [v.version for v in await registry.list_versions("users")] == [1]


async def test_compatibility_mode_governs_registration(registry: SchemaRegistry) -> None:
    await registry.register("users", "avro", avro_record(NAME))
    await registry.set_compatibility_mode("users", "NONE")
    result = await registry.register("users", "avro", avro_record(NAME, AGE))
    assert result.version == 2
    assert (await registry.get_latest("users")).compatibility_mode is CompatibilityMode.NONE
    await registry.set_compatibility_mode("users", CompatibilityMode.FORWARD)
    with pytest.raises(IncompatibleSchemaError):
        await registry.register("users", "avro", avro_record(AGE))  # drops 'name': no default
    with pytest.raises(InvalidSchemaError):
        await registry.set_compatibility_mode("users", "sideways")
    with pytest.raises(SchemaNotFoundError):
        await registry.set_compatibility_mode("nobody", "full")


async def test_schema_type_change_needs_mode_none(registry: SchemaRegistry) -> None:
    await registry.register("s", "string", b"string")
    with pytest.raises(IncompatibleSchemaError, match="schema type changes from string"):
        await registry.register("s", "number", b"number")
    await registry.set_compatibility_mode("s", "none")
    assert (await registry.register("s", "number", b"number")).version == 2


async def test_primitive_types_have_one_version(registry: SchemaRegistry) -> None:
    first = await registry.register("s", "string", b"string")
    again = await registry.register("s", "string", b"any text at all")
    assert again == (first.schema_id, 1, False, first.fingerprint)


async def test_transitive_mode_checks_every_version(registry: SchemaRegistry) -> None:
    await registry.register("users", "avro", avro_record(NAME))
    await registry.set_compatibility_mode("users", "none")
    await registry.register("users", "avro", avro_record(NAME, AGE))
    candidate = avro_record(NAME, AGE, {"name": "nick", "type": "string", "default": ""})
    plain = await registry.check_compatibility("users", "avro", candidate, "backward")
    assert plain.is_compatible and plain.errors == []
    transitive = await registry.check_compatibility(
        "users", "avro", candidate, CompatibilityMode.BACKWARD_TRANSITIVE
    )
    assert not transitive.is_compatible
    assert any("version 1" in e and "age" in e for e in transitive.errors)


async def test_check_compatibility_defaults_to_subject_mode(registry: SchemaRegistry) -> None:
    await registry.register("users", "avro", avro_record(NAME))
    result = await registry.check_compatibility("users", "avro", avro_record(NAME, AGE))
    assert not result.is_compatible  # BACKWARD: new field without default
    assert (await registry.check_compatibility("users", "avro", avro_record(NAME, AGE), "")).errors
    forward = await registry.check_compatibility("users", "avro", avro_record(NAME, AGE), "forward")
    assert forward.is_compatible
    with pytest.raises(SchemaNotFoundError):
        await registry.check_compatibility("nobody", "avro", avro_record(NAME))
    with pytest.raises(InvalidSchemaError):
        await registry.check_compatibility("users", "avro", b"{not json")
    with pytest.raises(InvalidSchemaError):
        await registry.check_compatibility("users", "avro", avro_record(NAME), "diagonal")


async def test_delete_version(registry: SchemaRegistry) -> None:
    first = await registry.register("users", "avro", avro_record(NAME))
    await registry.register("users", "avro", avro_record(NAME, AGE_DEFAULT))
    await registry.delete_version("users", 2)
    assert [v.version for v in await registry.list_versions("users")] == [1]
    assert (await registry.get_latest("users")).version == 1
    with pytest.raises(SchemaNotFoundError):
        await registry.get(first.schema_id, 2)
    with pytest.raises(SchemaNotFoundError):
        await registry.delete_version("users", 2)
    with pytest.raises(SchemaNotFoundError):
        await registry.delete_version("nobody", 1)

    # Numbers are never reused, even for a definition registered before.
    again = await registry.register("users", "avro", avro_record(NAME, AGE_DEFAULT))
    assert (again.version, again.is_new_version, again.schema_id) == (3, True, first.schema_id)

    await registry.delete_version("users", 1)
    await registry.delete_version("users", 3)
    assert await registry.list_versions("users") == []
    with pytest.raises(SchemaNotFoundError):
        await registry.get_latest("users")
    # An emptied subject keeps its id and accepts any definition.
    revived = await registry.register("users", "avro", avro_record(AGE))
    assert (revived.schema_id, revived.version) == (first.schema_id, 4)


@pytest.mark.parametrize(
    ("schema_type", "definition", "message"),
    [
        ("protobuf", b"syntax = 'proto3';", "protobuf schemas are not supported"),
        ("xml", b"<a/>", "unknown schema type 'xml'"),
        ("avro", b"{not json", "not valid JSON"),
        ("avro", b'{"type": "record", "name": "X"}', "invalid Avro schema"),
        ("avro", b'{"type": "nope"}', "invalid Avro schema"),
        ("json_schema", b'{"type": 12}', "invalid JSON Schema"),
        ("json_schema", b"[1, 2]", "must be an object or boolean"),
        ("json_schema", b"\xff\xfe", "not valid JSON"),
    ],
)
async def test_invalid_definitions_are_rejected(
    registry: SchemaRegistry, schema_type: str, definition: bytes, message: str
) -> None:
    with pytest.raises(InvalidSchemaError, match=message):
        await registry.register("s", schema_type, definition)
    with pytest.raises(SchemaNotFoundError):
        await registry.get_latest("s")


async def test_empty_subject_is_rejected(registry: SchemaRegistry) -> None:
    with pytest.raises(InvalidSchemaError, match="subject name"):
        await registry.register("", "string", b"string")


async def test_type_aliases(registry: SchemaRegistry) -> None:
    await registry.register("j", "JSON", json_object({}))
    await registry.register("n", "int64", b"number")
    assert (await registry.get_latest("j")).schema_type is SchemaType.JSON_SCHEMA
    assert (await registry.get_latest("n")).schema_type is SchemaType.NUMBER


async def test_concurrent_registrations_never_share_a_version() -> None:
    registry = SchemaRegistry(YieldingStore())
    await registry.register("s", "avro", avro_record(NAME))
    await registry.set_compatibility_mode("s", "none")
    fields = [{"name": f"f{i}", "type": "int", "default": i} for i in range(10)]
    results = await asyncio.gather(
        *(registry.register("s", "avro", avro_record(NAME, f)) for f in fields)
    )
    assert sorted(r.version for r in results) == list(range(2, 12))
    assert [v.version for v in await registry.list_versions("s")] == list(range(1, 12))
    for result, field in zip(results, fields, strict=True):
        assert (await registry.get_version("s", result.version)).definition == avro_record(
            NAME, field
        )


async def test_concurrent_subject_creation() -> None:
    registry = SchemaRegistry(YieldingStore())
    distinct = await asyncio.gather(
        *(registry.register(f"s{i}", "string", b"string") for i in range(8))
    )
    assert sorted(r.schema_id for r in distinct) == list(range(1, 9))
    same = await asyncio.gather(*(registry.register("t", "string", b"string") for _ in range(5)))
    assert len({r.schema_id for r in same}) == 1
    assert sum(r.is_new_version for r in same) == 1
    assert (await registry.get(same[0].schema_id)).subject == "t"


async def test_records_survive_a_new_registry(store: MemorySchemaStore) -> None:
    first = SchemaRegistry(store)
    await first.register("users", "avro", avro_record(NAME))
    await first.set_compatibility_mode("users", "full")
    await first.configure_topic_schema("/default/t", "users", "enforce", True)

    second = SchemaRegistry(store)
    latest = await second.get_latest("users")
    assert (latest.version, latest.compatibility_mode) == (1, CompatibilityMode.FULL)
    config = await second.get_topic_schema_config("/default/t")
    assert config.validation_policy is ValidationPolicy.ENFORCE
    assert (await second.register("other", "string", b"string")).schema_id == 2


async def test_subject_names_are_opaque(registry: SchemaRegistry) -> None:
    await registry.register("/default/a", "string", b"string")
    await registry.register("/default/a/b", "bytes", b"bytes")
    assert (await registry.get_latest("/default/a")).schema_type is SchemaType.STRING
    assert (await registry.get_latest("/default/a/b")).schema_type is SchemaType.BYTES


async def test_configure_and_update_topic_schema(registry: SchemaRegistry) -> None:
    ids = await registry.register("users", "avro", avro_record(NAME))
    with pytest.raises(SchemaNotFoundError):
        await registry.configure_topic_schema("/default/t", "nobody", "warn")
    with pytest.raises(SchemaNotFoundError):
        await registry.get_topic_schema_config("/default/t")
    with pytest.raises(InvalidSchemaError, match="'strict'"):
        await registry.configure_topic_schema("/default/t", "users", "strict")

    config = await registry.configure_topic_schema("/default/t", "users", "WARN", True)
    assert config == TopicSchemaConfig("/default/t", "users", ValidationPolicy.WARN, True, 1)
    assert await registry.get_topic_schema_config("/default/t") == config

    updated = await registry.update_topic_validation_policy("/default/t", "enforce")
    assert updated == TopicSchemaConfig(
        "/default/t", "users", ValidationPolicy.ENFORCE, False, ids.schema_id
    )
    assert await registry.get_topic_schema_config("/default/t") == updated


async def test_update_policy_of_unconfigured_topic(registry: SchemaRegistry) -> None:
    config = await registry.update_topic_validation_policy("/default/t", "enforce", True)
    assert config == TopicSchemaConfig("/default/t", None, ValidationPolicy.ENFORCE, True, 0)
    with pytest.raises(PayloadValidationError, match="none is configured"):
        await registry.validate_message(config, b"x", None, None)


async def test_first_producer_assigns_subject(registry: SchemaRegistry) -> None:
    await registry.register("a", "string", b"string")
    await registry.register("b", "string", b"string")
    config = await registry.assign_topic_subject("/default/t", "a")
    assert config == TopicSchemaConfig("/default/t", "a", ValidationPolicy.WARN, False, 1)
    assert await registry.assign_topic_subject("/default/t", "a") == config
    with pytest.raises(SchemaMismatchError, match="'a'"):
        await registry.assign_topic_subject("/default/t", "b")
    with pytest.raises(SchemaNotFoundError):
        await registry.assign_topic_subject("/default/u", "nobody")
    # The administrator can rebind it.
    rebound = await registry.configure_topic_schema("/default/t", "b", "none")
    assert rebound.subject == "b" and rebound.schema_id == 2


async def test_first_producer_fills_a_policy_only_config(registry: SchemaRegistry) -> None:
    await registry.register("a", "string", b"string")
    await registry.update_topic_validation_policy("/default/t", "enforce", True)
    config = await registry.assign_topic_subject("/default/t", "a")
    assert config == TopicSchemaConfig("/default/t", "a", ValidationPolicy.ENFORCE, True, 1)


async def test_validate_message(registry: SchemaRegistry) -> None:
    users = await registry.register(
        "users", "json_schema", json_object({"n": {"type": "integer"}}, ["n"])
    )
    other = await registry.register("other", "string", b"string")
    config = await registry.configure_topic_schema("/default/t", "users", "enforce", True)

    assert await registry.validate_message(config, b'{"n": 1}', users.schema_id, 1) is None
    assert await registry.validate_message(config, b'{"n": 1}', users.schema_id, None) is None
    with pytest.raises(PayloadValidationError, match="'n' is a required property"):
        await registry.validate_message(config, b"{}", users.schema_id, 1)
    with pytest.raises(PayloadValidationError, match="no schema_id"):
        await registry.validate_message(config, b'{"n": 1}', None, None)
    with pytest.raises(PayloadValidationError, match="belongs to subject 'other'"):
        await registry.validate_message(config, b"text", other.schema_id, 1)
    with pytest.raises(PayloadValidationError, match="no schema with id 42"):
        await registry.validate_message(config, b"{}", 42, 1)
    with pytest.raises(PayloadValidationError, match="no version 7"):
        await registry.validate_message(config, b"{}", users.schema_id, 7)

    warn = await registry.update_topic_validation_policy("/default/t", "warn", True)
    reason = await registry.validate_message(warn, b"{}", users.schema_id, 1)
    assert reason is not None and "'n' is a required property" in reason

    off = await registry.update_topic_validation_policy("/default/t", "none")
    assert await registry.validate_message(off, b"garbage", 42, 1) is None


async def test_deleted_version_stops_validating_messages(registry: SchemaRegistry) -> None:
    users = await registry.register("users", "string", b"string")
    config = await registry.configure_topic_schema("/default/t", "users", "enforce")
    assert await registry.validate_message(config, b"ok", users.schema_id, 1) is None
    await registry.delete_version("users", 1)
    with pytest.raises(PayloadValidationError, match="has no live versions"):
        await registry.validate_message(config, b"ok", users.schema_id, 1)
