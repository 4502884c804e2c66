"""gRPC servicers for Danube's client protocol, on top of the TopicManager.

They only translate: requests into TopicManager calls, our errors into the status codes
danube-client expects (see ``status_for``), results into responses. Every error answer names
the topic, id or limit involved.

Security (``danube_ingest.security``): every call is authenticated (``AuthInterceptor``, then
``Guard.caller`` here) and authorized for the topic it names before the TopicManager is
called, so nothing is stored, no offset assigned and nothing acknowledged for a refused
caller. Producer and consumer ids are checked against the principal that created them. A
ReceiveMessages stream ends with UNAUTHENTICATED when the JWT it was opened with expires
(``Caller.deadline``); danube-client then subscribes again with its (fresh) token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.convert import message_from_entry
from danube_ingest.broker.errors import (
    InvalidRequestError,
    LimitExceededError,
    NotOwnerError,
    StrategyMismatchError,
    SubscriptionInUseError,
    SubscriptionNotFoundError,
    TakeoverPendingError,
    TopicNotFoundError,
    UnknownClientError,
)
from danube_ingest.broker.forward import Forwarder
from danube_ingest.broker.names import InvalidTopicNameError, parse_topic
from danube_ingest.broker.start import from_metadata
from danube_ingest.broker.topics import TopicManager
from danube_ingest.broker.validation import check_subscription_name, subscription_type
from danube_ingest.dispatch import Delivery, SubscriptionBusyError
from danube_ingest.errors import (
    DanubeIngestError,
    DuplicateSequenceError,
    InvalidEntryError,
    PayloadTooLargeError,
    SequenceGapError,
    WalBackpressureError,
    WalClosedError,
    WalFailedError,
)
from danube_ingest.metadata.errors import (
    CommitStateUnknownError,
    FencedError,
    InvalidNameError,
    LeaseExpiredError,
    MetadataUnavailableError,
    TopicDeletedError,
)
from danube_ingest.schema.errors import (
    IncompatibleSchemaError,
    InvalidSchemaError,
    PayloadValidationError,
    SchemaMismatchError,
    SchemaNotFoundError,
)
from danube_ingest.security import Guard, PermissionDeniedError, UnauthenticatedError

log = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidTopicNameError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadTooLargeError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidEntryError, grpc.StatusCode.INVALID_ARGUMENT),
    (PayloadValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidSchemaError, grpc.StatusCode.INVALID_ARGUMENT),
    # A subscription name that cannot be a metadata key segment ('/', spaces...).
    (InvalidNameError, grpc.StatusCode.INVALID_ARGUMENT),
    (TopicNotFoundError, grpc.StatusCode.NOT_FOUND),
    (TopicDeletedError, grpc.StatusCode.NOT_FOUND),
    (UnknownClientError, grpc.StatusCode.NOT_FOUND),
    (SchemaNotFoundError, grpc.StatusCode.NOT_FOUND),
    (StrategyMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (SubscriptionInUseError, grpc.StatusCode.FAILED_PRECONDITION),
    (SubscriptionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SchemaMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (IncompatibleSchemaError, grpc.StatusCode.FAILED_PRECONDITION),
    (SubscriptionBusyError, grpc.StatusCode.PERMISSION_DENIED),
    (NotOwnerError, grpc.StatusCode.UNAVAILABLE),
    (TakeoverPendingError, grpc.StatusCode.UNAVAILABLE),
    (FencedError, grpc.StatusCode.UNAVAILABLE),
    # The broker's session is being re-registered: retriable, unlike INTERNAL.
    (LeaseExpiredError, grpc.StatusCode.UNAVAILABLE),
    (MetadataUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (CommitStateUnknownError, grpc.StatusCode.UNAVAILABLE),
    (WalClosedError, grpc.StatusCode.UNAVAILABLE),
    (WalBackpressureError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LimitExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WalFailedError, grpc.StatusCode.INTERNAL),
    # Idempotent producers (batch path): a gap must be filled first; an old sequence was
    # stored before.
    (SequenceGapError, grpc.StatusCode.FAILED_PRECONDITION),
    (DuplicateSequenceError, grpc.StatusCode.ALREADY_EXISTS),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a danube-client sees for ``exc``.

    UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED make the client retry (with a fresh
    lookup before re-creating); every other status reaches the application.
    """
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


