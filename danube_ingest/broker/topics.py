"""TopicManager: the broker's topics, producers, subscriptions and consumers.

Guarantees:

* A reliable publish is answered only after its entry is durable in the WAL.
* Producer and consumer ids are random 63-bit numbers allocated cluster-wide and persisted in
  etcd (``clients/{id}``) with the principal that created them: a restarted broker, or the
  broker that took a topic over, serves the ids issued before, so danube-client recovers by
  itself. The same producer name on a topic gets the same id; the same (topic, subscription,
  consumer name) gets the same consumer id, for the principal that created it; another
  principal reusing the name is refused (``PermissionDeniedError``), so it cannot take an
  Exclusive subscription over or publish as that producer.
* An Ack or Nack (danube-client path) settles an offset only if it comes from the consumer the
  offset is dispatched to: the connection (gRPC peer) of that consumer's open stream, and its
  principal. One dispatched to another consumer is refused (``PermissionDeniedError``) and stays
  in flight; one held by no consumer (not yet dispatched, or redelivery pending) is ignored.
* A topic is served only while this broker owns it (lease + epoch in etcd). A new owner
  continues the topic's offsets after every offset the previous owner may have assigned, and
  stamps no ingest time below the topic's stored clock (``metadata.clock``). With an object
  store, a new owner serves nothing of a topic whose previous owner may hold unuploaded
  acknowledged entries until that tail is recovered or declared lost (``broker.takeover``).
* Consumer streams outlive a lost ownership (an etcd outage longer than the lease): a
  ``ReceiveMessages`` stream stays open, sending nothing, while the topic is not served here,
  and health checks answer OK meanwhile (a CLOSE would make danube-client re-subscribe, which
  fails while etcd is away, and then stop receiving for good). Once the broker session is back
  the topic is acquired again (a new epoch) and dispatch resumes on the same streams from the
  persisted cursor (unacknowledged messages are delivered again). If another broker owns the
  topic by then, the streams end with UNAVAILABLE and health checks answer CLOSE, so clients
  look the topic up again.
* Subscription cursors are written to etcd by the ProgressUpdater (debounced, fenced by the
  owner epoch, flushed on shutdown and before a topic is given up).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from danube_ingest.broker.convert import entry_from_message
from danube_ingest.broker.errors import (
    InvalidRequestError,
    LimitExceededError,
    NotOwnerError,
    StrategyMismatchError,
    SubscriptionInUseError,
    SubscriptionNotFoundError,
    TopicNotFoundError,
    UnknownClientError,
)
from danube_ingest.broker.names import parse_topic, partition_base
from danube_ingest.broker.producer_handover import adopt_handed_producers, handed_table
from danube_ingest.broker.start import LATEST, StartPosition
from danube_ingest.broker.takeover import TakeoverGate
from danube_ingest.broker.validation import check_key_filters, check_message, check_name
from danube_ingest.config import LimitsConfig
from danube_ingest.dispatch import (
    ConsumerClosedError,
    ConsumerHandle,
    Delivery,
    DispatchPolicy,
    Frame,
    NonReliableTopic,
    ReliableSubscription,
    Subscription,
    SubscriptionType,
)
from danube_ingest.errors import DanubeIngestError, OffsetOutOfRangeError
from danube_ingest.metadata.clock import read_clock
from danube_ingest.metadata.errors import LeaseExpiredError, MetadataError, TopicDeletedError
from danube_ingest.metadata.handover import LOST
from danube_ingest.metadata.jumps import record_jump
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.offsets import OffsetReservation
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.metadata.progress import ProgressUpdater
from danube_ingest.metadata.records import (
    ClientRecord,
    Records,
    SubscriptionRecord,
    TopicRecord,
    encode_cursor,
)
from danube_ingest.schema.errors import SchemaNotFoundError
from danube_ingest.schema.model import TopicSchemaConfig, ValidationPolicy
from danube_ingest.schema.registry import SchemaRegistry
from danube_ingest.security.binding import check_owner
from danube_ingest.security.errors import PermissionDeniedError
from danube_ingest.store import TopicStore
from danube_ingest.wal.block import EntryBlock
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.log import StagedBlock

log = logging.getLogger(__name__)

#: A producer that neither published nor health-checked (every 5 s) for this long no longer
#: counts against ``limits.max_producers_per_topic``.
PRODUCER_IDLE_SECONDS = 30.0
#: Seconds a topic's schema configuration is cached before it is re-read.
SCHEMA_CONFIG_TTL = 1.0
#: A consumer with an open stream that holds unacknowledged messages but has neither acked one
#: nor health-checked for this long is gone (danube-client's ``Consumer.close()`` stops its
#: health checks but leaves the stream open when its receive loop was waiting for room in the
#: application's queue): it is detached and its messages go to the other consumers. Two of
#: danube-client's 5 s health-check intervals, so a live client is never taken for gone.
CONSUMER_STALL_SECONDS = 10.0
#: While a lost topic waits to be served again: how often to look whether the broker session is
#: back (no I/O), and the backoff between acquisition attempts once it is (etcd answering
#: slowly or not yet at all). Small, because every consumer of the topic waits for this.
_RECOVER_POLL_SECONDS = 0.05
_RECOVER_RETRY_MAX_SECONDS = 1.0
#: Idempotent producer ids whose principal is kept in memory (each client's producer makes a
#: new one; past this many the cache starts over and re-reads them from etcd).
_PRODUCER_OWNERS_CACHED = 100_000
#: After handing a topic over (unload), this broker redirects clients of the topic to another
#: live broker for this long instead of taking it back (the unload request's lease, too).
UNLOAD_HOLD_SECONDS = 30.0
#: An unload waits this long for the uploader to commit the topic's WAL tail; if it cannot,
#: the unload is given up and the topic stays here (handing it over would leave a gap).
UNLOAD_UPLOAD_TIMEOUT = 60.0
#: A clean shutdown waits at most this long (by default; storage.uploader.shutdown_upload_seconds)
#: for the uploader to commit the WAL tails of the topics served here (so their next owners
#: need not wait for this broker's restart); well within the 30 s a supervisor typically allows
#: between SIGTERM and SIGKILL.
SHUTDOWN_UPLOAD_TIMEOUT = 10.0


@dataclass
class TopicRuntime:
    """A topic this broker owns and serves."""

    name: str
    record: TopicRecord
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    fanout: NonReliableTopic | None = None
    producers: dict[int, float] = field(default_factory=dict)
    """Producer id -> when it last created, published or health-checked (monotonic)."""
    closed: bool = False
    schema_config: TopicSchemaConfig | None = None
    schema_checked: float = float("-inf")
    creating: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while a subscription is created, so concurrent subscribes create it once."""

    @property
    def reliable(self) -> bool:
        return self.record.reliable

    def active_producers(self) -> int:
        """Producers seen within PRODUCER_IDLE_SECONDS (Danube has no close-producer call:
        a producer that went away just stops health-checking and publishing)."""
        horizon = time.monotonic() - PRODUCER_IDLE_SECONDS
        return sum(1 for seen in self.producers.values() if seen >= horizon)


