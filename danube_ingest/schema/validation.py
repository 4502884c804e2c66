"""Checking messages against their topic's schema configuration.

A message passes when its topic has a subject, the message carries a schema id of that subject
and, with payload validation enabled, the payload decodes under the version it names:

* ``json_schema`` — UTF-8 JSON that satisfies the JSON Schema;
* ``avro`` — exactly one schemaless Avro datum (``fastavro.schemaless_reader``), no trailing bytes;
* ``string`` — valid UTF-8;
* ``number`` — 4 or 8 bytes (a binary int32/float or int64/double, as Danube checks) or a
  decimal number in ASCII;
* ``bytes`` — anything.

What happens to a message that fails depends on the policy: ``none`` accepts without checking,
``warn`` logs a warning and accepts, ``enforce`` raises :class:`PayloadValidationError`.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable

import fastavro
import jsonschema.exceptions

from danube_ingest.schema.errors import PayloadValidationError
from danube_ingest.schema.formats import avro_schema, json_schema_validator
from danube_ingest.schema.model import (
    SchemaType,
    SchemaVersion,
    TopicSchemaConfig,
    ValidationPolicy,
)

log = logging.getLogger(__name__)

Check = Callable[[bytes], str | None]
"""A compiled payload check: the reason a payload is invalid, or None."""


class PayloadValidator:
    """Applies topic validation policies; keeps compiled checks per (schema id, version).

    Versions are immutable, so a compiled check never goes stale. ``cache_size`` bounds the
    number kept (least recently used are dropped).
    """

    def __init__(self, cache_size: int = 1024) -> None:
        self._cache_size = cache_size
        self._checks: OrderedDict[tuple[int, int], Check] = OrderedDict()

    def validate(
        self, config: TopicSchemaConfig, payload: bytes, schema: SchemaVersion | None
    ) -> str | None:
        """Check a message of ``config.topic`` that carries ``schema`` (None: no schema id).

        Returns None when the message passes or the policy is ``none``; the reason when it
        fails under ``warn`` (after logging it); raises :class:`PayloadValidationError` when it
        fails under ``enforce``.
        """
        if config.validation_policy is ValidationPolicy.NONE:
            return None
        return self.reject(config, self._failure(config, payload, schema), schema)

    def reject(
        self, config: TopicSchemaConfig, reason: str | None, schema: SchemaVersion | None = None
    ) -> str | None:
        """Apply ``config``'s policy to a message that failed for ``reason`` (None: it did not).

        Used directly when the failure was found before a version could be resolved (an
        unknown schema id).
        """
        if reason is None or config.validation_policy is ValidationPolicy.NONE:
            return None
        if config.validation_policy is ValidationPolicy.ENFORCE:
            raise PayloadValidationError(config.topic, reason)
        log.warning(
            "schema validation failed topic=%s policy=warn subject=%s schema_id=%s version=%s "
            "reason=%s",
            config.topic,
            config.subject,
            schema.schema_id if schema else None,
            schema.version if schema else None,
            reason,
        )
        return reason

    def check_payload(self, schema: SchemaVersion, payload: bytes) -> str | None:
        """Why ``payload`` does not decode under ``schema``, or None if it does."""
        key = (schema.schema_id, schema.version)
        check = self._checks.get(key)
        if check is None:
            check = _compile(schema)
            self._checks[key] = check
            if len(self._checks) > self._cache_size:
                self._checks.popitem(last=False)
        else:
            self._checks.move_to_end(key)
        return check(payload)

    def forget(self, schema_id: int, version: int) -> None:
        """Drop the compiled check of a deleted version."""
        self._checks.pop((schema_id, version), None)

    def _failure(
        self, config: TopicSchemaConfig, payload: bytes, schema: SchemaVersion | None
    ) -> str | None:
        if config.subject is None:
            # Like Danube: only ``enforce`` rejects messages of a topic without a subject.
            if config.validation_policy is ValidationPolicy.ENFORCE:
                return "the topic requires a schema but none is configured"
            return None
        if schema is None:
            return f"message carries no schema_id (topic requires subject {config.subject!r})"
        if schema.subject != config.subject:
            return (
                f"schema_id {schema.schema_id} belongs to subject {schema.subject!r}, "
                f"but the topic requires {config.subject!r}"
            )
        if not config.enable_payload_validation:
            return None
        reason = self.check_payload(schema, payload)
        if reason is None:
            return None
        return f"payload does not match {schema.subject!r} version {schema.version}: {reason}"


def _compile(schema: SchemaVersion) -> Check:
    if schema.schema_type is SchemaType.JSON_SCHEMA:
        return _json_check(schema.definition)
    if schema.schema_type is SchemaType.AVRO:
        return _avro_check(schema.definition)
    if schema.schema_type is SchemaType.STRING:
        return _check_utf8
    if schema.schema_type is SchemaType.NUMBER:
        return _check_number
    return _check_nothing


def _json_check(definition: bytes) -> Check:
    validator = json_schema_validator(json.loads(definition))

    def check(payload: bytes) -> str | None:
        try:
            document = json.loads(payload)
            error = jsonschema.exceptions.best_match(validator.iter_errors(document))
        except (UnicodeDecodeError, ValueError) as exc:
            return f"not a JSON document: {exc}"
        except RecursionError:
            return "JSON document nested too deeply to be checked"
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{error.message} (at /{where})"

    return check


def _avro_check(definition: bytes) -> Check:
    parsed = avro_schema(json.loads(definition))

    def check(payload: bytes) -> str | None:
        stream = io.BytesIO(payload)
        try:
            fastavro.schemaless_reader(stream, parsed, None)
        except Exception as exc:  # a corrupt datum surfaces as many unrelated exception types
            return f"not an Avro datum of this schema: {type(exc).__name__}: {exc}"
        if stream.tell() != len(payload):
            return f"{len(payload) - stream.tell()} bytes left over after the Avro datum"
        return None

    return check


def _check_utf8(payload: bytes) -> str | None:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8: {exc}"
    return None


def _check_number(payload: bytes) -> str | None:
    if len(payload) in (4, 8):
        return None
    try:
        if math.isfinite(float(payload.decode("ascii"))):
            return None
    except (UnicodeDecodeError, ValueError):
        pass
    return f"expected a 4- or 8-byte number or decimal text, got {len(payload)} bytes"


def _check_nothing(payload: bytes) -> str | None:
    return None
