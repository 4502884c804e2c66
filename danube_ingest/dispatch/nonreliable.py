"""Non-reliable (at-most-once) dispatch: live fan-out of published entries, nothing stored.

* A :class:`NonReliableTopic` gives each published entry the next in-memory offset and hands it
  to every subscription that exists at that moment; nothing is kept for subscriptions or
  consumers that come later.
* A :class:`NonReliableSubscription` picks the receiving consumer by type, with the same attach
  rules as reliable subscriptions (Exclusive takeover and busy error, Failover order, KeyShared
  hash ring and key filters), and queues the entry in that consumer's handle.
* Each consumer queue holds at most ``queue_size`` entries: when it is full the entry is
  dropped for that consumer and counted (``ConsumerHandle.dropped``), so a slow consumer never
  holds up the publisher or other consumers. A KeyShared entry that no consumer accepts is
  dropped and counted in ``unrouted``.
* Each consumer receives its entries in publish order. Ack and nack are accepted and ignored;
  a detached consumer's queued entries are lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from danube_ingest.dispatch.consumer import ConsumerHandle, Delivery
from danube_ingest.dispatch.errors import ConsumerClosedError
from danube_ingest.dispatch.keyshared import KeyFilter, routing_key_of
from danube_ingest.dispatch.membership import Membership
from danube_ingest.dispatch.policy import SubscriptionType
from danube_ingest.wal.framing import Entry

#: Entries a non-reliable consumer may have queued before new ones are dropped for it. Large
#: enough to absorb a scheduling hiccup of a consumer reading at full speed; small enough that
#: a stalled consumer costs little memory.
DEFAULT_QUEUE_SIZE = 1000


class NonReliableSubscription:
    """One subscription of a non-reliable topic (see the module docs)."""

    def __init__(
        self,
        name: str,
        topic: str,
        sub_type: SubscriptionType,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.name = name
        self.topic = topic
        self.sub_type = SubscriptionType(sub_type)
        self.queue_size = queue_size
        self.unrouted = 0
        """KeyShared entries dropped because no attached consumer accepts their key."""
        self._members = Membership(topic, name, self.sub_type)
        self._dropped = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"NonReliableSubscription({self.name!r}, topic={self.topic!r}, {self.sub_type.name})"

    @property
    def consumers(self) -> tuple[ConsumerHandle, ...]:
        return self._members.handles

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def dropped(self) -> int:
        """Entries dropped for a full consumer queue, over all consumers ever attached."""
        return self._dropped

    def attach(
        self,
        consumer_id: int,
        name: str,
        key_filters: Iterable[str] = (),
        *,
        sub_type: SubscriptionType | None = None,
        frames: int = 0,
        receiving: bool = True,
    ) -> ConsumerHandle:
        """Attach a consumer (same rules and errors as :meth:`ReliableSubscription.attach`);
        it receives entries published from now on, always one by one (``frames`` is ignored:
        nothing is stored, so there is no frame to hand on)."""
        if self._closed:
            raise ConsumerClosedError(
                f"subscription {self.name} on topic {self.topic} is closed; subscribe again"
            )
        self._members.check_type(sub_type)
        handle = ConsumerHandle(
            self,
            consumer_id,
            name,
            KeyFilter(key_filters),
            f"consumer {consumer_id} ({name!r}) of subscription {self.name} on topic {self.topic}",
            receiving=receiving,
        )
        for old in self._members.attach(handle):
            old._shutdown("was taken over by a new attach of the same consumer")
        return handle

    def detach(self, consumer_id: int) -> bool:
        handle = self._members.get(consumer_id)
        if handle is None:
            return False
        self._detach_handle(handle)
        return True

    def _detach_handle(self, handle: ConsumerHandle) -> None:
        if self._members.remove(handle):
            handle._shutdown("was detached")

    def _receiving(self, handle: ConsumerHandle) -> None:
        self._members.start_receiving(handle)

    def ack(self, offset: int) -> bool:
        """No-op: non-reliable deliveries are not tracked."""
        return False

    def ack_many(self, offsets: Iterable[int]) -> int:
        """No-op: non-reliable deliveries are not tracked."""
        return 0

    def ack_range(self, handle: ConsumerHandle, first: int, last: int) -> int:
        """No-op: non-reliable deliveries are not tracked."""
        return 0

    def nack(self, offset: int, delay_ms: int | None = None, reason: str | None = None) -> bool:
        """No-op: non-reliable deliveries are never redelivered."""
        return False

    def deliver(self, entry: Entry) -> bool:
        """Queue ``entry`` for the consumer the subscription type picks; return whether it was
        queued (``False``: no consumer, or dropped)."""
        members = self._members
        if self._closed or not len(members):
            return False
        target: ConsumerHandle | None
        if self.sub_type is SubscriptionType.SHARED:
            target = members.round_robin(self._has_room)
            if target is None:  # every queue is full: charge the drop to the next in turn
                target = members.round_robin(lambda _: True)
            if target is None:
                return False  # no consumer's stream is open
        elif self.sub_type is SubscriptionType.KEY_SHARED:
            target = members.key_owner(routing_key_of(entry))
            if target is None:
                self.unrouted += 1
                return False
        else:
            target = members.active()
        assert target is not None
        if not self._has_room(target):
            target.dropped += 1
            self._dropped += 1
            return False
        target._push(Delivery(entry, 1))
        return True

    def _has_room(self, handle: ConsumerHandle) -> bool:
        return len(handle._queue) < self.queue_size

    async def close(self) -> None:
        """Close every consumer handle; later deliveries are ignored. Idempotent."""
        self._closed = True
        for handle in self._members.handles:
            self._members.remove(handle)
            handle._shutdown("was closed with its subscription")


class NonReliableTopic:
    """A non-reliable topic: in-memory offsets and fan-out to its live subscriptions."""

    def __init__(self, name: str, *, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self.name = name
        self.queue_size = queue_size
        self._subscriptions: dict[str, NonReliableSubscription] = {}
        self._next_offset = 0

    def __repr__(self) -> str:
        return f"NonReliableTopic({self.name!r}, next_offset={self._next_offset})"

    @property
    def high_watermark(self) -> int:
        """The offset the next published entry gets."""
        return self._next_offset

    @property
    def subscriptions(self) -> dict[str, NonReliableSubscription]:
        """A copy of the subscriptions by name."""
        return dict(self._subscriptions)

    def subscription(self, name: str, sub_type: SubscriptionType) -> NonReliableSubscription:
        """The subscription ``name``, created with ``sub_type`` if it does not exist.

        Raises :class:`SubscriptionTypeMismatchError` if it exists with another type.
        """
        subscription = self._subscriptions.get(name)
        if subscription is None or subscription.closed:
            subscription = NonReliableSubscription(
                name, self.name, sub_type, queue_size=self.queue_size
            )
            self._subscriptions[name] = subscription
        else:
            subscription._members.check_type(sub_type)
        return subscription

    async def remove_subscription(self, name: str) -> None:
        """Close and forget a subscription; a no-op if there is none."""
        subscription = self._subscriptions.pop(name, None)
        if subscription is not None:
            await subscription.close()

    def publish(self, entry: Entry) -> int:
        """Assign ``entry`` the next offset (and an ingest time if it has none), hand it to
        every subscription, and return the offset."""
        offset = self._next_offset
        self._next_offset = offset + 1
        entry.offset = offset
        if not entry.ingest_ms:
            entry.ingest_ms = int(time.time() * 1000)
        for subscription in self._subscriptions.values():
            subscription.deliver(entry)
        return offset

    async def close(self) -> None:
        """Close every subscription."""
        subscriptions, self._subscriptions = self._subscriptions, {}
        for subscription in subscriptions.values():
            await subscription.close()
