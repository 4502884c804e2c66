"""TopicManager: the broker's topics, producers, subscriptions and consumers.

Guarantees:

* A reliable publish is answered only after its entry is durable in the WAL.
* Producer and consumer ids are allocated cluster-wide and persisted in etcd (``clients/{id}``):
  a restarted broker, or the broker that took a topic over, serves the ids issued before, so
  danube-client recovers by itself. The same producer name on a topic gets the same id; the
  same (topic, subscription, consumer name) gets the same consumer id.
* A topic is served only while this broker owns it (lease + epoch in etcd). A new owner
  continues the topic's offsets after every offset the previous owner may have assigned.
* Subscription cursors are written to etcd by the ProgressUpdater (debounced, fenced by the
  owner epoch, flushed on shutdown and before a topic is given up).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from danube_ingest.broker.convert import entry_from_message, message_from_entry
from danube_ingest.broker.errors import (
    InvalidRequestError,
    LimitExceededError,
    NotOwnerError,
    StrategyMismatchError,
    TopicNotFoundError,
    UnknownClientError,
)
from danube_ingest.broker.names import parse_topic, partition_base
from danube_ingest.broker.validation import check_message, check_name
from danube_ingest.config import LimitsConfig
from danube_ingest.dispatch import (
    ConsumerClosedError,
    ConsumerHandle,
    DispatchPolicy,
    NonReliableTopic,
    ReliableSubscription,
    Subscription,
    SubscriptionType,
)
from danube_ingest.errors import DanubeIngestError, OffsetOutOfRangeError
from danube_ingest.metadata.errors import LeaseExpiredError
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
from danube_ingest.store import TopicStore
from danube_ingest.wal.framing import Entry

log = logging.getLogger(__name__)

#: A producer that neither published nor health-checked (every 5 s) for this long no longer
#: counts against ``limits.max_producers_per_topic``.
PRODUCER_IDLE_SECONDS = 30.0
#: Seconds a topic's schema configuration is cached before it is re-read.
SCHEMA_CONFIG_TTL = 1.0


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
    ) -> None:
        self.broker_id = broker_id
        self._manifest = manifest
        self.broker_url = broker_url
        self._store = store
        self._records = records
        self._keys = keys
        self._ownership = ownership
        self._reservations = reservations
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
        #: consumer id -> when it last subscribed or health-checked (monotonic)
        self._seen: dict[int, float] = {}
        self._consumer_idle = consumer_idle_seconds
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()
        ownership.on_lost(self._on_ownership_lost)

    # -- topics ----------------------------------------------------------------------------

    async def lookup(self, topic: str) -> tuple[bool, str]:
        """(this broker serves it, URL of the broker that does). Raises TopicNotFoundError."""
        parse_topic(topic)
        if topic in self._topics and self._ownership.is_owner(topic):
            # (A topic whose lease ran out is not ours even before its loss is processed.)
            return True, self.broker_url
        record = await self._records.get_topic(topic)
        if record is None:
            raise TopicNotFoundError(f"topic {topic} does not exist")
        try:
            owner = await self._ownership.acquire(topic)
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
                record, _created = await self._records.create_topic_if_absent(
                    TopicRecord(name=topic, reliable=create_reliable, created_ms=_now_ms())
                )
            owner = await self._ownership.acquire(topic)
            if owner.broker_id != self.broker_id:
                raise NotOwnerError(topic, owner.url)
            runtime = TopicRuntime(topic, record)
            if record.reliable:
                local = self._store.info(topic)
                start = await self._reservations.start_offset(
                    topic, local.next_offset if local is not None else None
                )
                if self._manifest is not None:
                    # What earlier owners uploaded: never reassign those offsets (defence in
                    # depth; the reservation already lies beyond them).
                    start = max(start, await self._manifest.end_offset(topic))
                await self._store.ensure_topic(topic, min_next_offset=start)
            else:
                runtime.fanout = NonReliableTopic(topic)
            self._topics[topic] = runtime
            log.info(
                "topic loaded topic=%s reliable=%s epoch=%s", topic, record.reliable, owner.epoch
            )
            return runtime

    def _on_ownership_lost(self, topic: str) -> None:
        runtime = self._topics.pop(topic, None)
        if runtime is None:
            return
        log.warning("topic ownership lost topic=%s", topic)
        task = asyncio.get_running_loop().create_task(self._unload(runtime))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unload(self, runtime: TopicRuntime) -> None:
        """Stop serving a topic: end its consumer streams, close its subscriptions."""
        runtime.closed = True
        for cid in [c for c, rec in self._consumers.items() if rec.topic == runtime.name]:
            handle = self._handles.pop(cid, None)
            if handle is not None:
                handle.close()
        for subscription in runtime.subscriptions.values():
            await subscription.close()
        if runtime.fanout is not None:
            await runtime.fanout.close()

    def owns(self, topic: str) -> bool:
        return topic in self._topics

    # -- producers -------------------------------------------------------------------------

    async def create_producer(
        self, topic: str, name: str, reliable: bool, schema_subject: str | None = None
    ) -> int:
        parse_topic(topic)
        check_name(name, "producer name")
        runtime = await self._load(topic, create_reliable=reliable)
        if runtime.reliable != reliable:
            raise StrategyMismatchError(
                f"topic {topic} is {'reliable' if runtime.reliable else 'non-reliable'}; "
                f"a producer cannot use the other dispatch strategy"
            )
        existing = await self._records.find_producer(topic, name)
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
            self._producers[existing.client_id] = existing
            runtime.producers[existing.client_id] = time.monotonic()
            return existing.client_id
        client_id = await self._records.allocate_client_id()
        record = ClientRecord(
            client_id=client_id, kind="producer", topic=topic, name=name, reliable=reliable
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

    async def publish(self, msg: Any) -> None:
        """Store (reliable) or fan out (non-reliable) one published message."""
        check_message(msg, self._limits)
        record = self._producers.get(msg.msg_id.producer_id)
        if record is None:
            record = await self._producer(msg.msg_id.producer_id)
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
    ) -> int:
        parse_topic(topic)
        if not subscription:
            raise InvalidRequestError("subscription name must not be empty")
        check_name(subscription, "subscription name")
        check_name(consumer_name, "consumer name")
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
        if existing is not None:
            client_id = existing.client_id
            # A consumer may come back with other key filters: store them, or its next
            # stream (a reconnect re-attaches from the record) would revert to the old ones.
            record = replace(
                existing, sub_type=_TYPE_NAMES[sub_type], key_filters=tuple(key_filters)
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
            )
        sub = await self._subscription(runtime, sub_record)
        attached = len(sub.consumers)
        if existing is None and attached >= self._limits.max_consumers_per_subscription:
            raise LimitExceededError(
                f"subscription {subscription} has {attached} consumers "
                f"(limits.max_consumers_per_subscription)"
            )
        handle = sub.attach(client_id, consumer_name, list(key_filters))
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
        """Detach consumers that subscribed but neither stream nor health-check (their process
        is gone): they would otherwise hold an Exclusive subscription, or a Failover's active
        place, and time their messages out forever. A consumer that comes back re-attaches."""
        interval = max(self._consumer_idle / 3, 0.05)
        while not self._closed:
            await asyncio.sleep(interval)
            horizon = time.monotonic() - self._consumer_idle
            for cid, handle in list(self._handles.items()):
                if cid in self._streaming or self._seen.get(cid, 0.0) >= horizon:
                    continue
                log.info("detaching idle consumer consumer_id=%d", cid)
                del self._handles[cid]
                handle.close()

    async def _subscription(
        self, runtime: TopicRuntime, record: SubscriptionRecord
    ) -> Subscription:
        sub = runtime.subscriptions.get(record.name)
        if sub is not None:
            return sub
        sub_type = _TYPES_BY_NAME[record.sub_type]
        if runtime.fanout is not None:
            nr = runtime.fanout.subscription(record.name, sub_type)
            runtime.subscriptions[record.name] = nr
            return nr
        topic = runtime.name
        cursor = await self._records.get_cursor(topic, record.name)
        info = await self._store.ensure_topic(topic)
        if cursor is None:
            # A new subscription starts at the latest offset; persist that right away so a
            # restart resumes from here rather than from a later "latest".
            cursor = info.high_watermark
            await self._records.set_cursor(topic, record.name, cursor)
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

    async def _attach(self, record: ClientRecord) -> ConsumerHandle:
        runtime = await self._load(record.topic)
        assert record.subscription is not None  # consumer records always have one
        sub_record = await self._records.get_subscription(record.topic, record.subscription)
        if sub_record is None:
            raise UnknownClientError(
                f"subscription {record.subscription} of {record.topic} no longer exists"
            )
        sub = await self._subscription(runtime, sub_record)
        return sub.attach(record.client_id, record.name, list(record.key_filters))

    async def receive(self, consumer_id: int) -> AsyncIterator[Any]:
        """The stream of StreamMessages for a consumer; a new stream takes over an old one."""
        record = await self._consumer(consumer_id)
        handle = self._handles.get(consumer_id)
        if handle is None or consumer_id in self._streaming or handle.closed:
            # Attaching the same consumer id replaces an open handle in its place (closing
            # it), so a Failover consumer that reconnects stays the active one.
            handle = await self._attach(record)
            self._handles[consumer_id] = handle
        self._streaming.add(consumer_id)
        topic = record.topic
        subscription = record.subscription or ""
        try:
            while True:
                try:
                    delivery = await handle.next()
                except ConsumerClosedError:
                    return
                except OffsetOutOfRangeError as exc:
                    log.error("subscription reader out of range: %s", exc)
                    return
                yield message_from_entry(delivery.entry, topic, subscription, self.broker_url)
        finally:
            if self._handles.get(consumer_id) is handle:
                self._streaming.discard(consumer_id)
                del self._handles[consumer_id]
                handle.close()

    def _subscription_of(self, topic: str, subscription: str) -> Subscription | None:
        runtime = self._topics.get(topic)
        if runtime is None:
            return None
        return runtime.subscriptions.get(subscription)

    def ack(self, topic: str, subscription: str, offset: int) -> None:
        """Acknowledge a delivered offset; unknown acks are ignored."""
        sub = self._subscription_of(topic, subscription)
        if sub is not None:
            sub.ack(offset)

    def nack(self, topic: str, subscription: str, offset: int, delay_ms: int, reason: str) -> None:
        """Negatively acknowledge: redeliver after max(policy delay, ``delay_ms``)."""
        sub = self._subscription_of(topic, subscription)
        if sub is not None:
            sub.nack(offset, delay_ms or None, reason or None)

    async def health(self, is_consumer: bool, client_id: int) -> bool:
        """True (OK) while the client may go on; False asks a consumer to re-subscribe."""
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
        runtime = self._topics.get(record.topic)
        if not is_consumer:
            if runtime is not None:
                runtime.producers[client_id] = time.monotonic()
            return True
        self._seen[client_id] = time.monotonic()
        return runtime is not None

    def end_streams(self) -> None:
        """End every consumer stream (shutdown: clients reconnect to whoever serves next)."""
        for handle in list(self._handles.values()):
            handle.close()

    # -- shutdown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every subscription, flush cursors, give topics up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for runtime in list(self._topics.values()):
            await self._unload(runtime)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._progress.flush()
        for topic in list(self._topics):
            await self._ownership.release(topic)
        self._topics.clear()


_TYPE_NAMES = {
    SubscriptionType.EXCLUSIVE: "Exclusive",
    SubscriptionType.SHARED: "Shared",
    SubscriptionType.FAILOVER: "Failover",
    SubscriptionType.KEY_SHARED: "KeyShared",
}
_TYPES_BY_NAME = {name: kind for kind, name in _TYPE_NAMES.items()}


def _now_ms() -> int:
    return int(time.time() * 1000)
