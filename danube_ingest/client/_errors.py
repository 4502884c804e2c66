"""Exceptions raised by danube_ingest.client.

::

    ClientError                  root of the client's errors (``retriable`` as in danube_ingest)
     ├── PublishError             the daemon refused a batch for good; names the topic and code
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


class ConsumeError(ClientError):
    """The consume stream ended with an error. ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str, topic: str) -> None:
        super().__init__(f"consuming {topic} failed ({code.name}): {details}")
        self.code = code
        self.details = details
        self.topic = topic
        self.retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
