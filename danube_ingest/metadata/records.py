"""Typed metadata records (topic, subscription, client registration) and their CRUD.

Records are frozen dataclasses stored as JSON objects. Decoding ignores fields it does not
know and fills missing optional ones with their defaults, so records written by a newer or
older version still load.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import InvalidNameError, MetadataError
from danube_ingest.metadata.keys import Keys, check_segment, split_topic
from danube_ingest.metadata.kv import KV, Compare, Delete, Get, Put

ClientKind = Literal["producer", "consumer"]
ValidationPolicy = Literal["none", "warn", "enforce"]

#: Client id allocation gives up after this many random ids in a row that are taken (with 2**63
#: ids, even one taken draw is practically impossible: this bounds a broken random source).
_ALLOCATE_ATTEMPTS = 8


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch."""
    return time.time_ns() // 1_000_000


class _JsonRecord:
    """JSON codec shared by the record dataclasses."""

    def encode(self) -> bytes:
        """The stored JSON value."""
        assert dataclasses.is_dataclass(self)
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, key: str = "?") -> Self:
        """Parse a stored value; ``MetadataError`` naming ``key`` if it is not a valid record."""
        try:
            raw = values.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            assert dataclasses.is_dataclass(cls)
            known = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: _from_json(v) for k, v in raw.items() if k in known})
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"malformed {cls.__name__} at {key}: {exc}") from exc


def _from_json(value: Any) -> Any:
    # JSON has no tuples; every list field of these records is a tuple.
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class TopicRecord(_JsonRecord):
    """A topic's configuration, at ``topics/{ns}/{topic}``."""

    name: str
    """``/namespace/topic``."""
    reliable: bool = True
    """Reliable dispatch (stored in the WAL, acked) or non-reliable (in-memory fan-out)."""
    partitions: int | None = None
    """Number of partitions of a partitioned topic's parent, ``None`` for a plain topic."""
    created_ms: int = field(default_factory=now_ms)
    """When the topic was created."""
    schema_subject: str | None = None
    """Schema registry subject bound to the topic, if any."""
    validation_policy: ValidationPolicy = "none"
    """What to do with payloads that fail schema validation: none, warn or enforce."""

    def __post_init__(self) -> None:
        split_topic(self.name)
        if self.validation_policy not in ("none", "warn", "enforce"):
            raise InvalidNameError(f"invalid validation policy {self.validation_policy!r}")


@dataclass(frozen=True)
class SubscriptionRecord(_JsonRecord):
    """A subscription, at ``subscriptions/{ns}/{topic}/{name}``."""

    topic: str
    """``/namespace/topic``."""
    name: str
    """The subscription name."""
    sub_type: str
    """Exclusive, Shared, Failover or KeyShared."""
    created_ms: int = field(default_factory=now_ms)
    """When the subscription was created."""

    def __post_init__(self) -> None:
        split_topic(self.topic)
        check_segment(self.name, "subscription name")


@dataclass(frozen=True)
class ClientRecord(_JsonRecord):
    """A persisted producer or consumer registration, at ``clients/{client_id}``."""

    client_id: int
    """Unique id from :meth:`Records.allocate_client_id`."""
    kind: ClientKind
    """``"producer"`` or ``"consumer"``."""
    topic: str
    """``/namespace/topic``."""
    name: str
    """The producer or consumer name chosen by the client."""
    subscription: str | None = None
    """The consumer's subscription (``None`` for producers)."""
    sub_type: str | None = None
    """The consumer's subscription type (``None`` for producers)."""
    key_filters: tuple[str, ...] = ()
    """KeyShared glob filters of a consumer."""
    reliable: bool = True
    """Whether the client uses reliable dispatch."""
    created_ms: int = field(default_factory=now_ms)
    """When the client registered."""
    principal: str | None = None
    """The authenticated principal that created it (only it may use the id); ``None`` when
    it was created with ``auth.enabled`` off."""

    def __post_init__(self) -> None:
        split_topic(self.topic)
        if self.kind not in ("producer", "consumer"):
            raise InvalidNameError(f"invalid client kind {self.kind!r}")
        if self.kind == "consumer" and self.subscription is None:
            raise InvalidNameError(f"consumer {self.name!r} of {self.topic} has no subscription")