#: Longest error text sent (characters): it travels in the ``grpc-message`` header,
#: percent-encoded (up to 12 bytes per character), and gRPC's default header limit is 8 KiB. A
#: longer one makes the client see RESOURCE_EXHAUSTED ("Stream removed") and retry for ever.
MAX_DETAILS = 600


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL and not isinstance(exc, DanubeIngestError):
        log.exception("internal error serving a request", exc_info=exc)
    details = str(exc)
    if len(details) > MAX_DETAILS:
        details = f"{details[: MAX_DETAILS - 20]}... ({len(details)} characters)"
    await context.abort(code, details)


class DiscoveryService(pb_grpc.DiscoveryServicer):  # type: ignore[misc]
    def __init__(self, manager: TopicManager, guard: Guard) -> None:
        self._manager = manager
        self._guard = guard

    async def TopicLookup(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._guard.authorize_any(self._guard.caller(context), request.topic)
            local, url = await self._manager.lookup(request.topic)
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.TopicLookupResponse(
            request_id=request.request_id,
            response_type=pb.TopicLookupResponse.Connect
            if local
            else pb.TopicLookupResponse.Redirect,
            connect_url=url,
            broker_url=url,
            proxy=False,
        )

    async def TopicPartitions(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._guard.authorize_any(self._guard.caller(context), request.topic)
            partitions = await self._manager.partitions(request.topic)
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.TopicPartitionsResponse(request_id=request.request_id, partitions=partitions)


class ProducerService(pb_grpc.ProducerServiceServicer):  # type: ignore[misc]
    def __init__(self, manager: TopicManager, guard: Guard, forwarder: Forwarder) -> None:
        self._manager = manager
        self._guard = guard
        self._forwarder = forwarder

    async def CreateProducer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            caller = self._guard.caller(context)
            self._guard.authorize(caller, "produce", request.topic_name)
            producer_id = await self._manager.create_producer(
                request.topic_name,
                request.producer_name,
                request.dispatch_strategy == pb.Reliable,
                request.schema_ref.subject if request.HasField("schema_ref") else None,
                owner=caller.owner,
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.ProducerResponse(
            request_id=request.request_id,
            producer_id=producer_id,
            producer_name=request.producer_name,
        )

    async def SendMessage(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            owner = None
            if self._guard.enabled:
                caller = self._guard.caller(context)
                owner = caller.owner
                record = await self._manager.producer(request.msg_id.producer_id, owner)
                self._guard.authorize(caller, "produce", record.topic)
            await self._manager.publish(request, owner)
        except NotOwnerError as exc:
            # The topic moved (a takeover, an unload): danube-client would keep sending here
            # until its retry budget is spent, so the owner is asked instead (broker.forward).
            url = self._forwarder.target(exc.owner_url, context)
            if url is None:
                await _abort(context, exc)
                raise
            return await self._forwarder.send_message(url, exc.topic, request, context)
        except Exception as exc:
            if status_for(exc) == grpc.StatusCode.INTERNAL:
                log.error(
                    "publish failed topic=%s producer_id=%d request_id=%d error=%r",
                    request.msg_id.topic_name or "-",
                    request.msg_id.producer_id,
                    request.request_id,
                    exc,
                )
            await _abort(context, exc)
            raise
        return pb.MessageResponse(request_id=request.request_id)


class ConsumerService(pb_grpc.ConsumerServiceServicer):  # type: ignore[misc]
    def __init__(self, manager: TopicManager, guard: Guard) -> None:
        self._manager = manager
        self._guard = guard

    async def Subscribe(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            caller = self._guard.caller(context)
            self._guard.authorize(caller, "consume", request.topic_name)
            sub_type = subscription_type(request.subscription_type)
            # Our own extension: where a new subscription starts (danube-client never sends it).
            start = from_metadata(context.invocation_metadata())
            consumer_id = await self._manager.subscribe(
                request.topic_name,
                request.subscription,
                request.consumer_name,
                sub_type,
                list(request.key_filters),
                start,
                owner=caller.owner,
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.ConsumerResponse(
            request_id=request.request_id,
            consumer_id=consumer_id,
            consumer_name=request.consumer_name,
        )

    async def ReceiveMessages(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            caller = self._guard.caller(context)
            manager = self._manager
            record = await manager.consumer(request.consumer_id, caller.owner)
            self._guard.authorize(caller, "consume", record.topic)
            topic = record.topic
            subscription = record.subscription or ""
            broker_url = manager.broker_url
            # Straight from the deliveries (no intermediate generator): this loop runs once
            # per delivered message.
            stream = manager.deliveries(request.consumer_id, 1, caller.peer, caller.owner)
            deadline = caller.deadline(asyncio.get_running_loop())
            expiry = None if deadline is None else _Expiry(deadline)
            try:
                while True:
                    if expiry is not None:
                        # The token's expiry ends the stream (UNAUTHENTICATED), also while it
                        # waits for a message; the generator's end detaches the consumer.
                        if expiry.fired:
                            await stream.aclose()
                            raise caller.expired()
                        expiry.waiting = True
                    try:
                        batch = await anext(stream)
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        if expiry is None or not expiry.fired:
                            raise
                        expiry.uncancel()
                        raise caller.expired() from None
                    finally:
                        if expiry is not None:
                            expiry.waiting = False
                    for delivery in batch:
                        assert isinstance(delivery, Delivery)  # (no frames asked for)
                        yield message_from_entry(delivery.entry, topic, subscription, broker_url)
            finally:
                if expiry is not None:
                    expiry.cancel()
        except Exception as exc:
            await _abort(context, exc)
            raise

    def _settler(self, context: grpc.aio.ServicerContext, topic: str) -> tuple[str, str | None]:
        """The connection and principal (``None`` with auth off) an Ack or Nack comes from,
        after checking the consume permission on ``topic``. With auth off no ``Caller`` is
        built: these run once per delivered message."""
        guard = self._guard
        if not guard.enabled:
            return context.peer(), None
        caller = guard.caller(context)
        guard.authorize(caller, "consume", topic)
        return caller.peer, caller.owner

    async def Ack(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            msg_id = request.msg_id
            topic = msg_id.topic_name
            parse_topic(topic)
            check_subscription_name(request.subscription_name, "ack")
            peer, owner = self._settler(context, topic)
            self._manager.ack(topic, request.subscription_name, msg_id.topic_offset, peer, owner)
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.AckResponse(request_id=request.request_id)

    async def Nack(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            parse_topic(request.msg_id.topic_name)
            check_subscription_name(request.subscription_name, "nack")
            peer, owner = self._settler(context, request.msg_id.topic_name)
            self._manager.nack(
                request.msg_id.topic_name,
                request.subscription_name,
                request.msg_id.topic_offset,
                request.delay_ms,
                request.reason,
                peer,
                owner,
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        return pb.NackResponse(request_id=request.request_id)


class _Expiry:
    """A stream's end at its token's expiry, for a loop that runs once per message: one timer
    per stream (not one per wait), which sets :attr:`fired` and cancels the handler task only
    while it waits for a delivery (:attr:`waiting`); between waits the loop reads
    :attr:`fired`."""

    __slots__ = ("_task", "_timer", "fired", "waiting")

    def __init__(self, deadline: float) -> None:
        """``deadline``: ``loop.time()`` of the expiry; the current task is the handler's."""
        self.fired = False
        self.waiting = False
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._timer = asyncio.get_running_loop().call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.fired = True
        if self.waiting:
            self._task.cancel()

    def uncancel(self) -> None:
        """Undo the cancellation :meth:`_fire` made (the handler goes on to abort)."""
        self._task.uncancel()

    def cancel(self) -> None:
        """Drop the timer (the stream ended)."""
        self._timer.cancel()


class HealthService(pb_grpc.HealthCheckServicer):  # type: ignore[misc]
    def __init__(self, manager: TopicManager, guard: Guard) -> None:
        self._manager = manager
        self._guard = guard

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            owner = self._guard.caller(context).owner
            ok = await self._manager.health(
                request.client == pb.HealthCheckRequest.Consumer, request.id, owner
            )
        except Exception as exc:
            await _abort(context, exc)
            raise
        status = pb.HealthCheckResponse.OK if ok else pb.HealthCheckResponse.CLOSE
        return pb.HealthCheckResponse(status=status)


class HandlerRegistry(Protocol):
    """Where generated ``add_*Servicer_to_server`` functions register their handlers: a
    ``grpc.aio.Server``, or the broker's start-up gate in front of one."""

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Sequence[grpc.GenericRpcHandler]
    ) -> None: ...

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None: ...


def add_services(server: HandlerRegistry, manager: TopicManager, guard: Guard) -> Forwarder:
    """Register danube-client's services on ``server``, checking callers with ``guard``.
    Returns the forwarder of publishes to other brokers (close it on shutdown)."""
    forwarder = Forwarder()
    pb_grpc.add_DiscoveryServicer_to_server(DiscoveryService(manager, guard), server)
    pb_grpc.add_ProducerServiceServicer_to_server(
        ProducerService(manager, guard, forwarder), server
    )
    pb_grpc.add_ConsumerServiceServicer_to_server(ConsumerService(manager, guard), server)
    pb_grpc.add_HealthCheckServicer_to_server(HealthService(manager, guard), server)
    return forwarder