class TopicManager:
    """Everything a Danube client does, minus the wire format (see ``broker.services``)."""

    def __init__(
        self,
        *,
        broker_id: str,
        broker_url: str,
        store: TopicStore,
        records: Records,
        keys: Keys,
        ownership: Ownership,
        reservations: OffsetReservation,
        progress: ProgressUpdater,
        schemas: SchemaRegistry,
        limits: LimitsConfig,
        policy: DispatchPolicy,
        consumer_idle_seconds: float = 30.0,
        manifest: Manifest | None = None,
        hand_over_on_close: bool = False,
        shutdown_upload_seconds: float = SHUTDOWN_UPLOAD_TIMEOUT,
    ) -> None:
        """``hand_over_on_close``: an uploader runs (``close`` then commits every topic's WAL
        tail and hands its exact end over, waiting at most ``shutdown_upload_seconds``, see
        ``_hand_over_all``)."""
        self.broker_id = broker_id
        self._hand_over_on_close = hand_over_on_close
        self._shutdown_upload_seconds = shutdown_upload_seconds
        self._manifest = manifest
        self.broker_url = broker_url
        self._store = store
        self._records = records
        self._keys = keys
        self._ownership = ownership
        self._reservations = reservations
        self._takeover = TakeoverGate(ownership, reservations)
        self._progress = progress
        self._schemas = schemas
        self._limits = limits
        self._policy = policy
        self._topics: dict[str, TopicRuntime] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self._producers: dict[int, ClientRecord] = {}
        self._consumers: dict[int, ClientRecord] = {}
        self._handles: dict[int, ConsumerHandle] = {}
        self._streaming: set[int] = set()
        #: consumer id -> the gRPC peer of its open stream (whose acks it may send)
        self._peers: dict[int, str] = {}
        #: idempotent batch producer id -> the principal it is bound to (auth on; from etcd)
        self._producer_owners: dict[int, str] = {}
        #: consumer id -> when it last subscribed or health-checked (monotonic)
        self._seen: dict[int, float] = {}
        self._consumer_idle = consumer_idle_seconds
        self._sweeper: asyncio.Task[None] | None = None
        #: topic -> the task acquiring and loading it again after its ownership was lost
        self._recovering: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        #: streams are ending for good (shutdown): they no longer wait for a lost topic
        self._ending = False
        self._background: set[asyncio.Task[Any]] = set()
        #: topic -> until when (monotonic) clients are sent elsewhere after an unload
        self._handed: dict[str, float] = {}
        ownership.on_lost(self._on_ownership_lost)
        ownership.on_unload(self._on_unload_requested)

    # -- topics ----------------------------------------------------------------------------

    @property
    def limits(self) -> LimitsConfig:
        """The limits every publish path applies."""
        return self._limits

    async def lookup(self, topic: str) -> tuple[bool, str]:
        """(this broker serves it, URL of the broker that does). Raises TopicNotFoundError."""
        parse_topic(topic)
        if topic in self._topics and self._ownership.is_owner(topic):
            # (A topic whose lease ran out is not ours even before its loss is processed.)
            return True, self.broker_url
        record = await self._records.get_topic(topic)
        if record is None:
            raise TopicNotFoundError(f"topic {topic} does not exist")
        elsewhere = await self._handed_over(topic)
        if elsewhere is not None:
            return False, elsewhere
        try:
            owner = await self._ownership.acquire(topic, require_record=True)
        except TopicDeletedError as exc:
            raise TopicNotFoundError(f"topic {topic} does not exist") from exc
        except LeaseExpiredError:
            # Our session is being renewed: we cannot own anything, but can name the owner.
            current = await self._ownership.owner_of(topic)
            if current is None or current.broker_id == self.broker_id:
                raise
            owner = current
        if owner.broker_id != self.broker_id:
            return False, owner.url
        await self._load(topic)
        return True, self.broker_url

    async def partitions(self, topic: str) -> list[str]:
        """``[topic]`` when it exists as such, else its ``-part-N`` partitions in order."""
        parse_topic(topic)
        if topic in self._topics or await self._records.get_topic(topic) is not None:
            return [topic]
        found: list[tuple[int, str]] = []
        ns, _ = parse_topic(topic)
        for record in await self._records.list_topics(ns):
            base = partition_base(record.name)
            if base is not None and base[0] == topic:
                found.append((base[1], record.name))
        # A topic that does not exist at all is returned as is: Subscribe then answers
        # NOT_FOUND, a clearer error than an empty partition list.
        return [name for _, name in sorted(found)] or [topic]

    async def _load(self, topic: str, create_reliable: bool | None = None) -> TopicRuntime:
        """The runtime of a topic this broker owns, acquiring ownership and loading it first.

        ``create_reliable`` creates a missing topic with that dispatch strategy (producers
        auto-create); None raises TopicNotFoundError for a missing topic.
        """
        runtime = self._topics.get(topic)
        if runtime is not None:
            return runtime
        lock = self._loading.setdefault(topic, asyncio.Lock())
        async with lock:
            runtime = self._topics.get(topic)
            if runtime is not None:
                return runtime
            record = await self._records.get_topic(topic)
            if record is None:
                if create_reliable is None:
                    raise TopicNotFoundError(f"topic {topic} does not exist")
                record, created = await self._records.create_topic_if_absent(
                    TopicRecord(name=topic, reliable=create_reliable, created_ms=_now_ms())
                )
                if created and await self._store.drop_topic(topic):
                    # What this WAL holds of the name belongs to a deleted incarnation (deleted
                    # while this broker was away): the new topic starts clean.
                    log.warning("stale wal data of a deleted topic dropped topic=%s", topic)
            elsewhere = await self._handed_over(topic)
            if elsewhere is not None:
                raise NotOwnerError(topic, elsewhere)
            try:
                owner = await self._ownership.acquire(topic, require_record=True)
            except TopicDeletedError as exc:
                raise TopicNotFoundError(f"topic {topic} does not exist") from exc
            if owner.broker_id != self.broker_id:
                raise NotOwnerError(topic, owner.url)
            runtime = TopicRuntime(topic, record)
            if record.reliable:
                await self._check_incarnation(topic)
                local = self._store.info(topic)
                known = local.next_offset if local is not None else 0
                start = await self._reservations.start_offset(
                    topic, local.next_offset if local is not None else None
                )
                floor = 0
                resolved = None
                if self._manifest is not None:
                    manifest_end = await self._manifest.end_offset(topic)
                    # Raises (UNAVAILABLE) while the previous owner's tail is awaited.
                    resolved = await self._takeover.check(topic, manifest_end)
                    if resolved is not None and resolved.end is not None:
                        start = resolved.end
                    # What earlier owners uploaded: never reassign those offsets (defence in
                    # depth; the reservation already lies beyond them).
                    known = max(known, manifest_end)
                    start = max(start, known)
                    # Never stamp a time below what the topic's clock (maybe an earlier
                    # owner's, with a clock ahead of ours) says of every later entry.
                    clock = await read_clock(self._ownership.kv, self._keys, topic)
                    floor = 0 if clock is None else clock.ingest_ms
                if resolved is None or resolved.state != LOST:
                    # Offsets skipped past what is known to exist: recorded before any is
                    # assigned (a range declared lost was recorded with its resolution).
                    await record_jump(self._ownership, topic, known, start)
                await self._store.ensure_topic(topic, min_next_offset=start, min_ingest_ms=floor)
                if self._manifest is not None:
                    await adopt_handed_producers(
                        self._store,
                        self._ownership,
                        topic,
                        start,
                        local.next_offset if local is not None else None,
                    )
                if resolved is not None:
                    await self._reservations.adopt(topic, start)
            else:
                runtime.fanout = NonReliableTopic(topic)
            self._topics[topic] = runtime
            log.info(
                "topic loaded topic=%s reliable=%s epoch=%s", topic, record.reliable, owner.epoch
            )
            return runtime

    async def _check_incarnation(self, topic: str) -> None:
        """Drop what the WAL holds of an earlier incarnation of ``topic`` (deleted while this
        broker was away, then created again anywhere), and record the current one, before the
        topic is served here."""
        incarnation = await self._records.topic_incarnation(topic)
        if incarnation is None:
            raise TopicNotFoundError(f"topic {topic} does not exist")
        known = self._store.incarnation(topic)
        if known is not None and known != incarnation and await self._store.drop_topic(topic):
            log.warning(
                "stale wal data of a deleted topic dropped topic=%s incarnation=%d was=%d",
                topic,
                incarnation,
                known,
            )
        await self._store.set_incarnation(topic, incarnation)

    def _on_ownership_lost(self, topic: str) -> None:
        runtime = self._topics.pop(topic, None)
        if runtime is None:
            return
        log.warning("topic ownership lost topic=%s", topic)
        task = asyncio.get_running_loop().create_task(self._unload(runtime))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unload(self, runtime: TopicRuntime) -> None:
        """Stop serving a topic: close its subscriptions (their consumer handles close; the
        streams reading them wait for the topic to be served again, see ``receive``).

        A topic lost because it was deleted (its record is gone) is also dropped from the WAL
        (``TopicStore.drop_topic``) and its client registrations forgotten: its streams and
        producers then get NOT_FOUND, and a topic created again under the name starts clean.
        """
        runtime.closed = True
        for subscription in runtime.subscriptions.values():
            await subscription.close()
        if runtime.fanout is not None:
            await runtime.fanout.close()
        if self._closed:
            return
        try:
            deleted = await self._records.get_topic(runtime.name) is None
        except DanubeIngestError as exc:
            log.warning("topic deletion check failed topic=%s error=%s", runtime.name, exc)
            return
        if deleted and runtime.name not in self._topics:
            await self._forget_deleted(runtime.name)

    async def _forget_deleted(self, topic: str) -> None:
        """Drop a deleted topic's WAL data and cached client registrations (see ``_unload``)."""
        for known in (self._producers, self._consumers):
            for cid in [cid for cid, rec in known.items() if rec.topic == topic]:
                del known[cid]
        dropped = await self._store.drop_topic(topic)
        log.info("topic deleted: fenced and dropped topic=%s wal_dropped=%s", topic, dropped)

    # -- unload ----------------------------------------------------------------------------

    def _on_unload_requested(self, topic: str) -> None:
        task = asyncio.get_running_loop().create_task(self.unload(topic))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def unload(self, topic: str) -> bool:
        """Hand ``topic`` over to another broker (``topics unload``); returns whether it was.

        Producers and consumers are told to look the topic up again (``UNAVAILABLE``; consumer
        health checks answer ``CLOSE``) and are redirected to another live broker. Before the
        ownership is released, the cursors are flushed and (``wal_cloud``) the topic's WAL tail
        is sealed, uploaded and committed, so the next owner serves every acknowledged offset
        and continues after them. If the upload does not finish within
        UNLOAD_UPLOAD_TIMEOUT the unload is given up and the topic is served here again.
        """
        runtime = self._topics.pop(topic, None)
        if runtime is None:
            return False
        self._handed[topic] = time.monotonic() + UNLOAD_HOLD_SECONDS
        started = time.monotonic()
        await self._unload(runtime)
        await self._progress.flush()
        end = None
        if runtime.reliable and self._store.cloud is not None:
            # Until no append slipped in after the last seal or during the hand-over (one
            # already past the runtime check when the topic was popped).
            while end != self._store.next_offset(topic):
                end = self._store.seal(topic)
                while not self._store.uploaded_below(topic, end):
                    if time.monotonic() - started > UNLOAD_UPLOAD_TIMEOUT:
                        self._handed.pop(topic, None)
                        log.error(
                            "topic unload given up: its WAL tail was not uploaded in %.0f s "
                            "topic=%s end=%d (served here again)",
                            UNLOAD_UPLOAD_TIMEOUT,
                            topic,
                            end,
                        )
                        return False
                    await asyncio.sleep(_RECOVER_POLL_SECONDS)
                # The next owner continues right after the last offset assigned here.
                await self._reservations.hand_over(
                    topic, end, handed_table(self._store, self._ownership, topic, end)
                )
        await self._ownership.release(topic)
        log.info(
            "topic unloaded topic=%s committed_below=%s took_s=%.2f",
            topic,
            end,
            time.monotonic() - started,
        )
        return True

    async def _handed_over(self, topic: str) -> str | None:
        """Another live broker's URL while ``topic`` was recently unloaded from here (clients
        go there instead of this broker taking the topic back), else None."""
        until = self._handed.get(topic)
        if until is None:
            return None
        if time.monotonic() > until:
            del self._handed[topic]
            return None
        owner = await self._ownership.owner_of(topic)
        if owner is not None and owner.broker_id != self.broker_id:
            return owner.url
        for stored in await self._ownership.kv.get_prefix(self._keys.brokers_prefix()):
            if stored.key.rsplit("/", 1)[-1] != self.broker_id:
                url = json.loads(stored.value).get("url")
                if isinstance(url, str):
                    return url
        return None  # no other broker: serve it here again

    def owns(self, topic: str) -> bool:
        return topic in self._topics

    def reliable_topics(self) -> list[str]:
        """The reliable topics served here (loaded: their time floor is set)."""
        return [name for name, runtime in self._topics.items() if runtime.reliable]

    def subscription_lags(self) -> list[tuple[str, str, int]]:
        """(topic, subscription, lag) of every reliable subscription served here. The lag is
        the number of offsets between the topic's high watermark and the subscription's
        cursor: durable messages not yet settled (acked out of order above the cursor
        included)."""
        lags = []
        for runtime in self._topics.values():
            info = self._store.info(runtime.name) if runtime.reliable else None
            if info is None:
                continue
            for name, sub in runtime.subscriptions.items():
                if isinstance(sub, ReliableSubscription):
                    lags.append((runtime.name, name, max(0, info.high_watermark - sub.cursor)))
        return lags

    # -- producers -------------------------------------------------------------------------

    async def create_producer(
        self,
        topic: str,
        name: str,
        reliable: bool,
        schema_subject: str | None = None,
        owner: str | None = None,
    ) -> int:
        """Register a producer; return its id (the same id for the same name on the topic).

        ``owner``: the calling principal (``None`` with auth off). A name registered by another
        principal is refused with ``PermissionDeniedError``; one registered with auth off is
        claimed by ``owner``.
        """
        parse_topic(topic)
        check_name(name, "producer name")
        runtime = await self._load(topic, create_reliable=reliable)
        if runtime.reliable != reliable:
            raise StrategyMismatchError(
                f"topic {topic} is {'reliable' if runtime.reliable else 'non-reliable'}; "
                f"a producer cannot use the other dispatch strategy"
            )
        existing = await self._records.find_producer(topic, name)
        if existing is not None and owner is not None and existing.principal is not None:
            check_owner(owner, existing.principal, f"producer name {name!r} on {topic}")
        active = runtime.active_producers()
        if existing is None and active >= self._limits.max_producers_per_topic:
            raise LimitExceededError(
                f"topic {topic} has {active} active producers (limits.max_producers_per_topic)"
            )
        if schema_subject:
            # Danube's rule: the first producer naming a subject binds the topic to it. Only
            # a producer that is otherwise accepted may bind it.
            await self._schemas.assign_topic_subject(topic, schema_subject)
            runtime.schema_checked = float("-inf")
        if existing is not None:
            if existing.principal != owner and owner is not None:
                existing = replace(existing, principal=owner)
                await self._records.put_client(existing)
            self._producers[existing.client_id] = existing
            runtime.producers[existing.client_id] = time.monotonic()
            return existing.client_id
        client_id = await self._records.allocate_client_id()
        record = ClientRecord(
            client_id=client_id,
            kind="producer",
            topic=topic,
            name=name,
            reliable=reliable,
            principal=owner,
        )
        await self._records.put_client(record)
        self._producers[client_id] = record
        runtime.producers[client_id] = time.monotonic()
        return client_id

    async def _client(
        self, client_id: int, kind: str, known: dict[int, ClientRecord]
    ) -> ClientRecord:
        """A producer or consumer registration: cached, else from etcd (issued before a
        restart, or by a previous owner of the topic)."""
        record = known.get(client_id)
        if record is None:
            record = await self._records.get_client(client_id)
            if record is None or record.kind != kind:
                raise UnknownClientError(f"unknown {kind} id {client_id}")
            known[client_id] = record
        return record

    async def _producer(self, producer_id: int) -> ClientRecord:
        return await self._client(producer_id, "producer", self._producers)

    async def producer(self, producer_id: int, owner: str | None = None) -> ClientRecord:
        """The registration of ``producer_id``; ``UnknownClientError`` if there is none,
        ``PermissionDeniedError`` if it belongs to another principal than ``owner``."""
        record = self._producers.get(producer_id)
        if record is None:
            record = await self._producer(producer_id)
        check_owner(owner, record.principal, f"producer id {producer_id}")
        return record

    async def consumer(self, consumer_id: int, owner: str | None = None) -> ClientRecord:
        """The registration of ``consumer_id``, checked as :meth:`producer` checks."""
        record = await self._consumer(consumer_id)
        check_owner(owner, record.principal, f"consumer id {consumer_id}")
        return record

    async def publish(self, msg: Any, owner: str | None = None) -> None:
        """Store (reliable) or fan out (non-reliable) one published message; nothing is
        stored if the producer id belongs to another principal than ``owner``."""
        check_message(msg, self._limits)
        record = await self.producer(msg.msg_id.producer_id, owner)
        topic = record.topic
        if msg.msg_id.topic_name and msg.msg_id.topic_name != topic:
            raise InvalidRequestError(
                f"producer {record.client_id} publishes to {topic}, not {msg.msg_id.topic_name}"
            )
        runtime = self._topics.get(topic)
        if runtime is None:
            runtime = await self._load(topic)
        runtime.producers[record.client_id] = time.monotonic()
        config = await self._schema_config(runtime)
        if config is not None:
            await self._schemas.validate_message(
                config, msg.payload, msg.schema_id or None, msg.schema_version or None
            )
        entry = entry_from_message(msg)
        if runtime.fanout is not None:
            runtime.fanout.publish(entry)
            return
        await self._append(topic, entry)

    async def publish_block(
        self,
        topic: str,
        block: EntryBlock,
        producer_id: int = 0,
        sequence: int = 0,
        owner: str | None = None,
    ) -> StagedBlock:
        """Store (reliable) or fan out (non-reliable) a checked entry block of ``topic``.

        Returns once the block is staged: blocks are ordered as the calls return, and
        ``.future`` completes once the block is durable (see ``RegionLog.stage_block`` for
        idempotent producers' sequences). A missing topic is created reliable. Payloads are
        validated one by one against the topic's schema when it has one, as on the
        danube-client path. A non-reliable topic hands the entries to its subscriptions now.
        With ``owner`` (the calling principal, auth on) an idempotent ``producer_id`` is bound
        to the first principal that uses it; another's batches are refused
        (``PermissionDeniedError``) before anything is staged, so nobody can make a producer's
        batches look like duplicates.
        """
        parse_topic(topic)
        if owner is not None and producer_id:
            bound = self._producer_owners.get(producer_id)
            if bound is None:
                bound = await self._records.claim_producer_id(producer_id, owner)
                if len(self._producer_owners) >= _PRODUCER_OWNERS_CACHED:
                    self._producer_owners.clear()
                self._producer_owners[producer_id] = bound
            check_owner(owner, bound, f"idempotent producer id {producer_id:#x}")
        runtime = self._topics.get(topic)
        if runtime is None:
            runtime = await self._load(topic, create_reliable=True)
        config = await self._schema_config(runtime)
        entries: list[Entry] | None = None
        if config is not None:
            entries = block.entries(0)
            for entry in entries:
                await self._schemas.validate_message(
                    config, entry.payload, entry.schema_id, entry.schema_version or None
                )
        if runtime.fanout is not None:
            first = -1
            for entry in entries if entries is not None else block.entries(0):
                offset = runtime.fanout.publish(entry)
                first = offset if first < 0 else first
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return StagedBlock(done, range(first, first + block.count), False)
        end = self._store.next_offset(topic) + block.count
        if not self._reservations.covered(topic, end):
            await self._reservations.ensure(topic, end)
        # No await between the reservation check above and staging (see _append).
        return self._store.append_block(topic, block, producer_id, sequence)

    async def _schema_config(self, runtime: TopicRuntime) -> TopicSchemaConfig | None:
        """The topic's schema configuration, re-read at most every SCHEMA_CONFIG_TTL seconds
        (so a change made through any broker applies within that time)."""
        now = time.monotonic()
        if now - runtime.schema_checked < SCHEMA_CONFIG_TTL:
            return runtime.schema_config
        try:
            config: TopicSchemaConfig | None = await self._schemas.get_topic_schema_config(
                runtime.name
            )
        except SchemaNotFoundError:
            config = None
        if config is not None and config.validation_policy is ValidationPolicy.NONE:
            config = None
        runtime.schema_config = config
        runtime.schema_checked = now
        return config

    async def _append(self, topic: str, entry: Entry) -> int:
        next_offset = self._store.next_offset(topic)
        if not self._reservations.covered(topic, next_offset + 1):
            await self._reservations.ensure(topic, next_offset + 1)
        # No await between the reservation check above and staging: the offset assigned
        # below is covered by the reservation.
        return await self._store.append(topic, entry)

    # -- consumers -------------------------------------------------------------------------

    async def subscribe(
        self,
        topic: str,
        subscription: str,
        consumer_name: str,
        sub_type: SubscriptionType,
        key_filters: list[str],
        start: StartPosition = LATEST,
        owner: str | None = None,
        frames: int = 0,
    ) -> int:
        """Attach a consumer; return its id (the same id for the same consumer name).
        ``frames`` > 0: a batch consumer, given frames of up to that many entries (see
        ``ReliableSubscription.attach``).

        ``start`` applies only if this call creates the subscription (it has no cursor yet);
        an existing subscription resumes after its cursor. See ``broker.start``. ``owner``:
        the calling principal (``None`` with auth off); a consumer name registered by another
        principal is refused (``PermissionDeniedError``) before anything is attached or taken
        over; one registered with auth off is claimed by ``owner``.
        """
        parse_topic(topic)
        if not subscription:
            raise InvalidRequestError("subscription name must not be empty")
        check_name(subscription, "subscription name")
        check_name(consumer_name, "consumer name")
        check_key_filters(key_filters)
        runtime = await self._load(topic)
        sub_record = await self._records.get_subscription(topic, subscription)
        if sub_record is None:
            sub_record = SubscriptionRecord(
                topic=topic,
                name=subscription,
                sub_type=_TYPE_NAMES[sub_type],
                created_ms=_now_ms(),
            )
            await self._records.put_subscription(sub_record)
        elif sub_record.sub_type != _TYPE_NAMES[sub_type]:
            raise StrategyMismatchError(
                f"subscription {subscription} of {topic} is {sub_record.sub_type}, "
                f"not {_TYPE_NAMES[sub_type]}"
            )
        existing = await self._records.find_consumer(topic, subscription, consumer_name)
        if existing is not None and owner is not None and existing.principal is not None:
            check_owner(
                owner,
                existing.principal,
                f"consumer name {consumer_name!r} of subscription {subscription} on {topic}",
            )
        if existing is not None:
            client_id = existing.client_id
            # A consumer may come back with other key filters: store them, or its next
            # stream (a reconnect re-attaches from the record) would revert to the old ones.
            record = replace(
                existing,
                sub_type=_TYPE_NAMES[sub_type],
                key_filters=tuple(key_filters),
                principal=owner if owner is not None else existing.principal,
            )
        else:
            client_id = await self._records.allocate_client_id()
            record = ClientRecord(
                client_id=client_id,
                kind="consumer",
                topic=topic,
                name=consumer_name,
                subscription=subscription,
                sub_type=_TYPE_NAMES[sub_type],
                key_filters=tuple(key_filters),
                reliable=runtime.reliable,
                principal=owner,
            )
        sub = await self._subscription(runtime, sub_record, start)
        attached = len(sub.consumers)
        if existing is None and attached >= self._limits.max_consumers_per_subscription:
            raise LimitExceededError(
                f"subscription {subscription} has {attached} consumers "
                f"(limits.max_consumers_per_subscription)"
            )
        # (Shared and KeyShared give it messages once its stream opens: ``deliveries``.)
        handle = sub.attach(
            client_id, consumer_name, list(key_filters), frames=frames, receiving=False
        )
        if record != existing:
            await self._records.put_client(record)
        self._consumers[client_id] = record
        previous = self._handles.pop(client_id, None)
        if previous is not None and previous is not handle:
            previous.close()
        self._handles[client_id] = handle
        self._seen[client_id] = time.monotonic()
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_idle())
        return client_id

    async def _sweep_idle(self) -> None:
        """Detach consumers that are gone, so their messages go to the others: those that
        subscribed but neither stream nor health-check for ``consumer_idle_seconds`` (they
        would otherwise hold an Exclusive subscription, or a Failover's active place, and time
        their messages out forever), and streaming ones that hold messages without acking any
        or health-checking for CONSUMER_STALL_SECONDS (their stream ends). A consumer that
        comes back re-attaches."""
        interval = max(min(self._consumer_idle, CONSUMER_STALL_SECONDS) / 5, 0.05)
        while not self._closed:
            await asyncio.sleep(interval)
            now = time.monotonic()
            idle = now - self._consumer_idle
            stalled = now - CONSUMER_STALL_SECONDS
            # progress_at is on the subscriptions' clock, the event loop's
            no_progress = asyncio.get_running_loop().time() - CONSUMER_STALL_SECONDS
            for cid, handle in list(self._handles.items()):
                seen = self._seen.get(cid, 0.0)
                if cid not in self._streaming:
                    if seen >= idle:
                        continue
                    log.info("detaching idle consumer consumer_id=%d", cid)
                elif (
                    seen < stalled
                    and handle.in_flight
                    and not handle.closed
                    and handle.progress_at < no_progress
                ):
                    log.info(
                        "detaching stalled consumer consumer_id=%d in_flight=%d no_health_s=%.1f",
                        cid,
                        handle.in_flight,
                        now - seen,
                    )
                else:
                    continue
                del self._handles[cid]
                handle.close()

    async def _subscription(
        self, runtime: TopicRuntime, record: SubscriptionRecord, position: StartPosition = LATEST
    ) -> Subscription:
        sub = runtime.subscriptions.get(record.name)
        if sub is not None:
            return sub
        async with runtime.creating:
            # (Another subscribe may have created it while this one waited.)
            sub = runtime.subscriptions.get(record.name)
            if sub is not None:
                return sub
            return await self._create_subscription(runtime, record, position)

    async def _create_subscription(
        self, runtime: TopicRuntime, record: SubscriptionRecord, position: StartPosition
    ) -> Subscription:
        sub_type = _TYPES_BY_NAME[record.sub_type]
        if runtime.fanout is not None:
            nr = runtime.fanout.subscription(record.name, sub_type)
            runtime.subscriptions[record.name] = nr
            return nr
        topic = runtime.name
        cursor = await self._records.get_cursor(topic, record.name)
        info = await self._store.ensure_topic(topic)
        if cursor is None:
            # A new subscription starts where asked (Danube's default: the latest offset);
            # persist that right away so a restart resumes from here, not a later "latest".
            cursor = await self._start_offset(topic, info.high_watermark, position)
            await self._records.set_cursor(topic, record.name, cursor)
            log.info(
                "subscription created topic=%s sub=%s start=%s cursor=%d",
                topic,
                record.name,
                position,
                cursor,
            )
        # Below the WAL floor a reader goes on from objects when the store has them (what an
        # earlier owner uploaded, or what was pruned here); otherwise that data is gone.
        start = cursor if self._store.cloud is not None else max(cursor, info.first_offset)
        if start > cursor:
            log.warning(
                "subscription cursor below retained floor topic=%s sub=%s cursor=%d floor=%d",
                topic,
                record.name,
                cursor,
                info.first_offset,
            )
        name = record.name
        sub = ReliableSubscription(
            name,
            topic,
            sub_type,
            self._store,
            start,
            self._policy,
            on_cursor=functools.partial(
                self._cursor_advanced, topic, self._keys.subscription_cursor(topic, name)
            ),
            dead_letter=lambda entry, attrs: self._dead_letter(topic, entry, attrs),
        )
        runtime.subscriptions[name] = sub
        return sub

    async def _start_offset(self, topic: str, end: int, start: StartPosition) -> int:
        """The first offset a new subscription reads for ``start`` (``end``: the high
        watermark); always within [earliest retained, end]."""
        if start.kind == "latest":
            return end
        if start.kind == "time":
            return min(await self._store.offset_at_time(topic, start.value), end)
        earliest = await self._store.earliest_offset(topic)
        if start.kind == "earliest":
            return min(earliest, end)
        return min(max(start.value, earliest), end)

    # -- subscription admin (``danube-ingest subscriptions reset|delete``) -------------------

    async def reset_subscription(
        self, topic: str, subscription: str, start: StartPosition
    ) -> tuple[int | None, int]:
        """Move a reliable subscription's cursor to ``start`` (resolved as for a new
        subscription: within [earliest retained, end]); returns (previous cursor, new cursor).

        Refused with ``SubscriptionInUseError`` while consumers are connected to it. The new
        cursor is written through the fenced progress path before this returns, and the
        subscription's next consumer reads from it; acknowledged messages at or above it are
        delivered again, those below it are skipped.
        """
        runtime, sub = await self._idle_subscription(topic, subscription)
        async with runtime.creating:
            sub = self._check_idle(runtime, subscription)
            info = await self._store.ensure_topic(topic)
            cursor = await self._start_offset(topic, info.high_watermark, start)
            previous = (
                sub.cursor
                if isinstance(sub, ReliableSubscription)
                else await self._records.get_cursor(topic, subscription)
            )
            if sub is not None:
                del runtime.subscriptions[subscription]
                await sub.close()
            self._progress.set(
                topic, self._keys.subscription_cursor(topic, subscription), encode_cursor(cursor)
            )
            await self._progress.flush(topic)
        log.info(
            "subscription reset topic=%s sub=%s start=%s previous=%s cursor=%d",
            topic,
            subscription,
            start,
            previous,
            cursor,
        )
        return previous, cursor

    async def delete_subscription(self, topic: str, subscription: str) -> None:
        """Delete a reliable subscription and its cursor. Refused with
        ``SubscriptionInUseError`` while consumers are connected to it. Its consumers'
        registrations stay: one that subscribes again creates the subscription anew, where it
        asks to start."""
        runtime, _ = await self._idle_subscription(topic, subscription)
        async with runtime.creating:
            sub = self._check_idle(runtime, subscription)
            if sub is not None:
                del runtime.subscriptions[subscription]
                await sub.close()
            # Its pending cursor is written first, so nothing writes the cursor after the
            # deletion below.
            await self._progress.flush(topic)
            await self._records.delete_subscription(topic, subscription)
        log.info("subscription deleted topic=%s sub=%s", topic, subscription)

    async def _idle_subscription(
        self, topic: str, subscription: str
    ) -> tuple[TopicRuntime, Subscription | None]:
        """The runtime of ``topic`` (loaded here, as a subscribe would) and the subscription's
        runtime if loaded; raises unless the topic is reliable and the subscription exists
        with no consumer connected."""
        parse_topic(topic)
        check_name(subscription, "subscription name")
        runtime = await self._load(topic)
        if not runtime.reliable:
            raise InvalidRequestError(
                f"topic {topic} is non-reliable: its subscriptions have no cursor to reset or "
                "delete"
            )
        if await self._records.get_subscription(topic, subscription) is None:
            raise SubscriptionNotFoundError(f"topic {topic} has no subscription {subscription!r}")
        return runtime, self._check_idle(runtime, subscription)

    @staticmethod
    def _check_idle(runtime: TopicRuntime, subscription: str) -> Subscription | None:
        sub = runtime.subscriptions.get(subscription)
        if sub is None:
            return None
        connected = [handle.name for handle in sub.consumers if not handle.closed]
        if connected:
            raise SubscriptionInUseError(
                f"subscription {subscription!r} of {runtime.name} has {len(connected)} connected "
                f"consumer(s) ({', '.join(sorted(connected))}): stop them, then run this again"
            )
        return sub

    def _cursor_advanced(self, topic: str, key: str, cursor: int) -> None:
        """Called on every ack that advances a cursor (``key``: computed once)."""
        self._progress.set(topic, key, encode_cursor(cursor))

    async def _dead_letter(self, topic: str, entry: Entry, attributes: dict[str, str]) -> None:
        dlq = self._policy.dead_letter_topic_for(topic)
        runtime = await self._load(dlq, create_reliable=True)
        if not runtime.reliable:
            # Retried by the subscription (every redelivery_max) until an operator fixes it.
            raise StrategyMismatchError(
                f"dead-letter topic {dlq} of {topic} exists as a non-reliable topic; dead "
                f"letters need a reliable topic (delete it, or change dispatch.dead_letter_topic)"
            )
        attrs = dict(entry.attributes or {})
        attrs.update(attributes)
        copy = Entry(
            entry.payload,
            publish_ms=entry.publish_ms,
            producer_name=entry.producer_name,
            routing_key=entry.routing_key,
            attributes=attrs,
            schema_id=entry.schema_id,
            schema_version=entry.schema_version,
            producer_id=entry.producer_id,
            request_id=entry.request_id,
        )
        await self._append(dlq, copy)

    async def _consumer(self, consumer_id: int) -> ClientRecord:
        return await self._client(consumer_id, "consumer", self._consumers)

    async def _attach(self, record: ClientRecord, frames: int = 0) -> ConsumerHandle:
        """Attach a consumer to its subscription, waiting while its topic cannot be served
        here for now (the broker session or etcd is away). Raises ``NotOwnerError`` if another
        broker owns the topic, ``ConsumerClosedError`` once the broker shuts down, and errors
        that retrying cannot mend."""
        delay = _RECOVER_POLL_SECONDS
        while True:
            try:
                return await self._attach_once(record, frames)
            except DanubeIngestError as exc:
                if self._ending or not _may_recover(exc):
                    raise
                log.info(
                    "consumer stream waits for its topic topic=%s consumer_id=%d error=%s",
                    record.topic,
                    record.client_id,
                    exc,
                )
            if record.topic in self._topics:
                # Served, but etcd failed reading the subscription: try again later.
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECOVER_RETRY_MAX_SECONDS)
            else:
                await self._recovered(record.topic)

    async def _recovered(self, topic: str) -> None:
        """Return once ``topic`` is served here again (one acquisition attempt loop per topic,
        shared by all its waiting streams)."""
        task = self._recovering.get(topic)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._recover(topic))
            self._recovering[topic] = task
            task.add_done_callback(functools.partial(self._recovery_done, topic))
        await asyncio.shield(task)

    def _recovery_done(self, topic: str, task: asyncio.Task[None]) -> None:
        if self._recovering.get(topic) is task:
            del self._recovering[topic]
        if not task.cancelled():
            task.exception()  # retrieved by the waiting streams, or by nobody: no warning

    async def _recover(self, topic: str) -> None:
        """Acquire and load ``topic`` again as soon as the broker session is back."""
        delay = _RECOVER_POLL_SECONDS
        lost = time.monotonic()
        while not self._ending:
            if not self._ownership.session.alive:
                await asyncio.sleep(_RECOVER_POLL_SECONDS)  # no I/O: wait for re-registration
                continue
            try:
                runtime = await self._load(topic)
            except DanubeIngestError as exc:
                if not _may_recover(exc):
                    log.warning("topic not recovered topic=%s error=%s", topic, exc)
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RECOVER_RETRY_MAX_SECONDS)
                continue
            owner = self._ownership.owned(topic)
            log.info(
                "topic served again topic=%s epoch=%s waited_s=%.2f reliable=%s",
                topic,
                owner.epoch if owner is not None else "?",
                time.monotonic() - lost,
                runtime.reliable,
            )
            return
        raise ConsumerClosedError(f"broker is shutting down: topic {topic} is not served")

    async def _attach_once(self, record: ClientRecord, frames: int) -> ConsumerHandle:
        runtime = await self._load(record.topic)
        assert record.subscription is not None  # consumer records always have one
        sub_record = await self._records.get_subscription(record.topic, record.subscription)
        if sub_record is None:
            raise UnknownClientError(
                f"subscription {record.subscription} of {record.topic} no longer exists"
            )
        sub = await self._subscription(runtime, sub_record)
        return sub.attach(record.client_id, record.name, list(record.key_filters), frames=frames)

    async def deliveries(
        self,
        consumer_id: int,
        max_batch: int,
        peer: str | None = None,
        owner: str | None = None,
        frames: bool = False,
    ) -> AsyncGenerator[list[Delivery | Frame], None]:
        """A consumer's deliveries, at most ``max_batch`` messages at a time, in dispatch order
        (``frames``: as frames of consecutive offsets where dispatch allows, see
        ``ReliableSubscription.attach``); a new stream takes over an old one. ``peer``: the
        client connection whose Ack and Nack calls may settle them; ``owner``: the calling
        principal (``PermissionDeniedError`` before anything is taken over if the consumer is
        another principal's).

        The stream ends when the consumer is taken over or detached, or the broker shuts down.
        While the topic is not served here (its ownership was lost, e.g. etcd is away) it stays
        open and sends nothing; it resumes from the subscription's cursor once the topic is
        served again, or fails with ``NotOwnerError`` if another broker owns it by then.
        """
        record = await self.consumer(consumer_id, owner)
        handle = self._handles.get(consumer_id)
        if handle is None or consumer_id in self._streaming or handle.closed:
            # Attaching the same consumer id replaces an open handle in its place (closing
            # it), so a Failover consumer that reconnects stays the active one.
            handle = await self._attach(record, max_batch if frames else 0)
            self._handles[consumer_id] = handle
        self._streaming.add(consumer_id)
        if peer is not None:
            self._peers[consumer_id] = peer
        topic = record.topic
        try:
            while True:
                try:
                    batch = await handle.next_batch(max_batch)
                except ConsumerClosedError:
                    if (
                        self._ending
                        or self._handles.get(consumer_id) is not handle
                        or topic in self._topics
                    ):
                        return  # shutdown, taken over or detached, or its subscription ended
                    # The topic was given up (ownership lost): keep the stream open.
                    try:
                        handle = await self._attach(record, max_batch if frames else 0)
                    except ConsumerClosedError:
                        return
                    self._handles[consumer_id] = handle
                    continue
                except OffsetOutOfRangeError as exc:
                    log.error("subscription reader out of range: %s", exc)
                    return
                yield batch
        finally:
            if self._handles.get(consumer_id) is handle:
                self._streaming.discard(consumer_id)
                self._peers.pop(consumer_id, None)
                del self._handles[consumer_id]
                handle.close()

    def _subscription_of(self, topic: str, subscription: str) -> Subscription | None:
        runtime = self._topics.get(topic)
        if runtime is None:
            return None
        return runtime.subscriptions.get(subscription)

    def ack_range(self, consumer_id: int, first: int, last: int) -> int:
        """Acknowledge the offsets in ``[first, last]`` the consumer holds (a cumulative ack is
        one from 0); returns how many were acknowledged. Unknown consumers ack nothing."""
        record = self._consumers.get(consumer_id)
        handle = self._handles.get(consumer_id)
        if record is None or handle is None or record.subscription is None:
            return 0
        sub = self._subscription_of(record.topic, record.subscription)
        if sub is None:
            return 0
        return sub.ack_range(handle, first, last)

    def _from_holder(
        self, sub: Subscription, offset: int, peer: str | None, owner: str | None, what: str
    ) -> bool:
        """Whether an ack or nack of ``offset`` from connection ``peer`` (principal ``owner``)
        may settle it: only the consumer holding it, over the connection of its stream. Raises
        ``PermissionDeniedError`` if another consumer holds it; False if none does (nothing is
        settled: it is not dispatched yet, or its redelivery is pending)."""
        if not isinstance(sub, ReliableSubscription):
            return True
        for handle in sub.consumers:
            if handle.holds(offset):
                cid = handle.consumer_id
                record = self._consumers.get(cid)
                if (
                    peer is not None
                    and self._peers.get(cid) == peer
                    and record is not None
                    and (owner is None or record.principal == owner)
                ):
                    return True
                raise PermissionDeniedError(
                    f"{what} of offset {offset} of {sub.topic} subscription {sub.name} refused: "
                    f"it was dispatched to another consumer; only that consumer (its principal, "
                    f"over the connection of its ReceiveMessages stream) may settle it"
                )
        return False

    def ack(
        self,
        topic: str,
        subscription: str,
        offset: int,
        peer: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Acknowledge a delivered offset, if it came from the consumer holding it (see the
        module docstring); acks of offsets nobody holds are ignored."""
        sub = self._subscription_of(topic, subscription)
        if sub is not None and self._from_holder(sub, offset, peer, owner, "ack"):
            sub.ack(offset)

    def nack(
        self,
        topic: str,
        subscription: str,
        offset: int,
        delay_ms: int,
        reason: str,
        peer: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Negatively acknowledge: redeliver after max(policy delay, ``delay_ms``); checked
        as :meth:`ack` is."""
        sub = self._subscription_of(topic, subscription)
        if sub is not None and self._from_holder(sub, offset, peer, owner, "nack"):
            sub.nack(offset, delay_ms or None, reason or None)

    async def health(self, is_consumer: bool, client_id: int, owner: str | None = None) -> bool:
        """True (OK) while the client may go on; False asks a consumer to re-subscribe.
        ``PermissionDeniedError`` if the id belongs to another principal than ``owner``."""
        try:
            record = (
                await self._consumer(client_id) if is_consumer else await self._producer(client_id)
            )
        except UnknownClientError:
            return False
        except DanubeIngestError:
            # Metadata unreachable: say nothing alarming; an error would end the client's
            # health loop for good.
            return True
        check_owner(owner, record.principal, f"{record.kind} id {client_id}")
        runtime = self._topics.get(record.topic)
        if not is_consumer:
            if runtime is not None:
                runtime.producers[client_id] = time.monotonic()
            return True
        self._seen[client_id] = time.monotonic()
        # A topic being recovered (its streams wait for it) is no reason to re-subscribe.
        return runtime is not None or record.topic in self._recovering

    def end_streams(self) -> None:
        """End every consumer stream (shutdown: clients reconnect to whoever serves next)."""
        self._ending = True
        for handle in list(self._handles.values()):
            handle.close()

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every subscription, flush cursors, (``hand_over_on_close``) commit the WAL
        tails and hand their exact ends over, give topics up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.end_streams()
        if self._sweeper is not None:
            self._sweeper.cancel()
        recovering = list(self._recovering.values())
        for task in recovering:
            task.cancel()
        await asyncio.gather(*recovering, return_exceptions=True)
        for runtime in list(self._topics.values()):
            await self._unload(runtime)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._progress.flush()
        if self._hand_over_on_close:
            await self._hand_over_all()
        for topic in list(self._topics):
            await self._ownership.release(topic)
        self._topics.clear()

    async def _hand_over_all(self) -> None:
        """Shutdown: commit every reliable topic's WAL tail and set its reservation to the exact
        end, so that the next owner continues at once, with no gap and no wait
        (``broker.takeover``). A topic whose tail is not committed within
        ``shutdown_upload_seconds`` is released as it is: its next owner waits for this broker's
        restart (or ``brokers forget``)."""
        ends: dict[str, int] = {}
        sealed: set[str] = set()
        for name, runtime in self._topics.items():
            info = self._store.info(name) if runtime.reliable else None
            if info is None or not self._ownership.is_owner(name):
                continue
            if info.region not in sealed:  # one seal per region takes all of its topics
                sealed.add(info.region)
                ends[name] = self._store.seal(name)
            else:
                ends[name] = self._store.next_offset(name)
        deadline = time.monotonic() + self._shutdown_upload_seconds
        while ends:
            for name, end in list(ends.items()):
                if not self._store.uploaded_below(name, end):
                    continue
                del ends[name]
                try:
                    await self._reservations.hand_over(
                        name, end, handed_table(self._store, self._ownership, name, end)
                    )
                except DanubeIngestError as exc:
                    log.warning(
                        "shutdown hand-over failed topic=%s end=%d error=%s", name, end, exc
                    )
            if not ends or time.monotonic() > deadline:
                break
            await asyncio.sleep(_RECOVER_POLL_SECONDS)
        if ends:
            log.warning(
                "shutdown: WAL tails not committed within %.0f s topics=%s (their next owners "
                "wait for this broker's restart)",
                self._shutdown_upload_seconds,
                ",".join(sorted(ends)),
            )


_TYPE_NAMES = {
    SubscriptionType.EXCLUSIVE: "Exclusive",
    SubscriptionType.SHARED: "Shared",
    SubscriptionType.FAILOVER: "Failover",
    SubscriptionType.KEY_SHARED: "KeyShared",
}
_TYPES_BY_NAME = {name: kind for kind, name in _TYPE_NAMES.items()}


def _may_recover(exc: DanubeIngestError) -> bool:
    """Whether a topic that failed to load with ``exc`` may be served here later: etcd or the
    broker session is away (not: another broker owns it, or it no longer exists)."""
    if isinstance(exc, NotOwnerError | TopicNotFoundError | UnknownClientError):
        return False
    return exc.retriable or isinstance(exc, MetadataError)


def _now_ms() -> int:
    return int(time.time() * 1000)
