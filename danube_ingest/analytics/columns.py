"""The Arrow columns of a topic's rows, and how Avro and JSON Schema types map onto them.

Every row has the fixed columns of :data:`FIXED_SCHEMA`, in this order::

    offset int64 | ingest_time timestamp[us, UTC] | publish_time timestamp[us, UTC]
    | producer string | routing_key string | attributes map<string, string>
    | schema_subject string | schema_id int64 | schema_version int32 | payload binary

then, for a topic whose subject is Avro or JSON Schema, the payload's fields as typed columns,
then ``decode_error string`` (:func:`table_schema`). Every type is one Spark reads and writes
as is (Spark's Arrow mapping: list items are named ``element``, map keys are not null), so
``from_arrow_schema`` and ``to_arrow_schema`` give this schema back exactly.

Records become top-level columns (the top-level record is flattened one level; nested records
stay structs): analysts select and filter ``amount``, not ``value.amount``, and Parquet prunes
each column; nested records keep their shape, so two nested fields with one name never clash.
A decoded name equal to a fixed column, ``decode_error`` or a directory column of the warehouse
(``namespace``, ``topic``, ``date``, ``hour``, ``minute``) gets a ``value_`` prefix.

Type mapping (every decoded column is nullable: a message that does not decode has nulls)::

    Avro                                  Arrow
    null | boolean | int | long           null | bool | int32 | int64
    float | double | bytes, fixed         float32 | float64 | binary
    string, enum, uuid                    string
    record | array | map                  struct | list<element> | map<string, V>
    [null, T] (either order)              T, nullable
    other unions, recursive records       string: the value as JSON text
    date                                  date32
    timestamp-millis/-micros              timestamp[us, UTC]
    local-timestamp-millis/-micros        timestamp[us] (Spark TIMESTAMP_NTZ)
    time-millis/-micros                   int64, microseconds after midnight
    decimal(p <= 38, s)                   decimal128(p, s); wider decimals: string

    JSON Schema                           Arrow
    string | integer | number | boolean   string | int64 | float64 | bool
    string, format date-time | date       timestamp[us, UTC] (no offset: UTC) | date32
    object with properties                struct (the root object: top-level columns)
    object with additionalProperties only map<string, V>
    array with items                      list<element>
    [T, "null"]                           T, nullable
    enum / const of strings               string
    anything else (several types, anyOf,
    oneOf, no type, recursive $ref)       string: the value as JSON text

A root schema that is not a record (Avro) or an object with properties (JSON Schema) gives one
column named ``value``.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from danube_ingest.analytics.decode import SchemaDecoder

__all__ = [
    "DEAD_LETTER_SCHEMA",
    "DECODE_ERROR",
    "FIXED_SCHEMA",
    "RESERVED_NAMES",
    "Column",
    "avro_columns",
    "column_names",
    "json_schema_columns",
    "table_schema",
]

UTC_MICROS = pa.timestamp("us", tz="UTC")

FIXED_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("ingest_time", UTC_MICROS, nullable=False),
        pa.field("publish_time", UTC_MICROS, nullable=False),
        pa.field("producer", pa.string(), nullable=False),
        pa.field("routing_key", pa.string()),
        pa.field("attributes", pa.map_(pa.string(), pa.string()), nullable=False),
        pa.field("schema_subject", pa.string()),
        pa.field("schema_id", pa.int64()),
        pa.field("schema_version", pa.int32()),
        pa.field("payload", pa.binary(), nullable=False),
    ]
)
"""The columns every row has, in order."""

DECODE_ERROR = pa.field("decode_error", pa.string())
"""The last column: why the payload did not decode; null when it did or the topic has no
Avro or JSON Schema."""

DEAD_LETTER_SCHEMA = pa.schema([*FIXED_SCHEMA, DECODE_ERROR])
"""The columns of dead letters (rows that did not decode, kept apart): the fixed columns, raw
``payload`` included, and ``decode_error``."""

RESERVED_NAMES = frozenset(
    [*FIXED_SCHEMA.names, DECODE_ERROR.name, "namespace", "topic", "date", "hour", "minute"]
)
"""Names a decoded column may not take (it gets a ``value_`` prefix): the fixed columns and
the warehouse's directory columns."""

#: Largest decimal precision Spark (and decimal128) holds.
_MAX_PRECISION = 38

Convert = Callable[[Any], Any]
"""Turns a decoded value (never None) into what ``pa.array`` takes for the column's type."""


@dataclass(frozen=True, slots=True)
class Column:
    """One decoded column: its Arrow field and how to convert decoded values for it."""

    source: str
    """The field's name in the payload (the column may be renamed, see ``RESERVED_NAMES``);
    empty for the one column ``value`` holding a whole payload that is not a record."""
    field: pa.Field
    convert: Convert | None
    """None when decoded values are already what ``pa.array`` takes (the common case)."""


