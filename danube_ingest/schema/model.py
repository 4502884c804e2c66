"""Value types of the schema registry: wire strings, registered versions, topic configuration.

Every enum's ``value`` is the lowercase string Danube puts on the wire (``danube-client`` sends
``"json_schema"``, ``"backward"``, ``"enforce"``...); ``parse`` also accepts the aliases the
Danube broker accepts and any letter case.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from danube_ingest.schema.errors import InvalidSchemaError


class SchemaType(Enum):
    """What a subject's definitions describe and how payloads are checked."""

    BYTES = "bytes"
    """Any payload; the definition is ignored."""
    STRING = "string"
    """UTF-8 text."""
    NUMBER = "number"
    """A 4- or 8-byte binary number (Danube's rule) or a decimal number as ASCII text."""
    AVRO = "avro"
    """An Avro schema (JSON); payloads are single schemaless Avro datums."""
    JSON_SCHEMA = "json_schema"
    """A JSON Schema document; payloads are JSON documents."""

    @staticmethod
    def parse(value: str) -> SchemaType:
        """The type named by ``value``; :class:`InvalidSchemaError` if unknown or unsupported."""
        name = value.strip().lower()
        found = _SCHEMA_TYPE_ALIASES.get(name)
        if found is not None:
            return found
        if name in ("protobuf", "proto"):
            raise InvalidSchemaError(
                "protobuf schemas are not supported; use avro, json_schema, string, number or bytes"
            )
        raise InvalidSchemaError(
            f"unknown schema type {value!r}; expected one of "
            f"{', '.join(t.value for t in SchemaType)}"
        )


_SCHEMA_TYPE_ALIASES: dict[str, SchemaType] = {
    **{t.value: t for t in SchemaType},
    "json": SchemaType.JSON_SCHEMA,
    "jsonschema": SchemaType.JSON_SCHEMA,
    "int": SchemaType.NUMBER,
    "int64": SchemaType.NUMBER,
    "float": SchemaType.NUMBER,
    "double": SchemaType.NUMBER,
}


class CompatibilityMode(Enum):
    """Which existing versions a new version of a subject must stay compatible with.

    BACKWARD: data written with the old schema can be read with the new one. FORWARD: data
    written with the new schema can be read with the old one. FULL: both. The plain modes compare
    with the latest version; the ``_TRANSITIVE`` modes with every live version.
    """

    NONE = "none"
    BACKWARD = "backward"
    FORWARD = "forward"
    FULL = "full"
    BACKWARD_TRANSITIVE = "backward_transitive"
    FORWARD_TRANSITIVE = "forward_transitive"
    FULL_TRANSITIVE = "full_transitive"

    @property
    def transitive(self) -> bool:
        return self.value.endswith("_transitive")

    @property
    def backward(self) -> bool:
        """True when new versions must read data written with older ones."""
        return self.value.startswith(("backward", "full"))

    @property
    def forward(self) -> bool:
        """True when older versions must read data written with new ones."""
        return self.value.startswith(("forward", "full"))

    @staticmethod
    def parse(value: str) -> CompatibilityMode:
        try:
            return CompatibilityMode(value.strip().lower())
        except ValueError:
            raise InvalidSchemaError(
                f"unknown compatibility mode {value!r}; expected one of "
                f"{', '.join(m.value for m in CompatibilityMode)}"
            ) from None


DEFAULT_COMPATIBILITY_MODE = CompatibilityMode.BACKWARD
"""Danube's default for a new subject."""


class ValidationPolicy(Enum):
    """What the broker does with a message that does not satisfy its topic's schema."""

    NONE = "none"
    """Accept without checking."""
    WARN = "warn"
    """Check, log a warning, accept."""
    ENFORCE = "enforce"
    """Check and reject."""

    @staticmethod
    def parse(value: str) -> ValidationPolicy:
        try:
            return ValidationPolicy(value.strip().lower())
        except ValueError:
            raise InvalidSchemaError(
                f"invalid validation policy {value!r}; must be 'none', 'warn' or 'enforce'"
            ) from None


@dataclass(frozen=True)
class SchemaVersionInfo:
    """What is known about one registered version of a subject, without its definition."""

    schema_id: int
    """The subject's id: unique across subjects, the same for all of a subject's versions."""
    subject: str
    version: int
    """1, 2, ... in registration order; never reused, even after a deletion."""
    schema_type: SchemaType
    fingerprint: str
    """``sha256:<hex>`` of the canonical definition; equal fingerprints mean the same schema."""
    description: str
    created_at: int
    """Unix seconds."""
    created_by: str
    tags: tuple[str, ...]


@dataclass(frozen=True)
class SchemaVersion(SchemaVersionInfo):
    """One registered version with its definition. Immutable once registered."""

    definition: bytes
    """The definition exactly as first registered."""
    compatibility_mode: CompatibilityMode
    """The subject's mode when this record was read."""


class RegisterResult(NamedTuple):
    """What ``SchemaRegistry.register`` did."""

    schema_id: int
    """The subject's id."""
    version: int
    """The version holding the definition: new, or the existing one with the same fingerprint."""
    is_new_version: bool
    """False when an identical definition was already registered."""
    fingerprint: str


class CompatibilityResult(NamedTuple):
    is_compatible: bool
    errors: list[str]
    """One message per violated rule, naming the field; empty when compatible."""


@dataclass(frozen=True)
class TopicSchemaConfig:
    """How a topic's messages are checked against the schema registry."""

    topic: str
    subject: str | None
    """The subject whose versions messages must carry; None until one is assigned."""
    validation_policy: ValidationPolicy
    enable_payload_validation: bool
    """Also decode each payload against its version's definition (not just check its id)."""
    schema_id: int
    """The subject's schema id; 0 when no subject is assigned."""
