"""Compatibility rules for Avro and JSON Schema (danube_ingest/schema/compatibility.py)."""

from __future__ import annotations

import json

import pytest
from schema_samples import avro_record, json_object

from danube_ingest.schema import CompatibilityMode, SchemaType
from danube_ingest.schema.compatibility import compatibility_errors
from danube_ingest.schema.formats import parse_definition

BACKWARD = CompatibilityMode.BACKWARD
FORWARD = CompatibilityMode.FORWARD
FULL = CompatibilityMode.FULL


def avro_errors(old: bytes, new: bytes, mode: CompatibilityMode) -> list[str]:
    return compatibility_errors(
        parse_definition(SchemaType.AVRO, new),
        [(1, parse_definition(SchemaType.AVRO, old))],
        mode,
    )


def json_errors(old: bytes, new: bytes, mode: CompatibilityMode) -> list[str]:
    return compatibility_errors(
        parse_definition(SchemaType.JSON_SCHEMA, new),
        [(1, parse_definition(SchemaType.JSON_SCHEMA, old))],
        mode,
    )


def avro(schema: object) -> bytes:
    return json.dumps(schema).encode()


NAME = {"name": "name", "type": "string"}


# Avro


@pytest.mark.parametrize(
    ("old", "new", "backward", "forward"),
    [
        pytest.param(
            avro_record(NAME),
            avro_record(NAME, {"name": "age", "type": "int"}),
            False,
            True,
            id="add-field-without-default",
        ),
        pytest.param(
            avro_record(NAME),
            avro_record(NAME, {"name": "age", "type": "int", "default": 0}),
            True,
            True,
            id="add-field-with-default",
        ),
        pytest.param(
            avro_record(NAME, {"name": "age", "type": "int"}),
            avro_record(NAME),
            True,
            False,
            id="remove-field-without-default",
        ),
        pytest.param(
            avro_record(NAME, {"name": "age", "type": "int", "default": 1}),
            avro_record(NAME),
            True,
            True,
            id="remove-field-with-default",
        ),
        pytest.param(
            avro_record({"name": "n", "type": "int"}),
            avro_record({"name": "n", "type": "long"}),
            True,
            False,
            id="promote-int-to-long",
        ),
        pytest.param(
            avro_record({"name": "n", "type": "float"}),
            avro_record({"name": "n", "type": "double"}),
            True,
            False,
            id="promote-float-to-double",
        ),
        pytest.param(
            avro_record({"name": "n", "type": "string"}),
            avro_record({"name": "n", "type": "bytes"}),
            True,
            True,
            id="string-bytes",
        ),
        pytest.param(
            avro_record({"name": "n", "type": "string"}),
            avro_record({"name": "n", "type": "int"}),
            False,
            False,
            id="change-type",
        ),
        pytest.param(
            avro_record({"name": "n", "type": "string"}),
            avro_record({"name": "n", "type": ["null", "string"], "default": None}),
            True,
            False,
            id="make-optional",
        ),
        pytest.param(
            avro_record({"name": "n", "type": ["null", "int"]}),
            avro_record({"name": "n", "type": ["null", "int", "string"]}),
            True,
            False,
            id="widen-union",
        ),
        pytest.param(
            avro_record({"name": "n", "type": {"type": "int", "logicalType": "date"}}),
            avro_record({"name": "n", "type": "int"}),
            True,
            True,
            id="logical-type-resolves-as-underlying",
        ),
        pytest.param(
            avro_record({"name": "xs", "type": {"type": "array", "items": "int"}}),
            avro_record({"name": "xs", "type": {"type": "array", "items": "long"}}),
            True,
            False,
            id="array-items",
        ),
        pytest.param(
            avro_record({"name": "m", "type": {"type": "map", "values": "long"}}),
            avro_record({"name": "m", "type": {"type": "map", "values": "int"}}),
            False,
            True,
            id="map-values",
        ),
        pytest.param(
            avro_record({"name": "f", "type": {"type": "fixed", "name": "F", "size": 4}}),
            avro_record({"name": "f", "type": {"type": "fixed", "name": "F", "size": 8}}),
            False,
            False,
            id="fixed-size",
        ),
        pytest.param(
            avro_record(NAME, name="User"),
            avro_record(NAME, name="Person"),
            False,
            False,
            id="rename-record",
        ),
        pytest.param(
            avro({"type": "record", "name": "a.User", "fields": [NAME]}),
            avro({"type": "record", "name": "b.User", "fields": [NAME]}),
            True,
            True,
            id="namespace-change-keeps-unqualified-name",
        ),
        pytest.param(
            avro_record({"name": "c", "type": {"type": "enum", "name": "C", "symbols": ["R"]}}),
            avro_record(
                {"name": "c", "type": {"type": "enum", "name": "C", "symbols": ["R", "G"]}}
            ),
            True,
            False,
            id="add-enum-symbol",
        ),
        pytest.param(
            avro_record(
                {
                    "name": "c",
                    "type": {"type": "enum", "name": "C", "symbols": ["R", "X"], "default": "X"},
                }
            ),
            avro_record(
                {"name": "c", "type": {"type": "enum", "name": "C", "symbols": ["R", "X", "G"]}}
            ),
            True,
            True,
            id="add-enum-symbol-with-reader-default",
        ),
        pytest.param(avro("int"), avro("long"), True, False, id="top-level-primitive"),
        pytest.param(avro(["null", "int"]), avro("int"), False, True, id="top-level-union"),
    ],
)
def test_avro_rules(old: bytes, new: bytes, backward: bool, forward: bool) -> None:
    assert (not avro_errors(old, new, BACKWARD)) is backward
    assert (not avro_errors(old, new, FORWARD)) is forward
    assert (not avro_errors(old, new, FULL)) is (backward and forward)
    assert avro_errors(old, new, CompatibilityMode.NONE) == []


