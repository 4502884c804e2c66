"""Reliable (at-least-once) dispatch of a stored topic to one subscription's consumers.

Guarantees of a :class:`ReliableSubscription` started at offset ``s``:

* **At least once.** Every entry of the topic from ``s`` on is delivered, and delivered again
  (after a nack, an ack timeout, or its consumer detaching) until it is *settled*: acked, or
  dropped / dead-lettered by the poison policy. Nothing else settles an entry (but see
  *Retention*).
* **Cursor.** ``cursor`` is the lowest unsettled offset (or, with nothing unsettled, the next
  offset to read): every offset below it is settled. It never decreases; ``on_cursor`` is
  called with each new value. A subscription restarted from its cursor delivers every entry
  from there on: the unsettled ones, and those acked out of order above the cursor, again.
* **Ordering.** New entries are dispatched in offset order. Exclusive and Failover consumers
  receive them in offset order; KeyShared consumers receive each key's entries in offset order,
  and a key stays on its consumer while that consumer holds unacknowledged entries of the key,
  even when the membership changes (it moves, by the hash ring, once they are all settled).
  Redeliveries are dispatched before new entries, lowest offset first, so a redelivered entry
  arrives after later entries the consumer already got. Shared promises no order.
* **Flow control.** A consumer holds at most ``policy.max_unacked`` unacknowledged entries
  (queued in its handle or taken). The subscription reads from the topic only while a
  receiving consumer has room and its unsettled entries number fewer than ``max_unacked`` per
  receiving consumer (one for Exclusive and Failover), so it holds at most that many entries
  plus one read batch, whatever the consumers do. A KeyShared entry whose key no attached
  consumer accepts stays unsettled (counted in that budget) until one that accepts it attaches;
  Danube skips such entries, which would lose a filtered consumer's keys while it restarts.
* **Redelivery.** Delivery number ``n`` of an entry fails when it is nacked or not acked within
  ``ack_timeout_s``; the entry is redelivered after the delay :class:`DispatchPolicy` states,
  to whichever consumer the subscription type picks. After ``1 + max_redeliveries`` failed
  deliveries the poison policy applies (see :class:`PoisonPolicy`). A consumer detaching or
  being taken over is not a failure of its entries: they are redelivered at once with the same
  attempt number, because the Danube client reopens its stream (a takeover here) after any
  network error, and counting those would poison healthy messages on a flaky network. Entries
  that timed out in a consumer's hands and wait for their redelivery delay are redelivered at
  once too when that consumer leaves (the delay backs off the consumer that did not ack them),
  so a consumer taking over an Exclusive or Failover subscription gets what its predecessor
  held, timed out or not, in offset order (a nacked entry keeps the delay its nack asked for).
* **Retention.** If the cursor falls below the topic's first retained offset, the subscription
  skips to that offset (logged at warning level, counted in ``stats.skipped``): those entries
  no longer exist anywhere the store can read. The same holds below the retained floor of the
  topic's objects (object retention): the cold reader names the floor, never a silent gap.
* **Acks** may arrive in any order and from any consumer; acks and nacks of unknown or settled
  offsets are ignored. A late ack (after the ack timeout) still settles the entry.
* **Frames.** Exclusive and Failover subscriptions whose active consumer was attached with
  ``frames`` > 0 (a batch consumer) read stored entries and track them as runs of consecutive
  offsets (one per read batch, see :mod:`~danube_ingest.dispatch.runs`); that consumer gets a
  run as one :class:`Frame` of at most that many entries (and at most what its window has room
  for), acks it with :meth:`ack_range`, and costs the subscription per frame, not per message.
  While the active consumer takes single messages (a danube-client consumer) entries are read
  and tracked one by one, as for Shared; the subscription switches between the two between
  reads when the active consumer changes, and what it already holds keeps its form.
  Everything above holds for frames too: a run held by a consumer that leaves goes back,
  whole, to be delivered first (same attempt); a run that is nacked or times out, or that a
  consumer with ``frames`` 0 (a danube-client consumer) is to receive, becomes per-message
  state (the per-message path, with each entry's attempt) for good. Shared and KeyShared stay
  per message (Shared's round robin is per message, KeyShared routes each message by its key).

Use one subscription from one event loop; construct it from a coroutine.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from danube_ingest.dispatch.clock import Clock, LoopClock, Timer
from danube_ingest.dispatch.consumer import ConsumerHandle, Delivery
from danube_ingest.dispatch.deadletter import DeadLetterCallback, DeadLetterQueue
from danube_ingest.dispatch.errors import ConsumerClosedError
from danube_ingest.dispatch.keyshared import KeyFilter, routing_key_of
from danube_ingest.dispatch.membership import Membership
from danube_ingest.dispatch.policy import DispatchPolicy, PoisonPolicy, SubscriptionType
from danube_ingest.dispatch.runs import Run
from danube_ingest.errors import ConfigError, DanubeIngestError, OffsetOutOfRangeError
from danube_ingest.store.topic_store import TopicReader, TopicStore
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.stored import StoredEntries, first_offset, last_offset

log = logging.getLogger(__name__)

#: Backoff of the read loop when the store fails with a retriable error (seconds).
_READ_RETRY_BASE = 0.1
_READ_RETRY_MAX = 5.0

#: ``_Message.reason`` of a delivery that failed by ack timeout.
_ACK_TIMEOUT = "ack timeout"

CursorCallback = Callable[[int], None]
"""Called with the new cursor each time it advances (e.g. ``ProgressUpdater.set``)."""


class _State(enum.Enum):
    READY = "ready"
    """Waiting for a consumer with room (in ``_ready``, or for KeyShared in the heap of the
    consumer its key goes to, or in ``_unrouted``)."""
    DELIVERED = "delivered"
    """In a consumer's window (in ``_deadlines``)."""
    WAITING = "waiting"
    """Waiting for its redelivery delay (in ``_waiting``)."""
    DEAD_LETTER = "dead_letter"
    """Queued for, or in, the dead-letter callback."""
    SETTLED = "settled"


