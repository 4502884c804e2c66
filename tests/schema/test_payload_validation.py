"""PayloadValidator: payload checks per schema type and the none / warn / enforce policies."""

from __future__ import annotations

import io
import json
import logging
import struct

import fastavro
import pytest
from schema_samples import avro_record, json_object

from danube_ingest.schema import (
    CompatibilityMode,
    PayloadValidationError,
    PayloadValidator,
    SchemaType,
    SchemaVersion,
    TopicSchemaConfig,
    ValidationPolicy,
)
from danube_ingest.schema import validation as validation_module

USER_AVRO = avro_record({"name": "name", "type": "string"}, {"name": "age", "type": "int"})
USER_JSON = json_object({"name": {"type": "string"}, "age": {"type": "integer"}}, ["name"])


def schema(
    schema_type: SchemaType,
    definition: bytes = b"",
    *,
    subject: str = "users",
    schema_id: int = 1,
    version: int = 1,
) -> SchemaVersion:
    return SchemaVersion(
        schema_id=schema_id,
        subject=subject,
        version=version,
        schema_type=schema_type,
        fingerprint="sha256:test",
        description="",
        created_at=0,
        created_by="",
        tags=(),
        definition=definition,
        compatibility_mode=CompatibilityMode.BACKWARD,
    )


def config(
    policy: ValidationPolicy = ValidationPolicy.ENFORCE,
    payload_validation: bool = True,
    subject: str | None = "users",
) -> TopicSchemaConfig:
    return TopicSchemaConfig("/default/t", subject, policy, payload_validation, 1)


def avro_datum(record: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(json.loads(USER_AVRO)), record)
    return out.getvalue()


@pytest.mark.parametrize(
    ("schema_type", "definition", "payload", "reason"),
    [
        (SchemaType.JSON_SCHEMA, USER_JSON, b'{"name": "a", "age": 3}', None),
        (SchemaType.JSON_SCHEMA, USER_JSON, b'{"age": 3}', "'name' is a required property"),
        (SchemaType.JSON_SCHEMA, USER_JSON, b'{"name": 1}', "1 is not of type 'string'"),
        (SchemaType.JSON_SCHEMA, USER_JSON, b"{oops", "not a JSON document"),
        (SchemaType.JSON_SCHEMA, USER_JSON, b"\xff", "not a JSON document"),
        # Found by the gRPC fuzzer's schema cases: RecursionError escaped (INTERNAL).
        (SchemaType.JSON_SCHEMA, USER_JSON, b"[" * 100_000, "nested too deeply"),
        (SchemaType.AVRO, USER_AVRO, avro_datum({"name": "a", "age": 3}), None),
        (SchemaType.AVRO, USER_AVRO, b"\x0a", "not an Avro datum"),
        (SchemaType.AVRO, USER_AVRO, avro_datum({"name": "a", "age": 3}) + b"!", "1 bytes left"),
        (SchemaType.STRING, b"", "héllo".encode(), None),
        (SchemaType.STRING, b"", b"\xff\xfe", "invalid UTF-8"),
        (SchemaType.NUMBER, b"", struct.pack(">i", 7), None),
        (SchemaType.NUMBER, b"", struct.pack(">d", 2.5), None),
        (SchemaType.NUMBER, b"", b"42", None),
        (SchemaType.NUMBER, b"", b"-1.5e3", None),
        (SchemaType.NUMBER, b"", b"abc", "expected a 4- or 8-byte number"),
        (SchemaType.NUMBER, b"", b"nan", "expected a 4- or 8-byte number"),
        (SchemaType.BYTES, b"", b"\x00\xff anything", None),
    ],
)
def test_payload_checks(
    schema_type: SchemaType, definition: bytes, payload: bytes, reason: str | None
) -> None:
    found = PayloadValidator().check_payload(schema(schema_type, definition), payload)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_enforce_raises_with_the_reason() -> None:
    with pytest.raises(PayloadValidationError) as caught:
        PayloadValidator().validate(
            config(), b'{"age": 3}', schema(SchemaType.JSON_SCHEMA, USER_JSON)
        )
    assert caught.value.topic == "/default/t"
    assert "'name' is a required property" in caught.value.reason
    assert "version 1" in caught.value.reason
    assert not caught.value.retriable


def test_warn_logs_and_accepts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="danube_ingest.schema.validation"):
        reason = PayloadValidator().validate(
            config(ValidationPolicy.WARN), b"{}", schema(SchemaType.JSON_SCHEMA, USER_JSON)
        )
    assert reason is not None and "'name' is a required property" in reason
    [record] = caplog.records
    assert "topic=/default/t policy=warn subject=users schema_id=1 version=1" in record.message


def test_none_accepts_without_checking() -> None:
    validator = PayloadValidator()
    assert validator.validate(config(ValidationPolicy.NONE), b"{", None) is None
    assert validator.reject(config(ValidationPolicy.NONE), "anything") is None


def test_valid_message_passes_every_policy() -> None:
    good = schema(SchemaType.JSON_SCHEMA, USER_JSON)
    for policy in ValidationPolicy:
        assert PayloadValidator().validate(config(policy), b'{"name": "a"}', good) is None


def test_schema_id_checks() -> None:
    validator = PayloadValidator()
    with pytest.raises(PayloadValidationError, match="carries no schema_id"):
        validator.validate(config(), b"x", None)
    foreign = schema(SchemaType.STRING, subject="other", schema_id=9)
    with pytest.raises(PayloadValidationError, match="schema_id 9 belongs to subject 'other'"):
        validator.validate(config(), b"x", foreign)


def test_payload_not_decoded_unless_enabled() -> None:
    checked = config(payload_validation=False)
    assert PayloadValidator().validate(checked, b"\xff", schema(SchemaType.STRING)) is None


def test_topic_without_subject() -> None:
    validator = PayloadValidator()
    # Like Danube, only enforce rejects messages of a topic that has no subject.
    assert validator.validate(config(ValidationPolicy.WARN, subject=None), b"x", None) is None
    with pytest.raises(PayloadValidationError, match="none is configured"):
        validator.validate(config(subject=None), b"x", None)


def test_compiled_checks_are_cached_per_version(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[tuple[int, int]] = []
    real_compile = validation_module._compile

    def counting_compile(version: SchemaVersion) -> validation_module.Check:
        compiled.append((version.schema_id, version.version))
        return real_compile(version)

    monkeypatch.setattr(validation_module, "_compile", counting_compile)
    validator = PayloadValidator(cache_size=2)
    v1 = schema(SchemaType.JSON_SCHEMA, USER_JSON, version=1)
    v2 = schema(SchemaType.JSON_SCHEMA, USER_JSON, version=2)
    v3 = schema(SchemaType.STRING, version=3)
    for _ in range(3):
        validator.check_payload(v1, b"{}")
    validator.check_payload(v2, b"{}")
    validator.check_payload(v1, b"{}")  # most recently used: kept
    validator.check_payload(v3, b"x")  # evicts v2
    validator.check_payload(v1, b"{}")
    validator.check_payload(v2, b"{}")
    validator.forget(1, 1)
    validator.check_payload(v1, b"{}")
    assert compiled == [(1, 1), (1, 2), (1, 3), (1, 2), (1, 1)]
