"""Parsing and fingerprinting definitions (danube_ingest/schema/formats.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
from schema_samples import avro_record

from danube_ingest.schema import InvalidSchemaError, SchemaType
from danube_ingest.schema.formats import parse_definition


def test_fingerprint_is_sha256_of_canonical_json() -> None:
    document = {"type": "record", "name": "U", "fields": [{"name": "a", "type": "int"}]}
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    parsed = parse_definition(SchemaType.AVRO, json.dumps(document, indent=4).encode())
    assert parsed.fingerprint == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert parsed.document == document


def test_defaults_and_docs_change_the_fingerprint() -> None:
    plain = parse_definition(SchemaType.AVRO, avro_record({"name": "a", "type": "int"}))
    with_default = parse_definition(
        SchemaType.AVRO, avro_record({"name": "a", "type": "int", "default": 1})
    )
    assert plain.fingerprint != with_default.fingerprint


def test_other_types_fingerprint_their_name() -> None:
    a = parse_definition(SchemaType.STRING, b"anything")
    b = parse_definition(SchemaType.STRING, b"")
    assert a.fingerprint == b.fingerprint == "sha256:" + hashlib.sha256(b"string").hexdigest()
    assert a.document is None


@pytest.mark.parametrize(
    "items",
    [
        "null",
        {"type": "record", "name": "Empty", "fields": []},
        {"type": "record", "name": "Nulls", "fields": [{"name": "n", "type": "null"}]},
        {"type": "fixed", "name": "Zero", "size": 0},
    ],
)
def test_arrays_of_zero_width_items_are_refused(items: object) -> None:
    nested = avro_record({"name": "xs", "type": {"type": "array", "items": items}})
    with pytest.raises(InvalidSchemaError, match="encode to zero bytes"):
        parse_definition(SchemaType.AVRO, nested)


def test_arrays_of_sized_items_are_accepted() -> None:
    node = avro_record(
        {"name": "children", "type": {"type": "array", "items": "Node"}},
        {"name": "tag", "type": ["null", "string"]},
        {"name": "flags", "type": {"type": "map", "values": "null"}},
        name="Node",
    )
    parse_definition(SchemaType.AVRO, node)
    parse_definition(SchemaType.AVRO, b'{"type": "array", "items": ["null", "int"]}')


def test_record_without_fields_is_refused() -> None:
    with pytest.raises(InvalidSchemaError, match="has no fields list"):
        parse_definition(SchemaType.AVRO, b'["null", {"type": "record", "name": "X"}]')


@pytest.mark.parametrize("schema_type", [SchemaType.JSON_SCHEMA, SchemaType.AVRO])
@pytest.mark.parametrize(
    "definition",
    [b"[" * 100_000, b'{"properties": {"a": ' * 300 + b"{}" + b"}}" * 300],
    ids=["past-the-parser", "past-the-validator"],
)
def test_definition_nested_too_deeply_is_invalid(
    schema_type: SchemaType, definition: bytes
) -> None:
    """Found by tests/fuzz/test_grpc.py: RecursionError escaped (the client saw UNKNOWN)."""
    with pytest.raises(InvalidSchemaError):
        parse_definition(schema_type, definition)
