"""Forwarding danube-client publishes from a broker that lost a topic to its owner.

Why: danube-client looks a topic up again only once its producer's retry budget is spent
(``max_retries`` retriable answers in a row). An application that bridges broker restarts
with a large budget (300 tries of 100-200 ms, say) keeps sending to a broker that answers
``UNAVAILABLE`` (``NotOwnerError``) for about 45 s after the topic moved: after a takeover
from a paused or partitioned owner, or an unload. So a broker whose publish finds the topic
owned by another live broker forwards the call to that owner and relays its answer; the
producer's messages reach the new owner as soon as it serves the topic.

Guarantees:

* An OK is relayed only when the owner answered OK, and the owner acknowledges only what is
  durable in its WAL: nothing is acknowledged that is not on disk.
* The owner's status and details are relayed unchanged (``UNAVAILABLE`` while it waits for a
  takeover, ``NOT_FOUND``, ``INVALID_ARGUMENT``...); an owner that cannot be reached within the
  call's deadline is ``UNAVAILABLE`` (retried by the client).
* A forwarded call carries ``FORWARDED_HEADER`` and is never forwarded again: brokers that
  disagree about the owner answer ``UNAVAILABLE`` rather than pass a call around.
* The caller's ``authorization`` header goes along, so the owner authenticates and authorizes
  the same principal.

Limit: only owners with a plaintext URL (``http://``) are forwarded to; with TLS the broker
answers ``UNAVAILABLE`` as before (the client re-looks up after its retry budget).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: Metadata key marking a call one broker forwarded to another.
FORWARDED_HEADER = "x-danube-ingest-forwarded"
#: Headers of the caller's request that go along with a forwarded call.
_RELAYED_HEADERS = ("authorization",)
#: Deadline of a forwarded call when the caller set none (seconds): as long as a publish may
#: wait for the owner's WAL under backpressure, and well under a client's patience.
FORWARD_TIMEOUT = 30.0


class Forwarder:
    """Forwards SendMessage calls to a topic's owner. Use from one event loop."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, Any] = {}
        #: (topic, owner URL) pairs already logged (one line per move, not per message)
        self._logged: set[tuple[str, str]] = set()

    def target(self, owner_url: str | None, context: grpc.aio.ServicerContext) -> str | None:
        """Where to forward a call that found its topic owned by ``owner_url``; None if it must
        not be forwarded (unknown owner, a TLS owner, or the call was forwarded already)."""
        if owner_url is None or not owner_url.startswith("http://"):
            return None
        for key, _ in context.invocation_metadata() or ():
            if key == FORWARDED_HEADER:
                return None
        return owner_url

    async def send_message(
        self, url: str, topic: str, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """The owner's answer to ``request``; aborts ``context`` with the owner's status when it
        fails (see the module docstring)."""
        if (topic, url) not in self._logged:
            self._logged.add((topic, url))
            log.info("forwarding publishes to the topic's owner topic=%s owner=%s", topic, url)
        metadata = [(FORWARDED_HEADER, "1")]
        metadata += [
            (key, str(value))
            for key, value in context.invocation_metadata() or ()
            if key in _RELAYED_HEADERS
        ]
        remaining = context.time_remaining()
        timeout = FORWARD_TIMEOUT if remaining is None else min(remaining, FORWARD_TIMEOUT)
        try:
            return await self._stub(url).SendMessage(request, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                code = grpc.StatusCode.UNAVAILABLE
            details = exc.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                details = f"topic {topic} is owned by {url}, which answered: {details}"
            await context.abort(code, details)
            raise

    def _stub(self, url: str) -> Any:
        stub = self._stubs.get(url)
        if stub is None:
            channel = grpc.aio.insecure_channel(url.removeprefix("http://"))
            self._channels[url] = channel
            stub = self._stubs[url] = pb_grpc.ProducerServiceStub(channel)
        return stub

    async def close(self) -> None:
        """Close the channels to other brokers. Idempotent."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()


__all__ = ["FORWARDED_HEADER", "FORWARD_TIMEOUT", "Forwarder"]