class _Mapped:
    """An Arrow type with its nullability and converter."""

    __slots__ = ("convert", "nullable", "type")

    def __init__(
        self, type_: pa.DataType, convert: Convert | None = None, nullable: bool = False
    ) -> None:
        self.type = type_
        self.convert = convert
        self.nullable = nullable


def table_schema(decoder: SchemaDecoder | None) -> pa.Schema:
    """The Arrow schema of a topic's rows: the fixed columns, the decoded columns of
    ``decoder`` (none without one), ``decode_error``."""
    decoded = [] if decoder is None else [c.field for c in decoder.columns]
    return pa.schema([*FIXED_SCHEMA, *decoded, DECODE_ERROR])


def column_names(sources: list[str]) -> list[str]:
    """Column names for decoded top-level fields: ``value_`` before a reserved or taken name."""
    taken = set(RESERVED_NAMES)
    names = []
    for source in sources:
        name = source
        while name in taken:
            name = f"value_{name}"
        taken.add(name)
        names.append(name)
    return names


def _columns(fields: list[tuple[str, _Mapped]]) -> list[Column]:
    names = column_names([source or "value" for source, _ in fields])
    return [
        Column(source, pa.field(name, mapped.type, nullable=True), mapped.convert)
        for name, (source, mapped) in zip(names, fields, strict=True)
    ]


# Avro


def avro_columns(schema: Any) -> list[Column]:
    """The decoded columns of a parsed Avro schema (``fastavro.parse_schema`` output)."""
    named: dict[str, Any] = {}
    _collect_named(schema, named)
    root = _deref(schema, named)
    if isinstance(root, dict) and root.get("type") in ("record", "error"):
        fields = [
            (f["name"], _avro(f["type"], named, frozenset({root["name"]}))) for f in root["fields"]
        ]
    else:
        fields = [("", _avro(schema, named, frozenset()))]
    return _columns(fields)


def _collect_named(schema: Any, named: dict[str, Any]) -> None:
    if isinstance(schema, list):
        for branch in schema:
            _collect_named(branch, named)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        if kind in ("record", "error", "enum", "fixed") and "name" in schema:
            named[schema["name"]] = schema
        for key in ("type", "items", "values"):
            if key in schema and not isinstance(schema[key], str):
                _collect_named(schema[key], named)
        for field in schema.get("fields", ()) if kind in ("record", "error") else ():
            _collect_named(field["type"], named)


def _deref(schema: Any, named: Mapping[str, Any]) -> Any:
    while isinstance(schema, str) and schema in named:
        schema = named[schema]
    return schema


def _avro(schema: Any, named: Mapping[str, Any], visiting: frozenset[str]) -> _Mapped:
    schema = _deref(schema, named)
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        if len(branches) == 1:
            inner = _avro(branches[0], named, visiting)
            return _Mapped(inner.type, inner.convert, nullable=len(schema) > 1 or inner.nullable)
        return _Mapped(pa.string(), _json_text, nullable="null" in schema)
    if isinstance(schema, str):
        return _avro_primitive(schema)
    kind = schema["type"]
    logical = schema.get("logicalType")
    if kind in ("record", "error"):
        name = schema["name"]
        if name in visiting:
            return _Mapped(pa.string(), _json_text, nullable=True)
        within = visiting | {name}
        fields = [(f["name"], _avro(f["type"], named, within)) for f in schema["fields"]]
        return _struct(fields)
    if kind == "array":
        return _list(_avro(schema["items"], named, visiting))
    if kind == "map":
        return _map(_avro(schema["values"], named, visiting))
    if kind == "enum":
        return _Mapped(pa.string())
    if logical == "decimal":
        return _decimal(int(schema["precision"]), int(schema.get("scale", 0)))
    if kind == "fixed":
        return _Mapped(pa.binary())
    if isinstance(kind, dict | list):  # {"type": {...}} wrappers
        return _avro(kind, named, visiting)
    if logical == "date":
        return _Mapped(pa.date32())
    if logical in ("timestamp-millis", "timestamp-micros"):
        return _Mapped(UTC_MICROS)
    if logical in ("local-timestamp-millis", "local-timestamp-micros"):
        return _Mapped(pa.timestamp("us"))
    if logical in ("time-millis", "time-micros"):
        return _Mapped(pa.int64(), _time_micros)
    if logical == "uuid":
        return _Mapped(pa.string(), str)
    return _avro_primitive(kind)


_AVRO_PRIMITIVES: dict[str, pa.DataType] = {
    "null": pa.null(),
    "boolean": pa.bool_(),
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "bytes": pa.binary(),
    "string": pa.string(),
}


def _avro_primitive(name: str) -> _Mapped:
    return _Mapped(_AVRO_PRIMITIVES[name], nullable=name == "null")


