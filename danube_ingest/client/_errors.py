"""Exceptions raised by danube_ingest.client.

::

    ClientError                  root of the client's errors (``retriable`` as in danube_ingest)
     ├── PublishError             the daemon refused a batch for good; names the topic and code
     ├── DeliveryTimeoutError     a batch not answered within ``delivery_timeout``; retriable
     └── ConsumeError             the consume stream failed; names the topic and code;
                                  retriable when the stream was lost (``stream_lost``)
"""

from __future__ import annotations

import grpc


class ClientError(Exception):
    """Root of danube_ingest.client's errors."""

    retriable: bool = False


class PublishError(ClientError):
    """The daemon refused a batch and resending it unchanged cannot help (bad input, a
    producer sequence it no longer knows). ``code`` is the gRPC status, ``details`` its text.
    Nothing of the batch was stored, except with ALREADY_EXISTS (stored before; its offsets are
    no longer known)."""

    def __init__(self, code: grpc.StatusCode, details: str, topic: str) -> None:
        super().__init__(f"publish to {topic} refused ({code.name}): {details}")
        self.code = code
        self.details = details
        self.topic = topic


class DeliveryTimeoutError(ClientError):
    """A batch was not answered within the producer's ``delivery_timeout`` (the daemon down,
    unreachable or overloaded for that long). ``sent`` tells whether it was ever sent: if not,
    nothing of it is stored; if so, it may or may not be stored (its first attempt may have been
    stored and only the answer lost), but at most once: every attempt carried the same producer
    id and sequence, so the daemon stores a re-sent sequence once. Sending the messages again
    is a new publish (new sequence numbers) and may store them a second time."""

    retriable = True

    def __init__(self, topic: str, count: int, timeout: float, attempts: int) -> None:
        if attempts:
            state = (
                f"after {attempts} attempt(s) it may or may not be stored (at most once: every "
                "attempt used the same sequence number)"
            )
        else:
            state = "it was never sent, so nothing of it is stored"
        super().__init__(
            f"batch of {count} message(s) to {topic} not answered within delivery_timeout="
            f"{timeout:g}s; {state}. Check that the daemon is up and reachable, then send again "
            "(or raise delivery_timeout)"
        )
        self.topic = topic
        self.count = count
        self.attempts = attempts
        """How many times the batch was sent."""
        self.sent = attempts > 0


class ConsumeError(ClientError):
    """The consume stream ended with an error. ``code`` is the gRPC status, ``details`` its
    text. ``retriable``: the stream was lost (the daemon or the connection went away, see
    :func:`stream_lost`), so subscribing again can mend it; false for a refusal (a bad topic,
    credentials, an error the daemon reported)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, topic: str, *, lost: bool | None = None
    ) -> None:
        super().__init__(f"consuming {topic} failed ({code.name}): {details}")
        self.code = code
        self.details = details
        self.topic = topic
        self.retriable = stream_lost(code, details) if lost is None else lost


#: Statuses of a stream that was lost rather than refused: the daemon went away or restarted
#: (UNAVAILABLE, CANCELLED by the transport), the topic is moving (ABORTED), the daemon is
#: busy (RESOURCE_EXHAUSTED), or a deadline passed.
LOST = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
#: The details grpc.aio gives the INTERNAL status it sets itself (``set_internal_error``) when
#: a write fails because the call's transport is gone: the daemon died while the client was
#: sending (acks, a Subscribe). Its debug string is the failed core batch
#: (``Failed "execute_batch": ...``), where a status received from a peer reads
#: ``CODE:details``.
LOCAL_INTERNAL = "Internal error from Core"
#: The start of the details of an HTTP/2 stream reset (RST_STREAM), reported by the transport.
STREAM_RESET = "Received RST_STREAM"


def stream_lost(code: grpc.StatusCode, details: str, debug: str = "") -> bool:
    """Whether a stream that failed with ``code`` / ``details`` (``debug``: the call's
    ``debug_error_string()``, if known) was lost rather than refused.

    The rule: the codes in ``LOST``; and INTERNAL when gRPC made it, not the daemon: grpc.aio's
    own status for a write to a dead call (details exactly ``LOCAL_INTERNAL`` and a debug string
    that is not a received ``INTERNAL:...`` status) or a stream reset (details starting with
    ``STREAM_RESET``). The daemon never sends those texts: its INTERNAL carries its own error
    message, and is not retried, nor are INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED,
    UNAUTHENTICATED, FAILED_PRECONDITION and the other codes.
    """
    if code in LOST:
        return True
    if code != grpc.StatusCode.INTERNAL:
        return False
    if details == LOCAL_INTERNAL:
        return not debug.startswith("INTERNAL:")
    return details.startswith(STREAM_RESET)
