"""Exceptions raised by the schema registry and payload validation.

::

    DanubeIngestError
     └── SchemaError                  root of this package's errors
          ├── SchemaNotFoundError      no such subject, schema id, version or topic config
          ├── InvalidSchemaError       a malformed definition, schema type, mode, policy or name
          ├── IncompatibleSchemaError  a new version breaks the subject's compatibility mode
          ├── SchemaMismatchError      a topic is bound to another subject
          ├── SchemaConflictError      concurrent writers kept winning; retriable
          └── PayloadValidationError   a message breaks its topic's schema (policy enforce)
"""

from __future__ import annotations

from collections.abc import Sequence

from danube_ingest.errors import DanubeIngestError


class SchemaError(DanubeIngestError):
    """Root of the schema registry's errors."""


class SchemaNotFoundError(SchemaError):
    """The subject, schema id, version or topic schema configuration does not exist."""


class InvalidSchemaError(SchemaError, ValueError):
    """Input that can never be accepted: an unparsable definition, an unknown schema type,
    compatibility mode or validation policy, or an empty subject or topic name."""


class IncompatibleSchemaError(SchemaError):
    """A new definition violates the subject's compatibility mode; nothing was registered.

    ``errors`` lists every rule that failed, each naming the field or type at fault.
    """

    def __init__(self, subject: str, mode: str, errors: Sequence[str]) -> None:
        super().__init__(
            f"schema is not {mode} compatible with subject {subject!r}: {'; '.join(errors)}; "
            f"fix the definition or change the subject's compatibility mode"
        )
        self.subject = subject
        self.mode = mode
        self.errors = list(errors)


class SchemaMismatchError(SchemaError):
    """A topic is already bound to a different schema subject."""

    def __init__(self, topic: str, bound_subject: str, requested_subject: str) -> None:
        super().__init__(
            f"topic {topic} uses schema subject {bound_subject!r}, not {requested_subject!r}; "
            f"an administrator can rebind it with ConfigureTopicSchema"
        )
        self.topic = topic
        self.bound_subject = bound_subject
        self.requested_subject = requested_subject


class SchemaConflictError(SchemaError):
    """Concurrent updates of the same record kept winning the compare-and-set; try again."""

    retriable = True


class PayloadValidationError(SchemaError):
    """A message was rejected because its topic's validation policy is ``enforce``.

    ``reason`` says what was wrong (missing schema id, foreign subject, undecodable payload...).
    """

    def __init__(self, topic: str, reason: str) -> None:
        super().__init__(f"message rejected by the schema of topic {topic}: {reason}")
        self.topic = topic
        self.reason = reason
