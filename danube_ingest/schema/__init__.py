"""Schema registry: subjects, versions, compatibility, topic schema configuration, validation.

:class:`SchemaRegistry` keeps its records in any :class:`SchemaStore` (``MemorySchemaStore`` in
tests); :class:`SchemaRegistryServicer` serves it as ``danube_schema.SchemaRegistry`` over
gRPC; :class:`PayloadValidator` applies a topic's validation policy to messages.
"""

from danube_ingest.schema.errors import (
    IncompatibleSchemaError,
    InvalidSchemaError,
    PayloadValidationError,
    SchemaConflictError,
    SchemaError,
    SchemaMismatchError,
    SchemaNotFoundError,
)
from danube_ingest.schema.model import (
    CompatibilityMode,
    CompatibilityResult,
    RegisterResult,
    SchemaType,
    SchemaVersion,
    SchemaVersionInfo,
    TopicSchemaConfig,
    ValidationPolicy,
)
from danube_ingest.schema.registry import SchemaRegistry
from danube_ingest.schema.service import SchemaRegistryServicer
from danube_ingest.schema.store import MemorySchemaStore, SchemaStore
from danube_ingest.schema.validation import PayloadValidator

__all__ = [
    "CompatibilityMode",
    "CompatibilityResult",
    "IncompatibleSchemaError",
    "InvalidSchemaError",
    "MemorySchemaStore",
    "PayloadValidationError",
    "PayloadValidator",
    "RegisterResult",
    "SchemaConflictError",
    "SchemaError",
    "SchemaMismatchError",
    "SchemaNotFoundError",
    "SchemaRegistry",
    "SchemaRegistryServicer",
    "SchemaStore",
    "SchemaType",
    "SchemaVersion",
    "SchemaVersionInfo",
    "TopicSchemaConfig",
    "ValidationPolicy",
]
