"""Errors of the broker layer and the gRPC status each one is answered with.

::

    BrokerError                     status
     ├── TopicNotFoundError          NOT_FOUND
     ├── UnknownClientError          NOT_FOUND            unknown producer or consumer id
     ├── NotOwnerError               UNAVAILABLE          another broker owns the topic (retriable)
 ├── TakeoverPendingError        UNAVAILABLE          the new owner waits for the previous
 │                                                    owner's unuploaded tail (retriable)
     ├── StrategyMismatchError       FAILED_PRECONDITION  reliable vs non-reliable, or sub type
     ├── SubscriptionInUseError      FAILED_PRECONDITION  reset/delete with consumers connected
     ├── SubscriptionNotFoundError   NOT_FOUND            reset/delete of an unknown subscription
     ├── InvalidRequestError         INVALID_ARGUMENT     oversize payload, too many attributes...
     ├── LimitExceededError          RESOURCE_EXHAUSTED   too many producers / consumers
     └── ListenError                 (start-up)           the listen address cannot be bound
          ├── InsecureListenError     (start-up)           plain gRPC beyond loopback, not allowed
          └── TlsSetupError           (start-up)           a TLS file is unreadable or not PEM

Errors raised by other layers are mapped in ``broker.status``.
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class BrokerError(DanubeIngestError):
    """Root of the broker's request errors."""


class TopicNotFoundError(BrokerError):
    pass


class UnknownClientError(BrokerError):
    pass


class NotOwnerError(BrokerError):
    """The topic is owned by another live broker; look it up again."""

    retriable = True

    def __init__(self, topic: str, owner_url: str | None) -> None:
        super().__init__(f"topic {topic} is owned by {owner_url or 'another broker'}")
        self.topic = topic
        self.owner_url = owner_url


class TakeoverPendingError(BrokerError):
    """This broker owns the topic but serves nothing of it until the previous owner's
    unuploaded tail is recovered, or an operator declares that broker lost
    (``metadata.handover``). Retriable: try again shortly."""

    retriable = True

    def __init__(self, topic: str, previous: str, committed: int, reserved: int) -> None:
        super().__init__(
            f"topic {topic} is not served yet: its new owner waits for broker {previous} to "
            f"upload offsets {committed}..{reserved - 1} it may have acknowledged (restart "
            f"{previous}, or run 'danube-ingest brokers forget {previous}' to declare them "
            "lost); retry shortly"
        )
        self.topic = topic
        self.previous = previous


class StrategyMismatchError(BrokerError):
    pass


class SubscriptionNotFoundError(BrokerError):
    """A subscription named by an admin call does not exist."""


class SubscriptionInUseError(BrokerError):
    """An admin call would move or remove a subscription that has connected consumers: they
    must stop first (their in-flight messages and acks would otherwise race the change)."""


class InvalidRequestError(BrokerError):
    pass


class LimitExceededError(BrokerError):
    retriable = True


class ListenError(BrokerError):
    """The broker cannot bind its listen address (in use by another process, or not an
    address of this host). Raised by ``Broker.start`` before anything is served."""


class InsecureListenError(ListenError):
    """The listen address is not loopback, TLS is off and ``broker.allow_insecure`` is not
    set (``broker.tls``): the broker refuses to start rather than serve plain gRPC there."""


class TlsSetupError(ListenError):
    """A ``broker.tls`` file cannot be read, is not PEM of the right kind, or the key does
    not match the certificate. The message names the key and the file."""
