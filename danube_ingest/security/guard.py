"""What the broker's gRPC services use: the caller of a call, and the checks on it.

``AuthInterceptor`` authenticates every RPC on the port before its handler runs (so an RPC
added later is never open by accident) and applies the schema registry's admin rules; the
services then ask the :class:`Guard` for the :class:`Caller` (cached: no second verification)
and check the permission for the topic each request names, before anything is stored, an
offset assigned or a delivery acknowledged.

Streams (ReceiveMessages, the batch Publish and Consume) are authenticated when they open and
end with UNAUTHENTICATED (:class:`TokenExpiredError`) when the JWT they were opened with
expires (:meth:`Caller.deadline`): like Kafka's re-authentication (KIP-368), a connection
never outlives its credentials; the client opens the stream again with a fresh token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc

from danube_ingest.config.auth import Action, AuthConfig
from danube_ingest.security.authn import ANONYMOUS, Authenticator, Principal
from danube_ingest.security.authz import Authorizer
from danube_ingest.security.errors import (
    TOKEN_EXPIRED,
    PermissionDeniedError,
    SecurityError,
    TokenExpiredError,
    UnauthenticatedError,
)


@dataclass(frozen=True)
class Caller:
    """Who made a call, and over which connection."""

    principal: Principal
    peer: str
    """gRPC's name of the client's connection (``ipv4:127.0.0.1:53312``): danube-client sends
    every call to one broker over one channel, so a consumer's acks come from the peer its
    ``ReceiveMessages`` stream came from."""
    authenticated: bool
    """False when ``auth.enabled`` is off (everyone is anonymous and may do everything)."""
    expires_at: float | None = None
    """When the credentials of the call stop being accepted (seconds since the epoch: a JWT's
    ``exp`` plus ``auth.jwt.clock_skew_seconds``); ``None``: never (API keys, auth off)."""

    def deadline(self, loop: asyncio.AbstractEventLoop) -> float | None:
        """When (``loop.time()``) a stream opened by this call must end for its credentials'
        expiry; ``None``: never."""
        if self.expires_at is None:
            return None
        return loop.time() + (self.expires_at - time.time())

    def expired(self) -> TokenExpiredError:
        """The error a stream of this call ends with at its :meth:`deadline`."""
        expires = self.expires_at if self.expires_at is not None else time.time()
        return TokenExpiredError(
            f"{TOKEN_EXPIRED} at {datetime.fromtimestamp(expires, UTC).isoformat()} "
            f"(auth.jwt.clock_skew_seconds included) while the stream was open: open it again "
            f"with a new token (principal {self.principal.name!r})"
        )

    @property
    def owner(self) -> str | None:
        """What producer and consumer registrations record as their creator, and what
        ``binding.check_owner`` compares: the principal's name, or ``None`` with auth off
        (then no principal is checked)."""
        return self.principal.name if self.authenticated else None


class Guard:
    """Authentication and authorization for the broker's services."""

    def __init__(self, config: AuthConfig) -> None:
        self.enabled = config.enabled
        self.authenticator = Authenticator(config)
        self.authorizer = Authorizer(config.permissions)

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The caller of the call ``context`` belongs to; :class:`UnauthenticatedError` if it
        did not prove who it is."""
        if not self.enabled:
            return Caller(ANONYMOUS, context.peer(), False)
        principal, expires_at = self.authenticator.identify(context.invocation_metadata() or ())
        return Caller(principal, context.peer(), True, expires_at)

    def authorize(self, caller: Caller, action: Action, topic: str | None) -> None:
        """Raise :class:`PermissionDeniedError` unless ``caller`` may do ``action`` on
        ``topic`` (``None``: cluster-wide). Auth off: everything is allowed."""
        if caller.authenticated:
            self.authorizer.check(caller.principal, action, topic)

    def authorize_any(self, caller: Caller, topic: str) -> None:
        """Raise :class:`PermissionDeniedError` unless ``caller`` may do something with
        ``topic`` (look it up: produce, consume or administer it)."""
        if not caller.authenticated:
            return
        if not any(
            self.authorizer.allowed(caller.principal, action, topic)
            for action in ("produce", "consume", "admin")
        ):
            raise PermissionDeniedError(
                f"principal {caller.principal.name!r} may not look up {topic}: no "
                f"auth.permissions rule grants produce, consume or admin on it"
            )


_SCHEMA = "/danube_schema.SchemaRegistry/"
#: Schema registry RPCs that change what other clients see: method -> the topic they
#: administer (``None``: the subject, a cluster-wide resource). Reads, RegisterSchema and
#: CheckCompatibility need an authenticated caller only (compatibility rules guard a subject's
#: evolution).
_SCHEMA_ADMIN: dict[str, Callable[[Any], str | None]] = {
    _SCHEMA + "DeleteSchemaVersion": lambda request: None,
    _SCHEMA + "SetCompatibilityMode": lambda request: None,
    _SCHEMA + "ConfigureTopicSchema": lambda request: str(request.topic_name),
    _SCHEMA + "UpdateTopicValidationPolicy": lambda request: str(request.topic_name),
}

_CODES = {
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
}


def _code(exc: SecurityError) -> grpc.StatusCode:
    """The status ``exc`` (or the base class it is a kind of) is answered with."""
    return next(code for kind, code in _CODES.items() if isinstance(exc, kind))


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every RPC without valid credentials (UNAUTHENTICATED) before its handler runs,
    and schema registry admin RPCs without the admin permission (PERMISSION_DENIED)."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        handler_call_details: Any,
    ) -> Any:
        handler = await continuation(handler_call_details)
        guard = self._guard
        if handler is None or not guard.enabled:
            return handler
        try:
            principal = guard.authenticator.authenticate(
                handler_call_details.invocation_metadata or ()
            )
        except UnauthenticatedError as exc:
            return _refusing(handler, exc)
        resource = _SCHEMA_ADMIN.get(handler_call_details.method)
        if resource is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                guard.authorizer.check(principal, "admin", resource(request))
            except SecurityError as exc:
                await context.abort(_code(exc), str(exc))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _refusing(handler: Any, exc: SecurityError) -> Any:
    """A handler of ``handler``'s kind that answers every call with ``exc``'s status."""
    code = _code(exc)
    details = str(exc)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **options)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **options)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **options)
    return grpc.unary_unary_rpc_method_handler(refuse, **options)