def _decimal(precision: int, scale: int) -> _Mapped:
    if precision <= _MAX_PRECISION:
        return _Mapped(pa.decimal128(precision, scale))
    return _Mapped(pa.string(), str)


def _time_micros(value: Any) -> int:
    if isinstance(value, dt.time):
        return ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + (
            value.microsecond
        )
    return int(value)


# JSON Schema


def json_schema_columns(document: Any) -> list[Column]:
    """The decoded columns of a JSON Schema document."""
    root = _resolve(document, document)
    if isinstance(root, dict) and _types(root) in (["object"], []) and "properties" in root:
        fields = [
            (name, _json(sub, document, frozenset())) for name, sub in root["properties"].items()
        ]
    else:
        fields = [("", _json(document, document, frozenset()))]
    return _columns(fields)


def _resolve(schema: Any, document: Any) -> Any:
    """``schema`` with a local ``$ref`` (``#/...``) followed; other refs are left as they are."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return {}
        target: Any = document
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return {}
            target = target[part]
        schema = target
        seen += 1
    return schema


def _types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return []


def _json(schema: Any, document: Any, visiting: frozenset[int]) -> _Mapped:
    if isinstance(schema, dict) and "$ref" in schema:
        if id(schema) in visiting:
            return _Mapped(pa.string(), _json_text, nullable=True)
        visiting = visiting | {id(schema)}
        schema = _resolve(schema, document)
    if not isinstance(schema, dict):
        return _Mapped(pa.string(), _json_text, nullable=True)
    types = _types(schema)
    nullable = "null" in types
    kinds = [t for t in types if t != "null"]
    if not kinds:
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if values and all(isinstance(v, str) for v in values):
            return _Mapped(pa.string(), nullable=True)
        return _Mapped(pa.string(), _json_text, nullable=True)
    if len(kinds) > 1 or any(k in schema for k in ("anyOf", "oneOf")):
        return _Mapped(pa.string(), _json_text, nullable=nullable)
    kind = kinds[0]
    mapped: _Mapped
    if kind == "string":
        fmt = schema.get("format")
        if fmt == "date-time":
            mapped = _Mapped(UTC_MICROS, _parse_datetime)
        elif fmt == "date":
            mapped = _Mapped(pa.date32(), dt.date.fromisoformat)
        else:
            mapped = _Mapped(pa.string())
    elif kind == "integer":
        mapped = _Mapped(pa.int64(), _integer)
    elif kind == "number":
        mapped = _Mapped(pa.float64(), float)
    elif kind == "boolean":
        mapped = _Mapped(pa.bool_())
    elif kind == "array" and isinstance(schema.get("items"), dict):
        mapped = _list(_json(schema["items"], document, visiting))
    elif kind == "object" and isinstance(schema.get("properties"), dict):
        required = set(schema.get("required", ()))
        fields = []
        for name, sub in schema["properties"].items():
            inner = _json(sub, document, visiting)
            fields.append((name, _nullable(inner) if name not in required else inner))
        mapped = _struct(fields)
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        mapped = _map(_json(schema["additionalProperties"], document, visiting))
    else:
        mapped = _Mapped(pa.string(), _json_text)
    mapped.nullable = mapped.nullable or nullable
    return mapped


def _nullable(mapped: _Mapped) -> _Mapped:
    return _Mapped(mapped.type, mapped.convert, nullable=True)


def _parse_datetime(value: str) -> dt.datetime:
    parsed = dt.datetime.fromisoformat(value)
    return parsed.replace(tzinfo=dt.UTC) if parsed.tzinfo is None else parsed


def _integer(value: Any) -> int:
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{value} is not an integer")
        return int(value)
    return int(value)


# Shared


def _struct(fields: list[tuple[str, _Mapped]]) -> _Mapped:
    arrow = pa.struct([pa.field(name, m.type, nullable=m.nullable) for name, m in fields])
    converters = [(name, m.convert) for name, m in fields if m.convert is not None]
    if not converters:
        return _Mapped(arrow)

    def convert(value: dict[str, Any]) -> dict[str, Any]:
        out = dict(value)
        for name, fn in converters:
            item = out.get(name)
            if item is not None:
                out[name] = fn(item)
        return out

    return _Mapped(arrow, convert)


def _list(items: _Mapped) -> _Mapped:
    arrow = pa.list_(pa.field("element", items.type, nullable=items.nullable))
    fn = items.convert
    if fn is None:
        return _Mapped(arrow)
    return _Mapped(arrow, lambda value: [None if v is None else fn(v) for v in value])


def _map(values: _Mapped) -> _Mapped:
    arrow = pa.map_(pa.string(), pa.field("value", values.type, nullable=values.nullable))
    fn = values.convert
    if fn is None:
        return _Mapped(arrow)
    return _Mapped(arrow, lambda value: {k: None if v is None else fn(v) for k, v in value.items()})


def _json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