@dataclass(slots=True, eq=False)
class _Message:
    entry: Entry
    key: str
    attempt: int = 1
    state: _State = _State.READY
    consumer: ConsumerHandle | None = None
    due: float = 0.0
    """DELIVERED: the ack deadline; WAITING: when to redeliver."""
    reason: str = ""
    """Why the last delivery failed."""
    timed_out_at: ConsumerHandle | None = None
    """WAITING after an ack timeout: the consumer that held it (see ``_release_consumer``)."""
    dispatched: bool = False
    """Given to a consumer at least once."""
    blocked: bool = False


@dataclass(slots=True)
class SubscriptionStats:
    """Counters since the subscription was created."""

    delivered: int = 0
    """Deliveries, redeliveries included."""
    redelivered: int = 0
    acked: int = 0
    nacked: int = 0
    ack_timeouts: int = 0
    dropped: int = 0
    """Entries settled by the Drop poison policy."""
    dead_lettered: int = 0
    """Entries settled by the DeadLetter poison policy."""
    skipped: int = 0
    """Entries no longer retained when the subscription reached them (cursor jumped)."""


class ReliableSubscription:
    """One subscription of a reliable topic: reads the topic from the store, dispatches to its
    consumers, tracks acks and redeliveries (see the module docs for the guarantees).

    ``start_offset`` is the subscription's cursor; ``None`` starts a new subscription at the
    topic's high watermark (only entries appended from now on).
    """

    def __init__(
        self,
        name: str,
        topic: str,
        sub_type: SubscriptionType,
        store: TopicStore,
        start_offset: int | None = None,
        policy: DispatchPolicy | None = None,
        on_cursor: CursorCallback | None = None,
        dead_letter: DeadLetterCallback | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.policy = policy or DispatchPolicy()
        if self.policy.poison is PoisonPolicy.DEAD_LETTER and dead_letter is None:
            raise ConfigError(
                f"subscription {name} on topic {topic}: poison policy dead_letter needs a "
                f"dead_letter callback"
            )
        if start_offset is None:
            info = store.info(topic)
            start_offset = 0 if info is None else info.high_watermark
        self.name = name
        self.topic = topic
        self.sub_type = SubscriptionType(sub_type)
        self.stats = SubscriptionStats()
        self._store = store
        self._on_cursor = on_cursor
        self._clock: Clock = clock or LoopClock()
        self._members = Membership(topic, name, self.sub_type)
        self._key_shared = self.sub_type is SubscriptionType.KEY_SHARED
        self._frames = self.sub_type in (SubscriptionType.EXCLUSIVE, SubscriptionType.FAILOVER)
        # Every unsettled entry read from the topic, in offset order (so the first is the
        # lowest unsettled offset).
        self._unacked: OrderedDict[int, _Message] = OrderedDict()
        # READY offsets, as heaps. Exclusive, Failover, Shared: one heap. KeyShared: one per
        # consumer, holding the entries whose key goes to it (assigned when they become ready,
        # reassigned when the membership changes), and one of entries nobody accepts.
        self._ready: list[int] = []
        self._assigned: dict[int, list[int]] = {}
        self._unrouted: list[int] = []
        # DELIVERED entries by ack deadline: deadlines are delivery time + a constant, so
        # delivery order is deadline order and the first item is the next to expire.
        self._deadlines: OrderedDict[int, _Message] = OrderedDict()
        # WAITING entries as a heap of (due, sequence, message); an entry settled while waiting
        # stays in it until it reaches the top.
        self._waiting: list[tuple[float, int, _Message]] = []
        self._sequence = itertools.count()
        self._blocked: set[int] = set()
        # Runs (Exclusive and Failover only), as heaps of (offset or due, sequence, run), each
        # item stale once the run is no longer live or its offset / state / due changed: every
        # live run by first offset (for the cursor), READY runs by first offset, DELIVERED runs
        # by ack deadline. ``_run_count``: entries in live runs.
        self._runs: list[tuple[int, int, Run]] = []
        self._ready_runs: list[tuple[int, int, Run]] = []
        self._run_deadlines: list[tuple[float, int, Run]] = []
        self._run_count = 0
        # KeyShared: which consumer holds unacknowledged entries of a key, and how many.
        self._key_holders: dict[str, tuple[ConsumerHandle, int]] = {}
        self._dead_letters = (
            None
            if dead_letter is None
            else DeadLetterQueue(
                topic,
                name,
                dead_letter,
                dead_letter_topic=self.policy.dead_letter_topic_for(topic),
                retry_s=self.policy.redelivery_max_s,
                clock=self._clock,
                wanted=self._dead_letter_wanted,
                done=self._dead_lettered,
            )
        )
        self._read_next = start_offset
        self._cursor = start_offset
        # Exclusive and Failover read stored entries while their active consumer takes frames:
        # it gets their bytes and no Entry is built unless something needs one (see wal.stored).
        # A consumer that takes single messages is read plain (what the cache holds as Entry
        # objects is handed on as is): stored bodies would only be cut up and decoded again,
        # one message at a time (see ``_read_loop``, which switches between the two).
        self._stored = False
        self._reader: TopicReader = self._new_reader(start_offset)
        self._reader_done = False
        self._can_read = asyncio.Event()
        self._timer: Timer | None = None
        self._timer_at = 0.0
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"dispatch {topic} {name}"
        )

    def __repr__(self) -> str:
        return (
            f"ReliableSubscription({self.name!r}, topic={self.topic!r}, "
            f"{self.sub_type.name}, cursor={self._cursor})"
        )

    # -- state ------------------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Every offset below this is settled (acked, dropped or dead-lettered)."""
        return self._cursor

    @property
    def consumers(self) -> tuple[ConsumerHandle, ...]:
        """Attached consumers in attach order (for Failover, the first is active)."""
        return self._members.handles

    @property
    def unacked(self) -> int:
        """Entries read from the topic and not yet settled."""
        return len(self._unacked) + self._run_count

    @property
    def blocked(self) -> tuple[int, ...]:
        """Offsets held by the Block poison policy; while any, no new entry is read."""
        return tuple(sorted(self._blocked))

    @property
    def closed(self) -> bool:
        return self._closed

    # -- consumers --------------------------------------------------------------------------

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
        """Attach a consumer and return its handle.

        ``frames`` > 0: the consumer takes :class:`Frame` values of up to that many entries
        (see the module docs) and acks with :meth:`ack_range`; 0: only :class:`Delivery`.

        Attaching an id that is already attached is a takeover: the previous handle closes and
        the entries it held are redelivered (to the new handle for Exclusive and Failover).
        ``key_filters`` only matter for KeyShared. ``receiving=False``: the consumer has not
        opened its stream yet; Shared and KeyShared give it nothing until
        :meth:`ConsumerHandle.open_stream`. Raises :class:`SubscriptionBusyError` (an
        Exclusive subscription held by another name), :class:`SubscriptionTypeMismatchError`
        (``sub_type`` given and different) or :class:`ConsumerClosedError` (closed).
        """
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
            frames=frames if self._frames else 0,
            receiving=receiving,
        )
        for old in self._members.attach(handle):
            self._release_consumer(old, "was taken over by a new attach of the same consumer")
        self._reassign()
        log.debug(
            "consumer attached topic=%s subscription=%s consumer_id=%d name=%s",
            self.topic,
            self.name,
            consumer_id,
            name,
        )
        self._dispatch()
        return handle

    def detach(self, consumer_id: int) -> bool:
        """Detach a consumer; its unacknowledged entries are redelivered at once.

        Returns whether it was attached. Prefer :meth:`ConsumerHandle.close` when a stream ends:
        it cannot detach a newer handle that took the consumer over.
        """
        handle = self._members.get(consumer_id)
        if handle is None:
            return False
        self._detach_handle(handle)
        return True

    def _detach_handle(self, handle: ConsumerHandle) -> None:
        if self._members.remove(handle):
            self._release_consumer(handle, "was detached")
            self._reassign()
            self._dispatch()

    def _receiving(self, handle: ConsumerHandle) -> None:
        if self._members.start_receiving(handle):
            self._reassign()
            self._dispatch()

    def _release_consumer(self, handle: ConsumerHandle, reason: str) -> None:
        handle._shutdown(reason)
        if handle._runs:
            runs = list(handle._runs)
            log.info(
                "redelivering frames of a departed consumer topic=%s subscription=%s "
                "consumer_id=%d count=%d first_offset=%d",
                self.topic,
                self.name,
                handle.consumer_id,
                handle._run_held,
                runs[0].base,
            )
            handle._runs.clear()
            handle._run_held = 0
            for run in runs:
                run.consumer = None
                run.queued = False
                self._make_run_ready(run)
        held = [self._unacked[offset] for offset in sorted(handle._window)]
        for message in held:  # first release every key the consumer held...
            self._undeliver(message)
        # Its entries that timed out and wait for their delay come now, like the ones it held:
        # otherwise a successor gets the later offsets it held before the earlier ones that
        # timed out (found by the clock-jump fault scenario: a consumer that subscribed but
        # never opened its stream, taken over right after its first entries timed out).
        timed_out = [
            message
            for _, _, message in self._waiting
            if message.state is _State.WAITING and message.timed_out_at is handle
        ]
        held.extend(timed_out)
        held.sort(key=lambda message: message.entry.offset)
        for message in held:  # ...then route its entries to the remaining consumers
            message.timed_out_at = None
            self._make_ready(message)
        if held:
            log.info(
                "redelivering entries of a departed consumer topic=%s subscription=%s "
                "consumer_id=%d count=%d timed_out=%d first_offset=%d",
                self.topic,
                self.name,
                handle.consumer_id,
                len(held),
                len(timed_out),
                held[0].entry.offset,
            )

    # -- acks -------------------------------------------------------------------------------

    def ack(self, offset: int) -> bool:
        """Settle ``offset``; return ``False`` (and change nothing) if it is not unsettled or
        the subscription is closed (its successor redelivers the entry)."""
        message = self._unacked.get(offset)
        if message is None or self._closed:
            run = None if self._closed else self._run_at(offset)
            if run is None:
                return False
            if run.consumer is not None:
                run.consumer.progress_at = self._clock.now()
            self._settle_part(run, offset, offset + 1)
            self.stats.acked += 1
            self._advance_cursor()
            self._dispatch()
            return True
        self.stats.acked += 1
        if message.consumer is not None:
            message.consumer.progress_at = self._clock.now()
        self._settle(message)
        self._dispatch()
        return True

    def ack_many(self, offsets: Iterable[int]) -> int:
        """Settle each of ``offsets`` as :meth:`ack` does (unknown or settled ones are ignored);
        returns how many were settled. The same result as acking them one by one, dispatching
        once at the end (a range ack of a batch consumer)."""
        if self._closed:
            return 0
        unacked = self._unacked
        now = self._clock.now()
        settled = 0
        for offset in offsets:
            message = unacked.get(offset)
            if message is None:
                run = self._run_at(offset) if self._run_count else None
                if run is not None:
                    if run.consumer is not None:
                        run.consumer.progress_at = now
                    settled += self._settle_part(run, offset, offset + 1)
                continue
            settled += 1
            if message.consumer is not None:
                message.consumer.progress_at = now
            self._settle(message, advance=False)
        if settled:
            self.stats.acked += settled
            self._advance_cursor()
            self._dispatch()
        return settled

    def ack_range(self, handle: ConsumerHandle, first: int, last: int) -> int:
        """Settle the offsets in ``[first, last]`` that ``handle`` holds (one by one or in
        frames); returns how many. The same result as :meth:`ack_many` of those offsets; a
        cumulative ack (``first`` 0) costs per frame, not per offset."""
        if self._closed:
            return 0
        now = self._clock.now()
        settled = 0
        if handle._window:
            unacked = self._unacked
            for offset in handle.held(first, last):
                message = unacked.get(offset)
                if message is not None:
                    settled += 1
                    self._settle(message, advance=False)
        runs = handle._runs
        end = last + 1
        if runs and first <= runs[0].base:
            while runs and runs[0].end <= end:
                run = runs[0]
                settled += len(run.entries)
                self._settle_run(run)
            if runs and runs[0].base < end:
                settled += self._settle_part(runs[0], first, end)
        elif runs:
            for run in list(runs):
                if run.base >= end:
                    break
                if run.end > first:
                    settled += self._settle_part(run, first, end)
        if settled:
            handle.progress_at = now
            self.stats.acked += settled
            run_deadlines = self._run_deadlines
            while run_deadlines and not run_deadlines[0][2].live:
                heapq.heappop(run_deadlines)  # (settled: keep the heap to what is held)
            self._advance_cursor()
            self._dispatch()
        return settled

    def nack(self, offset: int, delay_ms: int | None = None, reason: str | None = None) -> bool:
        """Fail the current delivery of ``offset``: it is redelivered after
        ``min(redelivery_max, max(nack_base_delay, delay_ms, backoff(attempt)))``, or the
        poison policy applies if that was its last allowed delivery.

        Returns ``False`` (and changes nothing) unless ``offset`` is delivered and unacked.
        """
        message = self._unacked.get(offset)
        if message is None and not self._closed:
            run = self._run_at(offset)
            if run is not None and run.consumer is not None:
                self._explode(run)
                message = self._unacked.get(offset)
        if message is None or message.state is not _State.DELIVERED or self._closed:
            return False
        self.stats.nacked += 1
        requested = max(delay_ms or 0, 0) / 1000
        self._fail(message, reason or "nack", self.policy.nack_delay(message.attempt, requested))
        self._dispatch()
        return True

    # -- lifecycle --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop dispatching: every handle closes, timers and reads stop. Idempotent.

        The cursor is not changed; unsettled entries are redelivered by a subscription started
        again from it.
        """
        if self._closed:
            return
        self._shutdown("was closed with its subscription")
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._dead_letters is not None:
            await self._dead_letters.close()

    def _shutdown(self, reason: str) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for handle in self._members.handles:
            self._members.remove(handle)
            handle._shutdown(reason)
        self._reader.close()

    # -- reading ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        delay = _READ_RETRY_BASE
        try:
            while True:
                await self._can_read.wait()
                if self._stored != self._frames_wanted():
                    self._switch_reader()
                try:
                    batch = await self._reader.next_batch()
                except OffsetOutOfRangeError as exc:
                    self._skip_to(exc.first_offset)
                    continue
                except DanubeIngestError as exc:
                    if not exc.retriable:
                        raise
                    # An object store or etcd that is away for a while (reading below the WAL
                    # floor): keep the subscription, try the same offset again.
                    log.warning(
                        "dispatch read failed, retrying in %.1fs topic=%s subscription=%s "
                        "offset=%d error=%s",
                        delay,
                        self.topic,
                        self.name,
                        self._read_next,
                        exc,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _READ_RETRY_MAX)
                    continue
                delay = _READ_RETRY_BASE
                if not batch:  # the store closed
                    self._reader_done = True
                    self._can_read.clear()
                    return
                # (The active consumer may have changed while the read waited for appends.)
                if self._frames_wanted():
                    self._add_runs(batch)
                else:
                    key_shared = self._key_shared
                    unacked = self._unacked
                    for entry in batch:
                        message = _Message(entry, routing_key_of(entry) if key_shared else "")
                        unacked[entry.offset] = message
                        self._make_ready(message)
                self._read_next = last_offset(batch) + 1
                self._dispatch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception(
                "dispatch stopped topic=%s subscription=%s offset=%d",
                self.topic,
                self.name,
                self._read_next,
            )
            self._shutdown(f"was closed: reading the topic failed ({exc})")

    def _skip_to(self, first_offset: int) -> None:
        log.warning(
            "subscription below the retained floor, moved to it topic=%s subscription=%s "
            "cursor=%d floor=%d skipped=%d",
            self.topic,
            self.name,
            self._read_next,
            first_offset,
            first_offset - self._read_next,
        )
        self.stats.skipped += first_offset - self._read_next
        self._reader.close()
        self._reader = self._new_reader(first_offset)
        self._read_next = first_offset
        self._advance_cursor()

    def _new_reader(self, offset: int) -> TopicReader:
        """A reader of the topic from ``offset``, of the kind ``_stored`` says."""
        return self._store.create_reader(
            self.topic, offset, max_batch=self.policy.read_batch, stored=self._stored
        )

    def _frames_wanted(self) -> bool:
        """Whether what is read next should be read as stored entries, tracked as runs: the
        consumer that receives it takes frames."""
        if not self._frames:
            return False
        active = self._members.active()
        return active is not None and active.frames > 0

    def _switch_reader(self) -> None:
        """Go on reading from where the reader is, with the other kind of reader (stored or
        plain). Called between reads only, so that no entry is read twice or skipped; what was
        read before keeps the form it is tracked in (runs or per-message state), which either
        kind of consumer is given correctly."""
        position = self._reader.position
        self._reader.close()
        self._stored = not self._stored
        self._reader = self._new_reader(position)
        log.debug(
            "dispatch reader switched topic=%s subscription=%s offset=%d stored=%s",
            self.topic,
            self.name,
            position,
            self._stored,
        )

    # -- dispatching ------------------------------------------------------------------------

    def _add_runs(self, batch: Sequence[Entry]) -> None:
        """Track a read batch as runs: one, unless offsets jump inside it."""
        base = first_offset(batch)
        pieces: Sequence[Sequence[Entry]]
        if last_offset(batch) - base + 1 == len(batch):
            pieces = [batch]
        elif isinstance(batch, StoredEntries):
            pieces = batch.pieces()
        else:
            lists: list[list[Entry]] = [[batch[0]]]
            for entry in batch[1:]:
                if entry.offset != lists[-1][-1].offset + 1:
                    lists.append([])
                lists[-1].append(entry)
            pieces = lists
        for entries in pieces:
            run = Run(first_offset(entries), entries)
            self._run_count += len(entries)
            heapq.heappush(self._runs, (run.base, next(self._sequence), run))
            self._make_run_ready(run)

    def _make_run_ready(self, run: Run) -> None:
        heapq.heappush(self._ready_runs, (run.base, next(self._sequence), run))

    def _run_at(self, offset: int) -> Run | None:
        """The live run holding ``offset`` (a scan: only for what arrives one by one)."""
        for base, _, run in self._runs:
            if run.live and run.base == base and base <= offset < run.end:
                return run
        return None

    def _has_room(self, handle: ConsumerHandle) -> bool:
        return len(handle._window) + handle._run_held < self.policy.max_unacked

    def _key_target(self, key: str) -> ConsumerHandle | None:
        """KeyShared: the consumer holding unacked entries of ``key``, else its ring owner."""
        holder = self._key_holders.get(key)
        return holder[0] if holder is not None else self._members.key_owner(key)

    def _dispatch(self) -> None:
        """Give READY entries, lowest offset first, to consumers with room."""
        if self._closed:
            return
        if self._key_shared:
            self._dispatch_by_key()
        elif (self._ready or self._ready_runs) and self._members.receiver_count():
            self._dispatch_in_order()
        self._update_can_read()

    def _dispatch_in_order(self) -> None:
        ready = self._ready
        runs = self._ready_runs
        members = self._members
        shared = self.sub_type is SubscriptionType.SHARED
        now = self._clock.now()  # (one reading per pass: deliveries of a pass share it)
        while True:
            while runs:
                base, _, run = runs[0]
                if run.live and run.consumer is None and run.base == base:
                    break
                heapq.heappop(runs)  # settled, split or delivered since
            if runs and (not ready or runs[0][0] < ready[0]):
                if self._blocked and not run.dispatched:
                    break  # Block policy: nothing new goes out (see below)
                target = members.active()  # (runs: Exclusive and Failover only)
                if target is None or not self._has_room(target):
                    break
                heapq.heappop(runs)
                if not target.frames:
                    # A consumer that takes single messages: the run's first entry goes to it
                    # (its entries are now the lowest ready ones), the rest one by one.
                    self._explode(run)
                    self._deliver(self._unacked[heapq.heappop(ready)], target, now)
                    continue
                self._deliver_run(run, target, now)
                continue
            if not ready:
                break
            offset = ready[0]
            message = self._unacked.get(offset)
            if message is None or message.state is not _State.READY:
                heapq.heappop(ready)  # settled while ready
                continue
            if self._blocked and not message.dispatched:
                # Block policy: nothing new goes out. Entries go out in offset order here, so
                # every entry after this one is new too.
                break
            if shared:
                target = members.round_robin(self._has_room)
            else:
                target = members.active()
                if target is not None and not self._has_room(target):
                    target = None
            if target is None:
                break  # no consumer has room
            heapq.heappop(ready)
            self._deliver(message, target, now)

    def _dispatch_by_key(self) -> None:
        now = self._clock.now()
        for handle in self._members.handles:
            heap = self._assigned.get(handle.consumer_id)
            if not heap:
                continue
            held_back: list[int] = []
            while heap and self._has_room(handle):
                offset = heapq.heappop(heap)
                message = self._unacked.get(offset)
                if message is None or message.state is not _State.READY:
                    continue  # settled while ready
                if self._blocked and not message.dispatched:
                    held_back.append(offset)  # Block policy: nothing new goes out
                    continue
                self._deliver(message, handle, now)
            for offset in held_back:
                heapq.heappush(heap, offset)

    def _reassign(self) -> None:
        """KeyShared: route every READY entry again after a membership change."""
        if not self._key_shared:
            return
        pending = [offset for heap in self._assigned.values() for offset in heap]
        pending.extend(self._unrouted)
        self._assigned = {}
        self._unrouted = []
        for offset in sorted(pending):
            message = self._unacked.get(offset)
            if message is not None and message.state is _State.READY:
                self._make_ready(message)

    def _update_can_read(self) -> None:
        members = self._members
        if (
            not self._closed
            and not self._reader_done
            and not self._blocked
            and len(self._unacked) + self._run_count
            < self.policy.max_unacked * members.receiver_count()
            and any(map(self._has_room, members.receivers()))
        ):
            self._can_read.set()
        else:
            self._can_read.clear()

    def _deliver(self, message: _Message, handle: ConsumerHandle, now: float) -> None:
        offset = message.entry.offset
        message.state = _State.DELIVERED
        message.consumer = handle
        message.dispatched = True
        message.due = now + self.policy.ack_timeout_s
        self._deadlines[offset] = message
        if not handle._window:
            handle.progress_at = now
        handle._window.add(offset)
        if self._key_shared:
            holder = self._key_holders.get(message.key)
            self._key_holders[message.key] = (handle, 1 if holder is None else holder[1] + 1)
        self.stats.delivered += 1
        if message.attempt > 1:
            self.stats.redelivered += 1
        handle._push(Delivery(message.entry, message.attempt))
        if len(self._deadlines) == 1:
            self._arm()

    def _deliver_run(self, run: Run, handle: ConsumerHandle, now: float) -> None:
        """Give READY ``run`` (just taken off ``_ready_runs``) to ``handle``: all of it, or the
        part that fits its frame size and window (the rest stays READY)."""
        n = min(
            len(run.entries),
            handle.frames,
            self.policy.max_unacked - len(handle._window) - handle._run_held,
        )
        if n < len(run.entries):
            piece = Run(run.base, run.entries[:n], dispatched=run.dispatched)
            run.entries = run.entries[n:]
            run.base += n
            sequence = self._sequence
            heapq.heappush(self._runs, (piece.base, next(sequence), piece))
            heapq.heappush(self._runs, (run.base, next(sequence), run))
            self._make_run_ready(run)
            run = piece
        run.consumer = handle
        run.dispatched = True
        due = run.due = now + self.policy.ack_timeout_s
        heapq.heappush(self._run_deadlines, (due, next(self._sequence), run))
        if not handle._window and not handle._run_held:
            handle.progress_at = now
        held = handle._runs
        if held and held[-1].base > run.base:  # a run given back by a departed consumer
            held.append(run)
            handle._runs = deque(sorted(held, key=lambda r: r.base))
        else:
            held.append(run)
        handle._run_held += n
        self.stats.delivered += n
        handle._push_run(run)
        if self._timer is None or self._timer_at > due:
            self._arm()

    def _undeliver_run(self, run: Run) -> None:
        """Take a DELIVERED run back from its consumer."""
        handle = run.consumer
        assert handle is not None
        runs = handle._runs
        if runs[0] is run:
            runs.popleft()
        else:
            runs.remove(run)
        handle._run_held -= len(run.entries)
        if run.queued:
            del handle._queue[run]
            run.queued = False
        run.consumer = None

    def _settle_run(self, run: Run) -> None:
        if run.consumer is not None:
            self._undeliver_run(run)
        self._retire(run)

    def _retire(self, run: Run) -> None:
        """``run`` is no longer tracked. Stale heap items may still name it until they reach
        their heap's top: they must not keep its entries alive (up to an ack timeout's worth
        of messages)."""
        run.live = False
        self._run_count -= len(run.entries)
        run.entries = ()

    def _settle_part(self, run: Run, first: int, end: int) -> int:
        """Settle offsets ``[first, end)`` of ``run`` (what of them it holds); return how many.
        The run keeps what is left: shortened, or split in two around the settled part."""
        base, run_end = run.base, run.end
        lo, hi = max(first, base), min(end, run_end)
        if lo >= hi:
            return 0
        n = hi - lo
        if lo == base and hi == run_end:
            self._settle_run(run)
            return n
        entries = run.entries
        sequence = self._sequence
        handle = run.consumer
        if lo == base:
            run.entries = entries[n:]
            run.base = hi
            heapq.heappush(self._runs, (hi, next(sequence), run))
            if handle is None:
                self._make_run_ready(run)
        elif hi == run_end:
            run.entries = entries[: lo - base]
        else:
            tail = Run(
                hi, entries[hi - base :], consumer=handle, due=run.due, dispatched=run.dispatched
            )
            run.entries = entries[: lo - base]
            heapq.heappush(self._runs, (hi, next(sequence), tail))
            if handle is None:
                self._make_run_ready(tail)
            else:
                handle._runs.insert(handle._runs.index(run) + 1, tail)
                heapq.heappush(self._run_deadlines, (tail.due, next(sequence), tail))
                if run.queued:
                    items = list(handle._queue.items())
                    at = next(i for i, (key, _) in enumerate(items) if key is run) + 1
                    items.insert(at, (tail, tail))
                    tail.queued = True
                    handle._queue.clear()
                    handle._queue.update(items)
        if handle is not None:
            handle._run_held -= n
        self._run_count -= n
        return n

    def _explode(self, run: Run) -> None:
        """Turn ``run`` into per-message state, each entry in the state the run was in (READY:
        ready again; DELIVERED: in the same consumer's window and queue, same deadline)."""
        handle = run.consumer
        queue_keys = list(handle._queue) if handle is not None and run.queued else None
        if handle is not None:
            self._undeliver_run(run)
        messages = [_Message(entry, "") for entry in run.entries]
        self._retire(run)
        unacked = self._unacked
        in_order = not unacked or next(reversed(unacked)) < run.base
        for message in messages:
            unacked[message.entry.offset] = message
        if not in_order:
            _sort_in_place(unacked, lambda item: item[0])
        if handle is None:
            for message in messages:
                message.dispatched = run.dispatched
                self._make_ready(message)
            return
        deadlines = self._deadlines
        in_order = not deadlines or next(reversed(deadlines.values())).due <= run.due
        for message in messages:
            offset = message.entry.offset
            message.state = _State.DELIVERED
            message.consumer = handle
            message.dispatched = True
            message.due = run.due
            deadlines[offset] = message
            handle._window.add(offset)
        if not in_order:
            _sort_in_place(deadlines, lambda item: item[1].due)
        if queue_keys is not None:
            # Its entries take the run's place in the consumer's queue (dispatch order).
            queue = handle._queue
            items = list(queue.items())
            at = queue_keys.index(run)
            items[at:at] = [(m.entry.offset, Delivery(m.entry, m.attempt)) for m in messages]
            queue.clear()
            queue.update(items)
            handle._wake()
        if self._timer is None or self._timer_at > run.due:
            self._arm()

    def _undeliver(self, message: _Message) -> None:
        """Take a DELIVERED entry back from its consumer."""
        handle = message.consumer
        assert handle is not None
        offset = message.entry.offset
        handle._window.discard(offset)
        handle._withdraw(offset)
        del self._deadlines[offset]
        message.consumer = None
        if self._key_shared:
            holder_handle, count = self._key_holders[message.key]
            if count > 1:
                self._key_holders[message.key] = (holder_handle, count - 1)
            else:
                del self._key_holders[message.key]

    def _make_ready(self, message: _Message) -> None:
        message.state = _State.READY
        offset = message.entry.offset
        if not self._key_shared:
            heapq.heappush(self._ready, offset)
            return
        target = self._key_target(message.key)
        if target is None:
            heapq.heappush(self._unrouted, offset)
        else:
            heapq.heappush(self._assigned.setdefault(target.consumer_id, []), offset)

    # -- settling and failing ---------------------------------------------------------------

    def _settle(self, message: _Message, advance: bool = True) -> None:
        if message.consumer is not None:
            self._undeliver(message)
        message.state = _State.SETTLED
        offset = message.entry.offset
        del self._unacked[offset]
        self._blocked.discard(offset)
        if advance:
            self._advance_cursor()

    def _advance_cursor(self) -> None:
        cursor = next(iter(self._unacked)) if self._unacked else self._read_next
        runs = self._runs
        while runs:
            base, _, run = runs[0]
            if run.live and run.base == base:
                cursor = min(cursor, base)
                break
            heapq.heappop(runs)
        if cursor > self._cursor:
            self._cursor = cursor
            if self._on_cursor is not None:
                try:
                    self._on_cursor(cursor)
                except Exception:
                    log.exception(
                        "cursor callback failed topic=%s subscription=%s cursor=%d",
                        self.topic,
                        self.name,
                        cursor,
                    )

    def _fail(self, message: _Message, reason: str, delay: float) -> None:
        """The current delivery of a DELIVERED entry failed: redeliver it or apply the poison
        policy."""
        timed_out_at = message.consumer if reason == _ACK_TIMEOUT else None
        self._undeliver(message)
        message.reason = reason
        offset = message.entry.offset
        if message.attempt > self.policy.max_redeliveries:
            poison = self.policy.poison
            if poison is PoisonPolicy.DROP:
                log.warning(
                    "dropping poison message topic=%s subscription=%s offset=%d attempt=%d "
                    "reason=%s",
                    self.topic,
                    self.name,
                    offset,
                    message.attempt,
                    reason,
                )
                self.stats.dropped += 1
                self._settle(message)
                return
            if poison is PoisonPolicy.DEAD_LETTER:
                assert self._dead_letters is not None
                message.state = _State.DEAD_LETTER
                self._dead_letters.put(message.entry, message.attempt, reason)
                return
            if not message.blocked:
                log.warning(
                    "poison message blocks the subscription topic=%s subscription=%s "
                    "offset=%d attempt=%d reason=%s",
                    self.topic,
                    self.name,
                    offset,
                    message.attempt,
                    reason,
                )
                message.blocked = True
                self._blocked.add(offset)
            delay = self.policy.redelivery_max_s
        message.attempt += 1
        if delay <= 0:
            self._make_ready(message)
            return
        message.state = _State.WAITING
        message.timed_out_at = timed_out_at
        message.due = self._clock.now() + delay
        heapq.heappush(self._waiting, (message.due, next(self._sequence), message))
        self._arm()

    def _dead_letter_wanted(self, offset: int) -> bool:
        message = self._unacked.get(offset)
        return message is not None and message.state is _State.DEAD_LETTER

    def _dead_lettered(self, offset: int) -> None:
        message = self._unacked.get(offset)
        if message is not None and message.state is _State.DEAD_LETTER:
            self.stats.dead_lettered += 1
            self._settle(message)
            self._dispatch()

    # -- timers -----------------------------------------------------------------------------

    def _next_due(self) -> float | None:
        due = next(iter(self._deadlines.values())).due if self._deadlines else None
        run_deadlines = self._run_deadlines
        while run_deadlines:
            at, _, run = run_deadlines[0]
            if run.live and run.consumer is not None and run.due == at:
                due = at if due is None else min(due, at)
                break
            heapq.heappop(run_deadlines)  # settled or given back since
        waiting = self._waiting
        while waiting:
            at, _, message = waiting[0]
            if message.state is _State.WAITING and message.due == at:
                return at if due is None else min(due, at)
            heapq.heappop(waiting)  # settled while waiting
        return due

    def _arm(self) -> None:
        """Make sure a timer fires by the next ack deadline or redelivery due time."""
        if self._closed:
            return
        when = self._next_due()
        if when is None or (self._timer is not None and self._timer_at <= when):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._clock.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed:
            return
        now = self._clock.now()
        run_deadlines = self._run_deadlines
        while run_deadlines and run_deadlines[0][0] <= now:
            at, _, run = heapq.heappop(run_deadlines)
            if run.live and run.consumer is not None and run.due == at:
                self._explode(run)  # its entries time out one by one below
        deadlines = self._deadlines
        while deadlines:
            message = next(iter(deadlines.values()))
            if message.due > now:
                break
            self.stats.ack_timeouts += 1
            self._fail(message, _ACK_TIMEOUT, self.policy.backoff(message.attempt))
        waiting = self._waiting
        while waiting and waiting[0][0] <= now:
            at, _, message = heapq.heappop(waiting)
            if message.state is _State.WAITING and message.due == at:
                message.timed_out_at = None  # (no handle kept alive by what waited)
                self._make_ready(message)
        self._dispatch()
        self._arm()


def _sort_in_place(
    items: OrderedDict[int, _Message], key: Callable[[tuple[int, _Message]], object]
) -> None:
    ordered = sorted(items.items(), key=key)  # type: ignore[arg-type]
    items.clear()
    items.update(ordered)
