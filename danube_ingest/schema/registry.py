"""The schema registry: subjects, versions, compatibility modes and topic schema configuration.

Semantics follow the Danube broker: a subject gets a schema id when its first version is
registered (ids are unique across subjects and shared by all of a subject's versions);
versions count 1, 2, ...; registering a definition whose fingerprint matches a live version of
the same type returns that version instead of adding one; a new version must satisfy the
subject's compatibility mode (default BACKWARD) against the latest live version, or every live
version for a ``_TRANSITIVE`` mode. A deleted version disappears from every lookup and its
number is never reused.

Records in the store (subjects and topics are percent-encoded, so keys never nest)::

    next_id                            last schema id handed out (decimal)
    ids/{schema_id:020}                the subject owning that id (UTF-8)
    subjects/{subject}                 JSON: id, compatibility, next_version, versions[]
    definitions/{subject}/{sha256}     a definition's bytes as first registered
    topics/{topic}                     JSON: subject, schema_id, validation_policy,
                                       enable_payload_validation

Every change to a subject or topic is one compare-and-set of its record, retried on conflict,
so concurrent registrations on several brokers never lose a version or share a number.
Definitions are written before the record that names them and are never deleted (they are
content-addressed and small); an id whose subject record lost the race stays unused.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, unquote

from danube_ingest.schema.compatibility import compatibility_errors
from danube_ingest.schema.errors import (
    IncompatibleSchemaError,
    InvalidSchemaError,
    SchemaConflictError,
    SchemaMismatchError,
    SchemaNotFoundError,
)
from danube_ingest.schema.formats import ParsedSchema, parse_definition
from danube_ingest.schema.model import (
    DEFAULT_COMPATIBILITY_MODE,
    CompatibilityMode,
    CompatibilityResult,
    RegisterResult,
    SchemaType,
    SchemaVersion,
    SchemaVersionInfo,
    TopicSchemaConfig,
    ValidationPolicy,
)
from danube_ingest.schema.store import SchemaStore
from danube_ingest.schema.validation import PayloadValidator

# Compare-and-set retries before giving up with SchemaConflictError. Each retry re-reads one
# record, and only a writer on the same subject or topic can make it fail.
MAX_ATTEMPTS = 32

# Danube's default for a topic whose subject was assigned by its first producer.
FIRST_PRODUCER_POLICY = ValidationPolicy.WARN

# Versions resolved for messages; versions are immutable so these never go stale.
MESSAGE_SCHEMA_CACHE_SIZE = 1024


class SchemaRegistry:
    """Registers and serves schemas; stores everything through a :class:`SchemaStore`."""

    def __init__(
        self,
        store: SchemaStore,
        *,
        clock: Callable[[], float] = time.time,
        validator: PayloadValidator | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self.validator = validator or PayloadValidator()
        self._message_schemas: OrderedDict[tuple[int, int], SchemaVersion] = OrderedDict()

    # Subjects and versions

    async def register(
        self,
        subject: str,
        schema_type: SchemaType | str,
        definition: bytes,
        *,
        description: str = "",
        created_by: str = "",
        tags: Sequence[str] = (),
    ) -> RegisterResult:
        """Add ``definition`` as the next version of ``subject`` (creating the subject).

        Idempotent: a definition equal (by type and fingerprint) to a live version returns that
        version with ``is_new_version`` False. Raises :class:`InvalidSchemaError` for a bad type
        or definition, :class:`IncompatibleSchemaError` when the subject's mode forbids it.
        """
        _require_name("subject", subject)
        parsed = parse_definition(_schema_type(schema_type), definition)
        for _ in range(MAX_ATTEMPTS):
            raw = await self._store.get(_subject_key(subject))
            entry = {
                "type": parsed.schema_type.value,
                "fingerprint": parsed.fingerprint,
                "created_at": int(self._clock()),
                "created_by": created_by,
                "description": description,
                "tags": list(tags),
            }
            if raw is None:
                result = await self._create_subject(subject, parsed, definition, entry)
            else:
                result = await self._add_version(subject, raw, parsed, definition, entry)
            if result is not None:
                return result
        raise _conflict(f"subject {subject!r}")

    async def get(self, schema_id: int, version: int | None = None) -> SchemaVersion:
        """Version ``version`` (None or 0: the latest) of the subject with ``schema_id``."""
        subject = await self._subject_of(schema_id)
        if subject is None:
            raise SchemaNotFoundError(f"no schema with id {schema_id}")
        return await self._version(subject, version or None)

    async def get_latest(self, subject: str) -> SchemaVersion:
        """The newest live version of ``subject``."""
        return await self._version(subject, None)

    async def get_version(self, subject: str, version: int) -> SchemaVersion:
        """Version ``version`` of ``subject``."""
        return await self._version(subject, version)

    async def list_subjects(self) -> list[str]:
        """Every subject that was ever registered, in name order (a subject whose versions were
        all deleted is listed, with no versions)."""
        found = await self._store.list_prefix("subjects/")
        return sorted(unquote(key.removeprefix("subjects/")) for key, _ in found)

    async def list_versions(self, subject: str) -> list[SchemaVersionInfo]:
        """The live versions of ``subject``, oldest first."""
        head = await self._head(subject)
        return [_info(subject, head, v) for v in head["versions"]]

    async def check_compatibility(
        self,
        subject: str,
        schema_type: SchemaType | str,
        definition: bytes,
        mode: CompatibilityMode | str | None = None,
    ) -> CompatibilityResult:
        """Whether ``definition`` could be registered under ``mode`` (default: the subject's).

        Raises :class:`SchemaNotFoundError` for an unknown subject and
        :class:`InvalidSchemaError` for a definition that does not parse.
        """
        parsed = parse_definition(_schema_type(schema_type), definition)
        head = await self._head(subject)
        if mode is None or mode == "":
            chosen = CompatibilityMode(head["compatibility"])
        elif isinstance(mode, str):
            chosen = CompatibilityMode.parse(mode)
        else:
            chosen = mode
        errors = await self._compatibility_errors(subject, head, parsed, chosen)
        return CompatibilityResult(not errors, errors)

    async def delete_version(self, subject: str, version: int) -> None:
        """Remove ``version`` from ``subject``; its number is never reused."""
        key = _subject_key(subject)
        for _ in range(MAX_ATTEMPTS):
            raw = await self._store.get(key)
            if raw is None:
                raise SchemaNotFoundError(f"no schema subject {subject!r}")
            head = json.loads(raw)
            kept = [v for v in head["versions"] if v["version"] != version]
            if len(kept) == len(head["versions"]):
                raise SchemaNotFoundError(f"subject {subject!r} has no version {version}")
            head["versions"] = kept
            if await self._store.compare_and_set(key, raw, _encode(head)):
                self._message_schemas.pop((head["id"], version), None)
                self.validator.forget(head["id"], version)
                return
        raise _conflict(f"subject {subject!r}")

    async def set_compatibility_mode(self, subject: str, mode: CompatibilityMode | str) -> None:
        """Set the mode later registrations of ``subject`` must satisfy."""
        chosen = CompatibilityMode.parse(mode) if isinstance(mode, str) else mode
        key = _subject_key(subject)
        for _ in range(MAX_ATTEMPTS):
            raw = await self._store.get(key)
            if raw is None:
                raise SchemaNotFoundError(f"no schema subject {subject!r}")
            head = json.loads(raw)
            head["compatibility"] = chosen.value
            if await self._store.compare_and_set(key, raw, _encode(head)):
                return
        raise _conflict(f"subject {subject!r}")

    # Topics

    async def configure_topic_schema(
        self,
        topic: str,
        subject: str,
        validation_policy: ValidationPolicy | str = ValidationPolicy.NONE,
        enable_payload_validation: bool = False,
    ) -> TopicSchemaConfig:
        """Bind ``topic`` to ``subject`` with a policy, replacing any previous configuration
        (the administrator's override). The subject must exist."""
        _require_name("topic", topic)
        policy = _policy(validation_policy)
        head = await self._head(subject)
        config = TopicSchemaConfig(topic, subject, policy, enable_payload_validation, head["id"])
        await self._store.put(_topic_key(topic), _encode_topic(config))
        return config

    async def update_topic_validation_policy(
        self,
        topic: str,
        validation_policy: ValidationPolicy | str,
        enable_payload_validation: bool = False,
    ) -> TopicSchemaConfig:
        """Change ``topic``'s policy, keeping its subject (a topic without configuration gets
        one without a subject)."""
        _require_name("topic", topic)
        policy = _policy(validation_policy)

        def update(current: TopicSchemaConfig | None) -> TopicSchemaConfig:
            subject, schema_id = (current.subject, current.schema_id) if current else (None, 0)
            return TopicSchemaConfig(topic, subject, policy, enable_payload_validation, schema_id)

        return await self._update_topic(topic, update)

    async def assign_topic_subject(self, topic: str, subject: str) -> TopicSchemaConfig:
        """Bind ``topic`` to ``subject`` unless it already has a subject (Danube's "first
        producer" rule; the policy defaults to ``warn``). Raises :class:`SchemaMismatchError`
        when the topic uses another subject, :class:`SchemaNotFoundError` for an unknown one."""
        _require_name("topic", topic)
        head = await self._head(subject)

        def update(current: TopicSchemaConfig | None) -> TopicSchemaConfig:
            if current is None:
                return TopicSchemaConfig(topic, subject, FIRST_PRODUCER_POLICY, False, head["id"])
            if current.subject is None:
                return TopicSchemaConfig(
                    topic,
                    subject,
                    current.validation_policy,
                    current.enable_payload_validation,
                    head["id"],
                )
            if current.subject != subject:
                raise SchemaMismatchError(topic, current.subject, subject)
            return current

        return await self._update_topic(topic, update)

    async def get_topic_schema_config(self, topic: str) -> TopicSchemaConfig:
        """``topic``'s configuration; :class:`SchemaNotFoundError` if it has none."""
        raw = await self._store.get(_topic_key(topic))
        if raw is None:
            raise SchemaNotFoundError(f"topic {topic} has no schema configuration")
        return _decode_topic(topic, raw)

    # Messages

    async def validate_message(
        self,
        config: TopicSchemaConfig,
        payload: bytes,
        schema_id: int | None,
        schema_version: int | None,
    ) -> str | None:
        """Check a message against its topic's configuration (which the caller keeps).

        Returns None if accepted, the reason if it failed under ``warn``; raises
        :class:`PayloadValidationError` if it failed under ``enforce``. Versions named by
        messages are cached, so steady traffic does not read the store.
        """
        if config.validation_policy is ValidationPolicy.NONE:
            return None
        if schema_id is None:
            return self.validator.validate(config, payload, None)
        try:
            schema = await self._message_schema(schema_id, schema_version)
        except SchemaNotFoundError as exc:
            return self.validator.reject(config, str(exc))
        return self.validator.validate(config, payload, schema)

    # Internals

    async def _create_subject(
        self, subject: str, parsed: ParsedSchema, definition: bytes, entry: dict[str, Any]
    ) -> RegisterResult | None:
        """Create ``subject`` with ``entry`` as version 1; None if another writer created it
        first (its id is then left unused)."""
        schema_id = await self._allocate_id()
        await self._store.put(_id_key(schema_id), subject.encode())
        await self._store.create_if_absent(_definition_key(subject, parsed.fingerprint), definition)
        head = {
            "id": schema_id,
            "compatibility": DEFAULT_COMPATIBILITY_MODE.value,
            "created_at": entry["created_at"],
            "created_by": entry["created_by"],
            "next_version": 2,
            "versions": [{"version": 1, **entry}],
        }
        if await self._store.create_if_absent(_subject_key(subject), _encode(head)):
            return RegisterResult(schema_id, 1, True, parsed.fingerprint)
        return None

    async def _add_version(
        self,
        subject: str,
        raw: bytes,
        parsed: ParsedSchema,
        definition: bytes,
        entry: dict[str, Any],
    ) -> RegisterResult | None:
        """Append ``entry`` to the subject record ``raw`` (or find it there); None if the
        record changed meanwhile."""
        head = json.loads(raw)
        for existing in head["versions"]:
            if (existing["type"], existing["fingerprint"]) == (entry["type"], entry["fingerprint"]):
                return RegisterResult(head["id"], existing["version"], False, parsed.fingerprint)
        mode = CompatibilityMode(head["compatibility"])
        errors = await self._compatibility_errors(subject, head, parsed, mode)
        if errors:
            raise IncompatibleSchemaError(subject, mode.value, errors)
        await self._store.create_if_absent(_definition_key(subject, parsed.fingerprint), definition)
        version = head["next_version"]
        head["next_version"] = version + 1
        head["versions"].append({"version": version, **entry})
        if await self._store.compare_and_set(_subject_key(subject), raw, _encode(head)):
            return RegisterResult(head["id"], version, True, parsed.fingerprint)
        return None

    async def _message_schema(self, schema_id: int, version: int | None) -> SchemaVersion:
        if not version:
            return await self.get(schema_id)
        key = (schema_id, version)
        cached = self._message_schemas.get(key)
        if cached is not None:
            self._message_schemas.move_to_end(key)
            return cached
        schema = await self.get(schema_id, version)
        self._message_schemas[key] = schema
        if len(self._message_schemas) > MESSAGE_SCHEMA_CACHE_SIZE:
            self._message_schemas.popitem(last=False)
        return schema

    async def _compatibility_errors(
        self, subject: str, head: dict[str, Any], new: ParsedSchema, mode: CompatibilityMode
    ) -> list[str]:
        if mode is CompatibilityMode.NONE or not head["versions"]:
            return []
        entries = head["versions"] if mode.transitive else head["versions"][-1:]
        existing = []
        for entry in reversed(entries):
            definition = await self._definition(subject, entry)
            existing.append(
                (entry["version"], parse_definition(SchemaType(entry["type"]), definition))
            )
        return compatibility_errors(new, existing, mode)

    async def _version(self, subject: str, version: int | None) -> SchemaVersion:
        head = await self._head(subject)
        if not head["versions"]:
            raise SchemaNotFoundError(f"subject {subject!r} has no live versions")
        if version is None:
            entry = head["versions"][-1]
        else:
            entry = next((v for v in head["versions"] if v["version"] == version), None)
            if entry is None:
                raise SchemaNotFoundError(f"subject {subject!r} has no version {version}")
        info = _info(subject, head, entry)
        return SchemaVersion(
            **vars(info),
            definition=await self._definition(subject, entry),
            compatibility_mode=CompatibilityMode(head["compatibility"]),
        )

    async def _head(self, subject: str) -> dict[str, Any]:
        raw = await self._store.get(_subject_key(subject))
        if raw is None:
            raise SchemaNotFoundError(f"no schema subject {subject!r}; register a schema first")
        head: dict[str, Any] = json.loads(raw)
        return head

    async def _definition(self, subject: str, entry: dict[str, Any]) -> bytes:
        key = _definition_key(subject, entry["fingerprint"])
        data = await self._store.get(key)
        if data is None:
            raise SchemaNotFoundError(
                f"definition of subject {subject!r} version {entry['version']} is missing "
                f"from the store (key {key})"
            )
        return data

    async def _subject_of(self, schema_id: int) -> str | None:
        raw = await self._store.get(_id_key(schema_id))
        if raw is None:
            return None
        subject = raw.decode()
        head_raw = await self._store.get(_subject_key(subject))
        # An id whose subject record lost a creation race belongs to no subject.
        if head_raw is None or json.loads(head_raw)["id"] != schema_id:
            return None
        return subject

    async def _allocate_id(self) -> int:
        for _ in range(MAX_ATTEMPTS):
            raw = await self._store.get("next_id")
            schema_id = int(raw or b"0") + 1
            if await self._store.compare_and_set("next_id", raw, str(schema_id).encode()):
                return schema_id
        raise _conflict("the schema id counter")

    async def _update_topic(
        self, topic: str, update: Callable[[TopicSchemaConfig | None], TopicSchemaConfig]
    ) -> TopicSchemaConfig:
        key = _topic_key(topic)
        for _ in range(MAX_ATTEMPTS):
            raw = await self._store.get(key)
            current = None if raw is None else _decode_topic(topic, raw)
            config = update(current)
            if config == current:
                return config
            if await self._store.compare_and_set(key, raw, _encode_topic(config)):
                return config
        raise _conflict(f"topic {topic}")


def _schema_type(value: SchemaType | str) -> SchemaType:
    return SchemaType.parse(value) if isinstance(value, str) else value


def _policy(value: ValidationPolicy | str) -> ValidationPolicy:
    return ValidationPolicy.parse(value) if isinstance(value, str) else value


def _require_name(what: str, value: str) -> None:
    if not value:
        raise InvalidSchemaError(f"{what} name must not be empty")


def _info(subject: str, head: dict[str, Any], entry: dict[str, Any]) -> SchemaVersionInfo:
    return SchemaVersionInfo(
        schema_id=head["id"],
        subject=subject,
        version=entry["version"],
        schema_type=SchemaType(entry["type"]),
        fingerprint=entry["fingerprint"],
        description=entry["description"],
        created_at=entry["created_at"],
        created_by=entry["created_by"],
        tags=tuple(entry["tags"]),
    )


def _quote(name: str) -> str:
    return quote(name, safe="")


def _subject_key(subject: str) -> str:
    return f"subjects/{_quote(subject)}"


def _definition_key(subject: str, fingerprint: str) -> str:
    return f"definitions/{_quote(subject)}/{fingerprint.removeprefix('sha256:')}"


def _id_key(schema_id: int) -> str:
    return f"ids/{schema_id:020d}"


def topic_config_key(topic: str) -> str:
    """The key of a topic's schema configuration, below the registry's root."""
    return _topic_key(topic)


def _topic_key(topic: str) -> str:
    return f"topics/{_quote(topic)}"


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def _encode_topic(config: TopicSchemaConfig) -> bytes:
    return _encode(
        {
            "subject": config.subject,
            "schema_id": config.schema_id,
            "validation_policy": config.validation_policy.value,
            "enable_payload_validation": config.enable_payload_validation,
        }
    )


def _decode_topic(topic: str, raw: bytes) -> TopicSchemaConfig:
    record = json.loads(raw)
    return TopicSchemaConfig(
        topic=topic,
        subject=record["subject"],
        validation_policy=ValidationPolicy(record["validation_policy"]),
        enable_payload_validation=record["enable_payload_validation"],
        schema_id=record["schema_id"],
    )


def _conflict(what: str) -> SchemaConflictError:
    return SchemaConflictError(
        f"gave up updating {what} after {MAX_ATTEMPTS} concurrent modifications; retry"
    )