def test_avro_errors_name_the_field_and_direction() -> None:
    nested_old = avro_record(
        {"name": "address", "type": avro_record_type("Address", {"name": "city", "type": "string"})}
    )
    nested_new = avro_record(
        {
            "name": "address",
            "type": avro_record_type(
                "Address", {"name": "city", "type": "string"}, {"name": "zip", "type": "string"}
            ),
        }
    )
    [error] = avro_errors(nested_old, nested_new, FULL)
    assert error.startswith("backward (new schema reading version 1 data): field 'address.zip'")
    assert "no default" in error


def test_avro_field_alias_matches_a_renamed_field() -> None:
    old = avro_record({"name": "fullname", "type": "string"})
    new = avro_record({"name": "name", "type": "string", "aliases": ["fullname"]})
    assert avro_errors(old, new, BACKWARD) == []
    assert avro_errors(old, new, FORWARD)  # the old reader has no alias for 'name'


def test_avro_record_alias_matches_a_renamed_record() -> None:
    old = avro_record(NAME, name="Person")
    new = avro({"type": "record", "name": "User", "aliases": ["Person"], "fields": [NAME]})
    assert avro_errors(old, new, BACKWARD) == []


def test_avro_recursive_types_terminate() -> None:
    def node(*extra: dict[str, object]) -> bytes:
        return avro_record(
            {"name": "value", "type": "int"},
            {"name": "next", "type": ["null", "Node"], "default": None},
            *extra,
            name="Node",
        )

    assert avro_errors(node(), node(), FULL) == []
    assert avro_errors(node(), node({"name": "tag", "type": "string", "default": ""}), FULL) == []
    assert avro_errors(node(), node({"name": "tag", "type": "string"}), BACKWARD)


def test_avro_named_type_references_resolve() -> None:
    color = {"type": "enum", "name": "Color", "symbols": ["R", "G"]}
    old = avro_record({"name": "a", "type": color}, {"name": "b", "type": "Color"})
    assert avro_errors(old, old, FULL) == []


def avro_record_type(name: str, *fields: dict[str, object]) -> dict[str, object]:
    return {"type": "record", "name": name, "fields": list(fields)}


# JSON Schema

