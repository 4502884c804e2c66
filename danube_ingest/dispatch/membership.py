"""Which consumers a subscription has and which of them may receive, by subscription type.

Shared by the reliable and non-reliable subscriptions, so both apply the same attach rules:

* a consumer id attaching again replaces its previous handle (a takeover), keeping its place
  in the attach order (so a failover consumer reopening its stream stays active);
* Exclusive admits one consumer name: the same name with another id takes over, another name
  is refused with :class:`SubscriptionBusyError`;
* Failover: the earliest attached consumer is active, the others stand by in attach order;
* Shared and KeyShared: every consumer whose stream is open receives
  (``ConsumerHandle.receiving``); one that subscribed and never opened its stream is attached
  (it counts against the subscription's consumer limit, and a later stream finds it) but is
  given nothing, and is not on the KeyShared hash ring until its stream opens.
"""

from __future__ import annotations

from collections.abc import Callable

from danube_ingest.dispatch.consumer import ConsumerHandle
from danube_ingest.dispatch.errors import SubscriptionBusyError, SubscriptionTypeMismatchError
from danube_ingest.dispatch.keyshared import HashRing
from danube_ingest.dispatch.policy import SubscriptionType


class Membership:
    def __init__(self, topic: str, subscription: str, sub_type: SubscriptionType) -> None:
        self.topic = topic
        self.subscription = subscription
        self.sub_type = sub_type
        self._handles: list[ConsumerHandle] = []
        self._by_id: dict[int, ConsumerHandle] = {}
        self._ring = HashRing() if sub_type is SubscriptionType.KEY_SHARED else None
        self._shared = sub_type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED)
        self._rr = 0

    def __len__(self) -> int:
        return len(self._handles)

    @property
    def handles(self) -> tuple[ConsumerHandle, ...]:
        """Attached consumers in attach order."""
        return tuple(self._handles)

    def get(self, consumer_id: int) -> ConsumerHandle | None:
        return self._by_id.get(consumer_id)

    def check_type(self, requested: SubscriptionType | None) -> None:
        if requested is not None and SubscriptionType(requested) is not self.sub_type:
            raise SubscriptionTypeMismatchError(
                self.topic, self.subscription, self.sub_type.name, SubscriptionType(requested).name
            )

    def attach(self, handle: ConsumerHandle) -> list[ConsumerHandle]:
        """Add ``handle``; return the handles it replaces (the caller closes them)."""
        replaced = [h for h in self._handles if h.consumer_id == handle.consumer_id]
        if self.sub_type is SubscriptionType.EXCLUSIVE:
            others = [h for h in self._handles if h not in replaced]
            strangers = [h for h in others if h.name != handle.name]
            if strangers:
                raise SubscriptionBusyError(
                    self.topic, self.subscription, strangers[0].name, handle.name
                )
            replaced.extend(others)
        if replaced:
            position = self._handles.index(replaced[0])
            self._handles[position] = handle
            for old in replaced[1:]:
                self._handles.remove(old)
            for old in replaced:
                self._by_id.pop(old.consumer_id, None)
        else:
            self._handles.append(handle)
        self._by_id[handle.consumer_id] = handle
        if self._ring is not None:
            for old in replaced:
                self._ring.remove(old.consumer_id)
            if handle.receiving:
                self._ring.add(handle.consumer_id, handle.key_filter)
        return replaced

    def start_receiving(self, handle: ConsumerHandle) -> bool:
        """``handle``'s stream opened: return whether that changes who receives (Shared and
        KeyShared, for an attached handle; KeyShared puts it on the hash ring)."""
        if self._by_id.get(handle.consumer_id) is not handle or not self._shared:
            return False
        if self._ring is not None:
            self._ring.add(handle.consumer_id, handle.key_filter)
        return True

    def remove(self, handle: ConsumerHandle) -> bool:
        """Remove ``handle`` if it is attached; return whether it was."""
        if self._by_id.get(handle.consumer_id) is not handle:
            return False
        del self._by_id[handle.consumer_id]
        self._handles.remove(handle)
        if self._ring is not None:
            self._ring.remove(handle.consumer_id)
        return True

    def receivers(self) -> list[ConsumerHandle]:
        """The consumers that may be given messages now."""
        if not self._shared:
            return self._handles[:1]
        return [h for h in self._handles if h.receiving]

    def receiver_count(self) -> int:
        if not self._shared:
            return min(1, len(self._handles))
        return sum(1 for h in self._handles if h.receiving)

    def active(self) -> ConsumerHandle | None:
        """Exclusive and Failover: the consumer that receives."""
        return self._handles[0] if self._handles else None

    def round_robin(self, has_room: Callable[[ConsumerHandle], bool]) -> ConsumerHandle | None:
        """Shared: the next receiving consumer in turn that has room (``None`` when none
        has)."""
        handles = self._handles
        n = len(handles)
        for i in range(n):
            index = (self._rr + i) % n
            if handles[index].receiving and has_room(handles[index]):
                self._rr = index + 1
                return handles[index]
        return None

    def key_owner(self, key: str) -> ConsumerHandle | None:
        """KeyShared: the consumer the hash ring gives ``key`` to (``None``: nobody accepts)."""
        assert self._ring is not None
        consumer_id = self._ring.lookup(key)
        return None if consumer_id is None else self._by_id[consumer_id]
