"""Errors raised by the dispatch layer.

::

    DispatchError                        (DanubeIngestError)
     ├── ConsumerClosedError              the handle was detached, taken over, or its
     │                                    subscription closed; re-attach to continue
     ├── SubscriptionBusyError            an exclusive subscription is held by another consumer
     │                                    name (the broker answers PERMISSION_DENIED)
     └── SubscriptionTypeMismatchError    a consumer asked for a type other than the
                                          subscription's (the broker answers FAILED_PRECONDITION)
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class DispatchError(DanubeIngestError):
    """Root of the dispatch layer's errors."""


class ConsumerClosedError(DispatchError):
    """A consumer handle no longer receives messages.

    Its unacknowledged messages have been handed back to the subscription for redelivery.
    """


class SubscriptionBusyError(DispatchError):
    """An exclusive subscription already has a consumer with another name."""

    def __init__(self, topic: str, subscription: str, holder: str, requester: str) -> None:
        super().__init__(
            f"exclusive subscription {subscription} on topic {topic} is held by consumer "
            f"{holder!r}; consumer {requester!r} cannot attach until it detaches"
        )
        self.topic = topic
        self.subscription = subscription
        self.holder = holder
        self.requester = requester


class SubscriptionTypeMismatchError(DispatchError):
    """A consumer attached with a subscription type other than the subscription's."""

    def __init__(self, topic: str, subscription: str, existing: str, requested: str) -> None:
        super().__init__(
            f"subscription {subscription} on topic {topic} is {existing}; a consumer cannot "
            f"attach to it as {requested} (use another subscription name)"
        )
        self.topic = topic
        self.subscription = subscription
        self.existing = existing
        self.requested = requested
