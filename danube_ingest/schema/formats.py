"""Parsing, checking and fingerprinting schema definitions.

A definition is accepted when it parses for its type: Avro through ``fastavro.parse_schema``,
JSON Schema through the metaschema of its ``$schema`` draft (the latest draft when absent).
Avro arrays whose items encode to zero bytes are refused: a payload of a few bytes could
announce billions of them and stall payload validation.
``bytes``, ``string`` and ``number`` definitions are free text that is not interpreted.

The fingerprint is ``sha256:<hex>`` of the canonical form: for Avro and JSON Schema the JSON
document re-serialized with sorted keys and no whitespace, so formatting never creates a new
version; for the other types the type name, so a subject of such a type has a single version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import fastavro
import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from danube_ingest.schema.errors import InvalidSchemaError
from danube_ingest.schema.model import SchemaType

AVRO_PRIMITIVES = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_AVRO_COMPLEX = frozenset({"record", "error", "enum", "array", "map", "fixed"})


@dataclass(frozen=True)
class ParsedSchema:
    """A definition that passed its type's checks."""

    schema_type: SchemaType
    document: Any
    """The decoded JSON document (Avro, JSON Schema); None for the other types."""
    fingerprint: str


def parse_definition(schema_type: SchemaType, definition: bytes) -> ParsedSchema:
    """Check ``definition`` for ``schema_type``; :class:`InvalidSchemaError` says why it fails
    (a document nested past the interpreter's recursion limit included)."""
    try:
        return _parse_definition(schema_type, definition)
    except RecursionError:
        raise InvalidSchemaError(
            f"{schema_type.value} definition is nested too deeply to be checked"
        ) from None


def _parse_definition(schema_type: SchemaType, definition: bytes) -> ParsedSchema:
    if schema_type in (SchemaType.AVRO, SchemaType.JSON_SCHEMA):
        document = _load_json(schema_type, definition)
        if schema_type is SchemaType.AVRO:
            named: dict[str, Any] = {}
            _reject_empty_array_items(avro_schema(document, named), named, set())
        else:
            json_schema_validator(document)
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return ParsedSchema(schema_type, document, _sha256(canonical.encode()))
    return ParsedSchema(schema_type, None, _sha256(schema_type.value.encode()))


def avro_schema(document: Any, named_schemas: dict[str, Any] | None = None) -> Any:
    """``document`` parsed by fastavro (names fully qualified; named types are added to
    ``named_schemas``); :class:`InvalidSchemaError` if it is not a valid Avro schema."""
    _require_record_fields(document)
    try:
        return fastavro.parse_schema(document, named_schemas)
    except Exception as exc:  # fastavro raises several unrelated types for bad schemas
        raise InvalidSchemaError(f"invalid Avro schema: {exc}") from exc


def avro_deref(schema: Any, named: dict[str, Any]) -> Any:
    """A parsed Avro ``schema`` with named references replaced by their definitions and
    logical types by their underlying type: a primitive name, a union list or a complex dict."""
    while True:
        if isinstance(schema, str):
            if schema in AVRO_PRIMITIVES:
                return schema
            schema = named[schema]
        elif isinstance(schema, dict) and not (
            isinstance(schema.get("type"), str) and schema["type"] in _AVRO_COMPLEX
        ):
            schema = schema["type"]
        else:
            return schema


def _reject_empty_array_items(schema: Any, named: dict[str, Any], seen: set[str]) -> None:
    """Refuse arrays whose items encode to zero bytes (null, empty records, fixed of size 0).

    A few bytes can then announce billions of items, and decoding such a payload would block
    the event loop for minutes; no useful schema needs them.
    """
    schema = avro_deref(schema, named)
    if isinstance(schema, list):
        for branch in schema:
            _reject_empty_array_items(branch, named, seen)
        return
    if not isinstance(schema, dict):
        return
    kind = schema["type"]
    if kind in ("record", "error"):
        if schema["name"] in seen:
            return
        seen.add(schema["name"])
        for field in schema["fields"]:
            _reject_empty_array_items(field["type"], named, seen)
    elif kind == "map":
        _reject_empty_array_items(schema["values"], named, seen)
    elif kind == "array":
        if _encodes_to_nothing(schema["items"], named, set()):
            raise InvalidSchemaError(
                "unsupported Avro schema: array items that encode to zero bytes (null, empty "
                "records or fixed of size 0) cannot be validated safely"
            )
        _reject_empty_array_items(schema["items"], named, seen)


def _encodes_to_nothing(schema: Any, named: dict[str, Any], visiting: set[str]) -> bool:
    schema = avro_deref(schema, named)
    if schema == "null":
        return True
    if not isinstance(schema, dict):
        return False  # other primitives and unions always write at least one byte
    if schema["type"] == "fixed":
        return bool(schema["size"] == 0)
    if schema["type"] in ("record", "error") and schema["name"] not in visiting:
        visiting.add(schema["name"])
        return all(_encodes_to_nothing(f["type"], named, visiting) for f in schema["fields"])
    return False


def _require_record_fields(schema: Any) -> None:
    """fastavro reads a record without ``fields`` as an empty record; the specification
    requires the list, and so does the Danube broker."""
    if isinstance(schema, list):
        for branch in schema:
            _require_record_fields(branch)
    elif isinstance(schema, dict):
        if schema.get("type") in ("record", "error") and not isinstance(schema.get("fields"), list):
            raise InvalidSchemaError(
                f"invalid Avro schema: record {schema.get('name')!r} has no fields list"
            )
        for key in ("type", "fields", "items", "values"):
            if key in schema:
                _require_record_fields(schema[key])


def json_schema_validator(document: Any) -> Any:
    """A compiled ``jsonschema`` validator for ``document``; :class:`InvalidSchemaError` if
    the document is not a valid JSON Schema."""
    if not isinstance(document, dict | bool):
        raise InvalidSchemaError("invalid JSON Schema: the document must be an object or boolean")
    cls = jsonschema.validators.validator_for(document)
    try:
        cls.check_schema(document)
    except jsonschema.exceptions.SchemaError as exc:
        raise InvalidSchemaError(f"invalid JSON Schema: {exc.message}") from exc
    return cls(document)


def _load_json(schema_type: SchemaType, definition: bytes) -> Any:
    try:
        return json.loads(definition)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidSchemaError(
            f"{schema_type.value} definition is not valid JSON: {exc}"
        ) from exc


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
