"""Builders for the schema definitions used across the schema tests."""

from __future__ import annotations

import json


def avro_record(*fields: dict[str, object], name: str = "User") -> bytes:
    """An Avro record schema named ``name`` with ``fields``."""
    return json.dumps({"type": "record", "name": name, "fields": list(fields)}).encode()


def json_object(
    properties: dict[str, object], required: list[str] | None = None, **extra: object
) -> bytes:
    """A JSON Schema for an object with ``properties`` and ``required``."""
    schema: dict[str, object] = {"type": "object", "properties": properties, **extra}
    if required is not None:
        schema["required"] = required
    return json.dumps(schema).encode()