def encode_cursor(offset: int) -> bytes:
    """A cursor's stored value ``{"offset": N}`` (for ``ProgressUpdater.set``).

    Called on every ack that advances a cursor: formatted directly, not through ``json``
    (the same bytes ``json.dumps`` writes for an int).
    """
    return b'{"offset": %d}' % offset


def decode_cursor(data: bytes, key: str = "?") -> int:
    """The offset of a stored cursor; ``MetadataError`` naming ``key`` if it is malformed."""
    try:
        return int(values.loads(data)["offset"])
    except (ValueError, TypeError, KeyError) as exc:
        raise MetadataError(f"malformed cursor at {key}: {data!r}") from exc


def _decode_int(data: bytes, key: str) -> int:
    try:
        return int(values.loads(data))
    except (ValueError, TypeError) as exc:
        raise MetadataError(f"malformed integer at {key}: {data!r}") from exc


class Records:
    """CRUD of topic, subscription, cursor and client records.

    Single-key writes are plain puts; anything that must not clobber a concurrent writer is a
    transaction (topic creation, client id allocation).
    """

    def __init__(self, kv: KV, keys: Keys) -> None:
        self.kv = kv
        self.keys = keys

    # topics

    async def create_topic_if_absent(self, record: TopicRecord) -> tuple[TopicRecord, bool]:
        """Store ``record`` unless the topic exists, atomically.

        Returns ``(stored record, created)``: ``(record, True)`` if it was created, else the
        existing record and ``False``.
        """
        key = self.keys.topic(record.name)
        result = await self.kv.txn([Compare.absent(key)], [Put(key, record.encode())], [Get(key)])
        existing = result.kv(0)
        if result.succeeded or existing is None:
            return record, True
        return TopicRecord.decode(existing.value, key), False

    async def get_topic(self, name: str) -> TopicRecord | None:
        """The topic's record, ``None`` if it does not exist."""
        key = self.keys.topic(name)
        stored = await self.kv.get(key)
        return None if stored is None else TopicRecord.decode(stored.value, key)

    async def topic_incarnation(self, name: str) -> int | None:
        """The topic's incarnation: its record's etcd create revision (a topic deleted and
        created again gets a larger one), ``None`` if the topic does not exist."""
        stored = await self.kv.get(self.keys.topic(name))
        return None if stored is None else stored.create_revision

    async def list_topics(self, ns: str | None = None) -> list[TopicRecord]:
        """Every topic (of one namespace if given), in name order."""
        head = self.keys.topics_prefix()
        records = []
        for stored in await self.kv.get_prefix(self.keys.topics_prefix(ns)):
            if stored.key[len(head) :].count("/") == 1:  # {ns}/{topic}, not .../owner etc.
                records.append(TopicRecord.decode(stored.value, stored.key))
        return records

    async def delete_topic(self, name: str) -> bool:
        """Delete the topic's record, subscriptions, cursors and owner key in one transaction.

        Its epoch and offset reservation stay, so a re-created topic never reuses an offset.
        Returns whether the topic existed.
        """
        result = await self.kv.txn(
            [],
            [
                Delete(self.keys.topic(name)),
                Delete(self.keys.subscriptions_prefix(name), prefix=True),
                Delete(self.keys.topic_owner(name)),
            ],
        )
        return result.responses[0].deleted > 0

    # subscriptions and cursors

    async def put_subscription(self, record: SubscriptionRecord) -> None:
        """Store (create or replace) the subscription's record."""
        await self.kv.put(self.keys.subscription(record.topic, record.name), record.encode())

    async def get_subscription(self, topic: str, name: str) -> SubscriptionRecord | None:
        """The subscription's record, ``None`` if it does not exist."""
        key = self.keys.subscription(topic, name)
        stored = await self.kv.get(key)
        return None if stored is None else SubscriptionRecord.decode(stored.value, key)

    async def list_subscriptions(self, topic: str) -> list[SubscriptionRecord]:
        """Every subscription of the topic, in name order."""
        head = self.keys.subscriptions_prefix(topic)
        return [
            SubscriptionRecord.decode(stored.value, stored.key)
            for stored in await self.kv.get_prefix(head)
            if "/" not in stored.key[len(head) :]  # the record, not its cursor
        ]

    async def delete_subscription(self, topic: str, name: str) -> bool:
        """Delete the subscription and its cursor; returns whether it existed."""
        result = await self.kv.txn(
            [],
            [
                Delete(self.keys.subscription(topic, name)),
                Delete(self.keys.subscription_cursor(topic, name)),
            ],
        )
        return result.responses[0].deleted > 0

    def cursor_key(self, topic: str, subscription: str) -> str:
        """The key of the subscription's cursor (what ``ProgressUpdater.set`` is given)."""
        return self.keys.subscription_cursor(topic, subscription)

    async def get_cursor(self, topic: str, subscription: str) -> int | None:
        """The subscription's stored cursor, ``None`` if none was stored yet."""
        key = self.cursor_key(topic, subscription)
        stored = await self.kv.get(key)
        return None if stored is None else decode_cursor(stored.value, key)

    async def set_cursor(self, topic: str, subscription: str, offset: int) -> None:
        """Store the cursor directly, unfenced (admin use; owners go through ProgressUpdater)."""
        await self.kv.put(self.cursor_key(topic, subscription), encode_cursor(offset))

    # clients

    async def allocate_client_id(self) -> int:
        """A client id no registration has: random in [1, 2**63), so ids cannot be guessed
        from one another (a caller learns nothing about other callers' ids from its own)."""
        for _ in range(_ALLOCATE_ATTEMPTS):
            client_id = secrets.randbits(63)
            if client_id and await self.kv.get(self.keys.client(client_id)) is None:
                return client_id
        raise MetadataError(f"no free client id in {_ALLOCATE_ATTEMPTS} random draws")

    async def claim_producer_id(self, producer_id: int, principal: str) -> str:
        """Bind an idempotent batch producer id to ``principal`` unless it is bound already,
        atomically; returns the principal it is bound to."""
        key = self.keys.producer_id_owner(producer_id)
        result = await self.kv.txn(
            [Compare.absent(key)], [Put(key, principal.encode())], [Get(key)]
        )
        existing = result.kv(0)
        if result.succeeded or existing is None:
            return principal
        return existing.value.decode()

    async def put_client(self, record: ClientRecord) -> None:
        """Store (create or replace) a client registration and its name index, atomically."""
        await self.kv.txn(
            [],
            [
                Put(self.keys.client(record.client_id), record.encode()),
                Put(self._name_key(record), str(record.client_id).encode()),
            ],
        )

    def _name_key(self, record: ClientRecord) -> str:
        sub = record.subscription if record.kind == "consumer" else None
        return self.keys.client_name(record.topic, record.name, sub)

    async def _by_name(self, key: str) -> ClientRecord | None:
        stored = await self.kv.get(key)
        if stored is None:
            return None
        try:
            client_id = int(stored.value)
        except ValueError as exc:
            raise MetadataError(f"malformed client index at {key}: {stored.value!r}") from exc
        return await self.get_client(client_id)

    async def get_client(self, client_id: int) -> ClientRecord | None:
        """A client registration, ``None`` if there is none."""
        key = self.keys.client(client_id)
        stored = await self.kv.get(key)
        return None if stored is None else ClientRecord.decode(stored.value, key)

    async def delete_client(self, client_id: int) -> bool:
        """Delete a client registration (and its name index); returns whether it existed."""
        record = await self.get_client(client_id)
        if record is None:
            return False
        key = self._name_key(record)
        await self.kv.txn(
            [Compare.value_is(key, str(client_id).encode())],
            [Delete(self.keys.client(client_id)), Delete(key)],
            [Delete(self.keys.client(client_id))],
        )
        return True

    async def list_clients(self) -> list[ClientRecord]:
        """Every client registration."""
        next_id = self.keys.clients_next_id()
        return [
            ClientRecord.decode(stored.value, stored.key)
            for stored in await self.kv.get_prefix(self.keys.clients_prefix())
            if stored.key != next_id
        ]

    async def find_producer(self, topic: str, name: str) -> ClientRecord | None:
        """The registration of the producer ``name`` on ``topic``, if any (two reads)."""
        record = await self._by_name(self.keys.client_name(topic, name))
        if record is None or record.kind != "producer" or record.topic != topic:
            return None
        return record if record.name == name else None

    async def find_consumer(self, topic: str, subscription: str, name: str) -> ClientRecord | None:
        """The registration of consumer ``name`` of ``subscription`` on ``topic``, if any."""
        record = await self._by_name(self.keys.client_name(topic, name, subscription))
        if record is None or record.kind != "consumer" or record.topic != topic:
            return None
        return record if (record.subscription, record.name) == (subscription, name) else None