PERSON = json_object({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name"])


@pytest.mark.parametrize(
    ("old", "new", "backward", "forward"),
    [
        pytest.param(
            PERSON,
            json_object(
                {"name": {"type": "string"}, "age": {"type": "integer"}, "x": {"type": "string"}},
                ["name"],
            ),
            True,
            True,
            id="add-optional-property",
        ),
        pytest.param(
            PERSON,
            json_object(
                {"name": {"type": "string"}, "age": {"type": "integer"}, "x": {"type": "string"}},
                ["name", "x"],
            ),
            False,
            True,
            id="add-required-property",
        ),
        pytest.param(
            PERSON,
            json_object({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name", "age"]),
            False,
            True,
            id="make-optional-required",
        ),
        pytest.param(
            PERSON,
            json_object({"age": {"type": "integer"}}),
            True,
            False,
            id="remove-required-property",
        ),
        pytest.param(
            PERSON,
            json_object({"name": {"type": "string"}}, ["name"]),
            True,
            True,
            id="remove-optional-property",
        ),
        pytest.param(
            PERSON,
            json_object({"name": {"type": "string"}, "age": {"type": "string"}}, ["name"]),
            False,
            False,
            id="change-property-type",
        ),
        pytest.param(
            PERSON,
            json_object({"name": {"type": "string"}, "age": {"type": "number"}}, ["name"]),
            True,
            False,
            id="widen-integer-to-number",
        ),
        pytest.param(
            PERSON,
            json_object(
                {"name": {"type": "string"}, "age": {"type": ["integer", "null"]}}, ["name"]
            ),
            True,
            False,
            id="allow-null",
        ),
        pytest.param(
            json_object({"c": {"enum": ["r", "g"]}}),
            json_object({"c": {"enum": ["r", "g", "b"]}}),
            True,
            False,
            id="widen-enum",
        ),
        pytest.param(
            PERSON,
            json_object({"name": {"type": "string"}}, ["name"], additionalProperties=False),
            False,
            True,
            id="close-content-model",
        ),
        pytest.param(
            json_object({"a": {"type": "string"}}, additionalProperties=False),
            json_object({"a": {"type": "string"}, "b": {"type": "string"}}),
            True,
            False,
            id="add-property-to-closed-reader",
        ),
        pytest.param(
            json_object({"a": {"$ref": "#/definitions/x"}}, definitions={"x": {"type": "string"}}),
            json_object({"a": {"$ref": "#/definitions/x"}}, definitions={"x": {"type": "integer"}}),
            True,
            True,
            id="ref-not-analysed",
        ),
        pytest.param(
            json_object({"a": {"type": "string"}}),
            json_object({"a": {}}),
            True,
            True,
            id="untyped-property-constrains-nothing",
        ),
        pytest.param(
            json.dumps({"type": "array", "items": {"type": "integer"}}).encode(),
            json.dumps({"type": "array", "items": {"type": "string"}}).encode(),
            False,
            False,
            id="array-items",
        ),
        pytest.param(
            json.dumps({"type": "string"}).encode(),
            json.dumps(False).encode(),
            False,
            True,
            id="new-schema-rejects-everything",
        ),
    ],
)
def test_json_rules(old: bytes, new: bytes, backward: bool, forward: bool) -> None:
    assert (not json_errors(old, new, BACKWARD)) is backward
    assert (not json_errors(old, new, FORWARD)) is forward
    assert (not json_errors(old, new, FULL)) is (backward and forward)
    assert json_errors(old, new, CompatibilityMode.NONE) == []


def test_json_errors_name_nested_fields() -> None:
    old = json_object({"address": {"type": "object", "properties": {"city": {"type": "string"}}}})
    new = json_object(
        {
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["zip"],
            }
        }
    )
    [error] = json_errors(old, new, FULL)
    assert error == (
        "backward (new schema reading version 1 data): field 'address.zip': required by the "
        "new schema but absent in the old schema"
    )


def test_json_type_change_message() -> None:
    [backward, forward] = json_errors(
        json_object({"id": {"type": "string"}}), json_object({"id": {"type": "integer"}}), FULL
    )
    assert "field 'id': type string (old) is not accepted by type integer (new)" in backward
    assert "field 'id': type integer (new) is not accepted by type string (old)" in forward


# Other types


@pytest.mark.parametrize("schema_type", [SchemaType.STRING, SchemaType.NUMBER, SchemaType.BYTES])
def test_primitive_types_are_compatible_with_themselves(schema_type: SchemaType) -> None:
    parsed = parse_definition(schema_type, b"")
    assert compatibility_errors(parsed, [(1, parsed)], FULL) == []


def test_schema_type_change_is_incompatible() -> None:
    old = parse_definition(SchemaType.STRING, b"")
    new = parse_definition(SchemaType.BYTES, b"")
    assert compatibility_errors(new, [(3, old)], BACKWARD) == [
        "version 3: schema type changes from string to bytes"
    ]
    assert compatibility_errors(new, [(3, old)], CompatibilityMode.NONE) == []


def test_transitive_modes_report_each_version() -> None:
    v1 = parse_definition(SchemaType.AVRO, avro_record(NAME))
    v2 = parse_definition(SchemaType.AVRO, avro_record(NAME, {"name": "a", "type": "int"}))
    new = parse_definition(
        SchemaType.AVRO,
        avro_record(NAME, {"name": "a", "type": "int"}, {"name": "b", "type": "int"}),
    )
    errors = compatibility_errors(new, [(2, v2), (1, v1)], CompatibilityMode.BACKWARD_TRANSITIVE)
    assert [e.split(":")[0] for e in errors] == [
        "backward (new schema reading version 2 data)",
        "backward (new schema reading version 1 data)",
        "backward (new schema reading version 1 data)",
    ]
