"""``danube_schema.SchemaRegistry`` over gRPC (``grpc.aio``), on top of :class:`SchemaRegistry`.

Status codes: unknown subject, schema id, version or topic configuration → NOT_FOUND; malformed
definition, schema type, mode, policy or empty name → INVALID_ARGUMENT; a definition the
subject's compatibility mode rejects → FAILED_PRECONDITION; a record that kept changing under
concurrent writers → ABORTED. Registering a definition that already exists is not an error
(Danube answers with the existing version and ``is_new_version`` false).

``GetSchema``/``GetLatestSchema`` return the definition bytes exactly as registered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc
from danube.proto import SchemaRegistry_pb2 as pb
from danube.proto import SchemaRegistry_pb2_grpc as pb_grpc

from danube_ingest.errors import DanubeIngestError
from danube_ingest.schema.errors import (
    IncompatibleSchemaError,
    InvalidSchemaError,
    PayloadValidationError,
    SchemaConflictError,
    SchemaMismatchError,
    SchemaNotFoundError,
)
from danube_ingest.schema.model import SchemaVersion
from danube_ingest.schema.registry import SchemaRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")

_STATUS: list[tuple[type[DanubeIngestError], Any]] = [
    (SchemaNotFoundError, grpc.StatusCode.NOT_FOUND),
    (InvalidSchemaError, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleSchemaError, grpc.StatusCode.FAILED_PRECONDITION),
    (SchemaMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (SchemaConflictError, grpc.StatusCode.ABORTED),
]


def status_for(error: DanubeIngestError) -> Any:
    """The gRPC status code reporting ``error``."""
    for cls, code in _STATUS:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.UNAVAILABLE if error.retriable else grpc.StatusCode.INTERNAL


#: Longest error text sent (characters), as the broker's services: it travels in the
#: ``grpc-message`` header, percent-encoded (up to 12 bytes per character), and a reply whose
#: headers pass gRPC's 8 KiB limit reaches the client as RESOURCE_EXHAUSTED, not as its status.
MAX_DETAILS = 600


def _details(exc: BaseException) -> str:
    """The text of ``exc``, cut to at most ``MAX_DETAILS`` characters (saying how long it was)."""
    details = str(exc)
    if len(details) > MAX_DETAILS:
        tail = f"... ({len(details)} characters)"
        details = details[: MAX_DETAILS - len(tail)] + tail
    return details


async def _guard(context: Any, call: Awaitable[T]) -> T:
    try:
        return await call
    except DanubeIngestError as exc:
        await context.abort(status_for(exc), _details(exc))
        raise  # context.abort always raises; this only tells the type checker


class SchemaRegistryServicer(pb_grpc.SchemaRegistryServicer):  # type: ignore[misc]
    """Every RPC of ``danube_schema.SchemaRegistry``; register with
    ``SchemaRegistry_pb2_grpc.add_SchemaRegistryServicer_to_server(servicer, server)``."""

    def __init__(self, registry: SchemaRegistry) -> None:
        self._registry = registry

    async def RegisterSchema(self, request: Any, context: Any) -> Any:
        result = await _guard(
            context,
            self._registry.register(
                request.subject,
                request.schema_type,
                request.schema_definition,
                description=request.description,
                created_by=request.created_by,
                tags=list(request.tags),
            ),
        )
        if result.is_new_version:
            log.info(
                "schema registered subject=%s schema_id=%d version=%d fingerprint=%s",
                request.subject,
                result.schema_id,
                result.version,
                result.fingerprint,
            )
        return pb.RegisterSchemaResponse(
            schema_id=result.schema_id,
            version=result.version,
            is_new_version=result.is_new_version,
            fingerprint=result.fingerprint,
        )

    async def GetSchema(self, request: Any, context: Any) -> Any:
        version = request.version if request.HasField("version") else None
        schema = await _guard(context, self._registry.get(request.schema_id, version))
        return _schema_response(schema)

    async def GetLatestSchema(self, request: Any, context: Any) -> Any:
        schema = await _guard(context, self._registry.get_latest(request.subject))
        return _schema_response(schema)

    async def ListVersions(self, request: Any, context: Any) -> Any:
        versions = await _guard(context, self._registry.list_versions(request.subject))
        return pb.ListVersionsResponse(
            versions=[
                pb.SchemaVersionInfo(
                    version=v.version,
                    created_at=v.created_at,
                    created_by=v.created_by,
                    description=v.description,
                    fingerprint=v.fingerprint,
                    schema_id=v.schema_id,
                )
                for v in versions
            ]
        )

    async def CheckCompatibility(self, request: Any, context: Any) -> Any:
        mode = request.compatibility_mode if request.HasField("compatibility_mode") else None
        result = await _guard(
            context,
            self._registry.check_compatibility(
                request.subject, request.schema_type, request.new_schema_definition, mode
            ),
        )
        return pb.CheckCompatibilityResponse(
            is_compatible=result.is_compatible, errors=result.errors
        )

    async def DeleteSchemaVersion(self, request: Any, context: Any) -> Any:
        await _guard(context, self._registry.delete_version(request.subject, request.version))
        log.info("schema version deleted subject=%s version=%d", request.subject, request.version)
        return pb.DeleteSchemaVersionResponse(
            success=True,
            message=f"deleted version {request.version} of subject {request.subject}",
        )

    async def SetCompatibilityMode(self, request: Any, context: Any) -> Any:
        await _guard(
            context,
            self._registry.set_compatibility_mode(request.subject, request.compatibility_mode),
        )
        log.info(
            "schema compatibility mode set subject=%s mode=%s",
            request.subject,
            request.compatibility_mode,
        )
        return pb.SetCompatibilityModeResponse(
            success=True,
            message=(
                f"compatibility mode of subject {request.subject} set to "
                f"{request.compatibility_mode.lower()}"
            ),
        )

    async def ConfigureTopicSchema(self, request: Any, context: Any) -> Any:
        config = await _guard(
            context,
            self._registry.configure_topic_schema(
                request.topic_name,
                request.schema_subject,
                request.validation_policy or "none",
                request.enable_payload_validation,
            ),
        )
        log.info(
            "topic schema configured topic=%s subject=%s policy=%s payload_validation=%s",
            config.topic,
            config.subject,
            config.validation_policy.value,
            config.enable_payload_validation,
        )
        return pb.ConfigureTopicSchemaResponse(
            success=True,
            message=(
                f"topic {config.topic} uses subject {config.subject} with validation policy "
                f"{config.validation_policy.value}"
            ),
        )

    async def UpdateTopicValidationPolicy(self, request: Any, context: Any) -> Any:
        config = await _guard(
            context,
            self._registry.update_topic_validation_policy(
                request.topic_name, request.validation_policy, request.enable_payload_validation
            ),
        )
        log.info(
            "topic validation policy updated topic=%s policy=%s payload_validation=%s",
            config.topic,
            config.validation_policy.value,
            config.enable_payload_validation,
        )
        return pb.UpdateTopicValidationPolicyResponse(
            success=True,
            message=(
                f"topic {config.topic} validation policy set to {config.validation_policy.value}"
            ),
        )

    async def GetTopicSchemaConfig(self, request: Any, context: Any) -> Any:
        config = await _guard(context, self._registry.get_topic_schema_config(request.topic_name))
        return pb.GetTopicSchemaConfigResponse(
            schema_subject=config.subject or "",
            validation_policy=config.validation_policy.value,
            enable_payload_validation=config.enable_payload_validation,
            schema_id=config.schema_id,
        )


def _schema_response(schema: SchemaVersion) -> Any:
    return pb.GetSchemaResponse(
        schema_id=schema.schema_id,
        version=schema.version,
        subject=schema.subject,
        schema_type=schema.schema_type.value,
        schema_definition=schema.definition,
        description=schema.description,
        created_at=schema.created_at,
        created_by=schema.created_by,
        tags=list(schema.tags),
        fingerprint=schema.fingerprint,
        compatibility_mode=schema.compatibility_mode.value,
    )
