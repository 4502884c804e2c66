"""Exceptions raised by danube_ingest.client.

::

    ClientError                  root of the client's errors (``retriable`` as in danube_ingest)
     ├── PublishError             the daemon refused a batch for good; names the topic and code
     ├── DeliveryTimeoutError     a batch not answered within ``delivery_timeout``; retriable
     └── ConsumeError             the consume stream failed; names the topic and code
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
        self.sent = attempts > 0


class ConsumeError(ClientError):
    """The consume stream ended with an error. ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str, topic: str) -> None:
        super().__init__(f"consuming {topic} failed ({code.name}): {details}")
        self.code = code
        self.details = details
        self.topic = topic
        self.retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
