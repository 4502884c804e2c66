"""Dispatch: from a topic to a subscription's consumers.

Reliable topics (stored in the :class:`~danube_ingest.store.TopicStore`) get
:class:`ReliableSubscription` (at-least-once, acks, redelivery, poison policy); non-reliable
topics get :class:`NonReliableTopic` / :class:`NonReliableSubscription` (live fan-out,
at-most-once). Both follow the :class:`Subscription` contract. This package imports neither
grpc nor the metadata store: cursors leave through a callback, dead letters through another.
"""

from danube_ingest.dispatch.clock import Clock, LoopClock, ManualClock, Timer
from danube_ingest.dispatch.consumer import ConsumerHandle, Delivery, Frame
from danube_ingest.dispatch.deadletter import DeadLetterCallback, dead_letter_attributes
from danube_ingest.dispatch.errors import (
    ConsumerClosedError,
    DispatchError,
    SubscriptionBusyError,
    SubscriptionTypeMismatchError,
)
from danube_ingest.dispatch.keyshared import HashRing, KeyFilter, routing_key_of
from danube_ingest.dispatch.nonreliable import NonReliableSubscription, NonReliableTopic
from danube_ingest.dispatch.policy import DispatchPolicy, PoisonPolicy, SubscriptionType
from danube_ingest.dispatch.reliable import CursorCallback, ReliableSubscription, SubscriptionStats
from danube_ingest.dispatch.subscription import Subscription

__all__ = [
    "Clock",
    "ConsumerClosedError",
    "ConsumerHandle",
    "CursorCallback",
    "DeadLetterCallback",
    "Delivery",
    "DispatchError",
    "DispatchPolicy",
    "Frame",
    "HashRing",
    "KeyFilter",
    "LoopClock",
    "ManualClock",
    "NonReliableSubscription",
    "NonReliableTopic",
    "PoisonPolicy",
    "ReliableSubscription",
    "Subscription",
    "SubscriptionBusyError",
    "SubscriptionStats",
    "SubscriptionType",
    "SubscriptionTypeMismatchError",
    "Timer",
    "dead_letter_attributes",
    "routing_key_of",
]
