"""``danube_ingest.admin.v1.SubscriptionAdmin``: reset and delete subscriptions on their
owner (``danube-ingest subscriptions reset|delete``).

A subscription's cursor lives in its owner's memory (acks advance it; the owner writes it to
etcd about once a second, fenced by its epoch), so a change written to etcd from outside would
be overwritten or ignored. These calls make the owner do it (``TopicManager.reset_subscription``
and ``delete_subscription``), refused while consumers are connected.

Two unary methods; requests and answers are JSON objects (UTF-8), so no generated code:

* ``Reset``: ``{"topic", "subscription", "start"}`` (``start`` as the
  ``x-danube-ingest-start`` metadata: ``earliest``, ``latest``, ``offset:N``, ``time:MS``) →
  ``{"previous": N | null, "cursor": N}``
* ``Delete``: ``{"topic", "subscription"}`` → ``{}``

Both need the ``admin`` permission on the topic. Status codes are the broker's: NOT_FOUND for
an unknown topic or subscription, FAILED_PRECONDITION while consumers are connected,
INVALID_ARGUMENT for a malformed request or a non-reliable topic, UNAVAILABLE from a broker
that does not own the topic (look it up, as clients do, and call its owner).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from danube_ingest.broker.errors import InvalidRequestError
from danube_ingest.broker.services import HandlerRegistry, _abort
from danube_ingest.broker.start import InvalidStartPositionError, StartPosition
from danube_ingest.broker.topics import TopicManager
from danube_ingest.security.guard import Guard

SERVICE = "danube_ingest.admin.v1.SubscriptionAdmin"
RESET = f"/{SERVICE}/Reset"
DELETE = f"/{SERVICE}/Delete"


def encode(value: dict[str, Any]) -> bytes:
    """A request or answer on the wire."""
    return json.dumps(value).encode()


def _decode(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise InvalidRequestError(f"admin request is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError("admin request must be a JSON object")
    return value


def _text(request: dict[str, Any], name: str) -> str:
    value = request.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"admin request needs {name!r} (a non-empty string)")
    return value


class SubscriptionAdmin:
    """The two methods, checking callers with ``guard``."""

    def __init__(self, manager: TopicManager, guard: Guard) -> None:
        self._manager = manager
        self._guard = guard

    async def reset(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = _decode(data)
            topic = _text(request, "topic")
            self._guard.authorize(self._guard.caller(context), "admin", topic)
            try:
                start = StartPosition.parse(_text(request, "start"))
            except InvalidStartPositionError as exc:
                raise InvalidRequestError(str(exc)) from None
            previous, cursor = await self._manager.reset_subscription(
                topic, _text(request, "subscription"), start
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        return encode({"previous": previous, "cursor": cursor})

    async def delete(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = _decode(data)
            topic = _text(request, "topic")
            self._guard.authorize(self._guard.caller(context), "admin", topic)
            await self._manager.delete_subscription(topic, _text(request, "subscription"))
        except Exception as exc:
            await _abort(context, exc)
            raise
        return encode({})


def add_subscription_admin(server: HandlerRegistry, manager: TopicManager, guard: Guard) -> None:
    """Register ``SubscriptionAdmin`` on ``server``."""
    admin = SubscriptionAdmin(manager, guard)
    methods: dict[str, Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]] = {
        "Reset": admin.reset,
        "Delete": admin.delete,
    }
    handlers = {name: grpc.unary_unary_rpc_method_handler(call) for name, call in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
