"""What a subscription hands to a consumer: :class:`Delivery` values (one message) or, to a
consumer that takes them (a batch consumer, ``frames`` > 0), :class:`Frame` values (a run of
consecutive offsets), through a :class:`ConsumerHandle`."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from danube_ingest.dispatch.errors import ConsumerClosedError
from danube_ingest.dispatch.keyshared import KeyFilter
from danube_ingest.dispatch.runs import Run
from danube_ingest.wal.framing import Entry


class Delivery(NamedTuple):
    """One message given to one consumer."""

    entry: Entry
    """The stored message; ``entry.offset`` is what the consumer acks or nacks."""
    attempt: int
    """1 on the first delivery, plus one per failed delivery (nack or ack timeout) before this
    one. A redelivery caused by the consumer detaching does not count as a failure."""


class Frame(NamedTuple):
    """Consecutive offsets given to one consumer at once: entry ``i`` has offset
    ``base_offset + i``. None of them has failed a delivery (attempt 1; they may come again
    after a consumer that held them left, which is no failure). Entries whose delivery failed
    (nack, ack timeout) go out again one by one, as :class:`Delivery` values with their
    attempt."""

    base_offset: int
    entries: Sequence[Entry]
    """The stored messages, as read (consecutive offsets, in order)."""


class _Owner(Protocol):
    def _detach_handle(self, handle: ConsumerHandle) -> None: ...

    def _receiving(self, handle: ConsumerHandle) -> None: ...


class ConsumerHandle:
    """One attached consumer's end of a subscription.

    Deliveries come out of :meth:`next` in the order the subscription dispatched them. The
    handle is read by one task (the consumer's ReceiveMessages stream). Once the consumer is
    detached or taken over, :meth:`next` raises :class:`ConsumerClosedError` and the messages it
    still held (queued or unacknowledged) are redelivered by the subscription.

    A Shared or KeyShared subscription gives a consumer messages only while it is
    :attr:`receiving`: a handle attached with ``receiving=False`` (the broker's Subscribe,
    before the consumer opens its stream) starts receiving at :meth:`open_stream` or its first
    :meth:`next` / :meth:`next_batch`, so a consumer that subscribed and never opened its
    stream holds nothing the others could have had.
    """

    def __init__(
        self,
        owner: _Owner,
        consumer_id: int,
        name: str,
        key_filter: KeyFilter,
        description: str,
        frames: int = 0,
        receiving: bool = True,
    ) -> None:
        self._owner = owner
        self.consumer_id = consumer_id
        self.name = name
        self.key_filter = key_filter
        self._description = description
        self.frames = frames
        """Most entries in one :class:`Frame` given to this consumer; 0: it takes only
        :class:`Delivery` values (a danube-client consumer)."""
        # Dispatched to this consumer and not yet taken, in dispatch order: a Delivery keyed by
        # its offset, or a run (a Frame once taken) keyed by itself.
        self._queue: OrderedDict[object, Delivery | Run] = OrderedDict()
        # Reliable subscriptions: offsets this consumer holds unacknowledged one by one (queued
        # or taken), and the runs it holds (ascending offsets) with how many entries they hold.
        self._window: set[int] = set()
        self._runs: deque[Run] = deque()
        self._run_held = 0
        self._closed = False
        self._close_reason = ""
        self._waiter: asyncio.Future[None] | None = None
        self.receiving = receiving
        """Whether the consumer's stream is open (:meth:`open_stream`, or the first :meth:`next`
        or :meth:`next_batch`); Shared and KeyShared give messages only to receiving
        consumers."""
        self.dropped = 0
        """Non-reliable subscriptions: messages dropped because this consumer's queue was full."""
        self.progress_at = 0.0
        """Reliable subscriptions: when (subscription clock) this consumer last acked one of its
        entries, or last got one with nothing else unacknowledged; with ``in_flight`` > 0, how
        long it has held messages without acking any."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"ConsumerHandle({self.consumer_id}, {self.name!r}, {state})"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Reliable subscriptions: messages this consumer holds unacknowledged."""
        return len(self._window) + self._run_held

    @property
    def queued(self) -> int:
        """Messages dispatched to this consumer that :meth:`next` has not returned yet."""
        return len(self._queue)

    async def next(self) -> Delivery:
        """Wait for this consumer's next delivery (a consumer with ``frames`` 0 only gets
        :class:`Delivery` values).

        Raises :class:`ConsumerClosedError` once the handle is closed, even if deliveries were
        queued (the subscription redelivers those). Cancelling the wait loses nothing.
        """
        await self._wait()
        item = self._take()
        if not isinstance(item, Delivery):
            raise RuntimeError(f"{self._description} takes frames: use next_batch()")
        return item

    async def next_batch(self, limit: int) -> list[Delivery | Frame]:
        """Wait for this consumer's next delivery, then take those queued (in dispatch order),
        whole, while they hold at most ``limit`` messages in all (the first is taken whatever its
        size; the subscription makes no frame larger than ``frames``). Raises as :meth:`next`
        does."""
        await self._wait()
        first = self._take()
        batch = [first]
        count = 1 if isinstance(first, Delivery) else len(first.entries)
        queue = self._queue
        while queue and count < limit:
            item = next(iter(queue.values()))
            size = 1 if isinstance(item, Delivery) else len(item.entries)
            if count + size > limit:
                break
            batch.append(self._take())
            count += size
        return batch

    def open_stream(self) -> None:
        """The consumer's stream is open: it receives from now on (idempotent; a no-op once
        closed). The subscription may queue deliveries to it at once."""
        if not self.receiving and not self._closed:
            self.receiving = True
            self._owner._receiving(self)

    async def _wait(self) -> None:
        if not self.receiving:
            self.open_stream()
        while True:
            if self._closed:
                raise ConsumerClosedError(f"{self._description} {self._close_reason}")
            if self._queue:
                return
            if self._waiter is not None:
                raise RuntimeError(f"{self._description}: next() is already being awaited")
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None

    def _take(self) -> Delivery | Frame:
        item = self._queue.popitem(last=False)[1]
        if isinstance(item, Delivery):
            return item
        item.queued = False
        return Frame(item.base, item.entries)

    def held(self, first: int, last: int) -> list[int]:
        """Reliable subscriptions: the offsets in ``[first, last]`` this consumer holds
        unacknowledged one by one (not in frames), ascending."""
        return sorted(o for o in self._window if first <= o <= last)

    def holds(self, offset: int) -> bool:
        """Reliable subscriptions: whether ``offset`` is dispatched to this consumer and not yet
        acknowledged (who may settle it)."""
        return offset in self._window

    def close(self) -> None:
        """Detach this consumer if it is still attached (a no-op after a takeover)."""
        self._owner._detach_handle(self)

    # -- used by the subscriptions -----------------------------------------------------------

    def _push(self, delivery: Delivery) -> None:
        self._queue[delivery.entry.offset] = delivery
        self._wake()

    def _push_run(self, run: Run) -> None:
        run.queued = True
        self._queue[run] = run
        self._wake()

    def _withdraw(self, offset: int) -> None:
        self._queue.pop(offset, None)

    def _shutdown(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            self._close_reason = reason
            self._queue.clear()
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
