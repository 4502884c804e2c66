"""Every metadata key, in one place. Values are JSON unless stated otherwise.

Below the prefix (default ``/danube``); ``{ns}/{topic}`` comes from a topic name ``/ns/topic``::

    brokers/{id}                                   {url, started_ms}; under the broker's lease
    topics/{ns}/{topic}                            TopicRecord
    topics/{ns}/{topic}/owner                      {broker, url, epoch}; under the owner's lease
    topics/{ns}/{topic}/epoch                      last epoch handed out (int); no lease
    topics/{ns}/{topic}/offsets                    {reserved}: offsets below may have been assigned
    topics/{ns}/{topic}/unload                     {broker, requested_ms}: that broker is asked
                                                   to hand the topic over; under a short lease
    subscriptions/{ns}/{topic}/{sub}               SubscriptionRecord
    subscriptions/{ns}/{topic}/{sub}/cursor        every offset below it is acked (int)
    clients/{id}                                   ClientRecord
    clients/next_id                                next client id (written by earlier versions)
    producer-ids/{id}                              principal using an idempotent batch producer
                                                   id (text; auth on)
    schemas/...                                    schema registry
    wal/{broker}/{region}/floor/{ns}/{topic}       prune mark
    storage/topics/{ns}/{topic}/objects/{start:020}  manifest entry
    storage/topics/{ns}/{topic}/clock              ingest clock (offset, ingest_ms)
    storage/topics/{ns}/{topic}/floor              {offset, expired_ms, reason}: retention
                                                   removed every range below offset
    storage/topics/{ns}/{topic}/jumps/{from:020}   {from, to, epoch, broker, reason, at_ms}:
                                                   an owner skipped offsets [from, to)
    storage/topics/{ns}/{topic}/durable/{broker}   {end, epoch, at_ms}: the broker's WAL
                                                   durable end, recorded each second
                                                   (metadata.durable)
    storage/retired/{object key}                   {object_key, retired_ms}: an object a
                                                   manifest change stopped naming
    handovers/{ns}/{topic}                         Handover: a new owner waits for the
                                                   previous owner's tail (metadata.handover)
    forgotten/{id}                                 {at_ms}: broker declared lost (brokers forget)
                                                   until it starts again
    cluster/id                                     the cluster id (str; objects.cluster)
    policies/{ns}                                  RetentionPolicy of a namespace
    policies/{ns}/{topic}                          RetentionPolicy of a topic (over its ns's)
    compaction/samples                             [[ms, revision], ...]: etcd revisions seen
                                                   by the compaction job, oldest first
    revision_holds/{name}                          {revision, holder}: keep etcd history from
                                                   revision on (under the holder's lease)
    tables/{ns}/{topic}/...                        Parquet frontiers and renditions

A name segment (namespace, topic, subscription, broker id, region) is 1 to 255 characters
without ``/``, whitespace or control characters, so every key parses back unambiguously.
"""

from __future__ import annotations

import re
from urllib.parse import quote

from danube_ingest.metadata.errors import InvalidNameError

_SEGMENT = re.compile(r"[^/\s\x00-\x1f\x7f]{1,255}")


def check_segment(value: str, what: str) -> str:
    """Return ``value`` if it can be one key segment, else raise ``InvalidNameError``."""
    if not isinstance(value, str) or not _SEGMENT.fullmatch(value) or value in (".", ".."):
        raise InvalidNameError(
            f"invalid {what} {value!r}: use 1-255 characters without '/', spaces or controls"
        )
    return value


def split_topic(name: str) -> tuple[str, str]:
    """``"/ns/topic"`` → ``("ns", "topic")``; ``InvalidNameError`` for any other shape (or a
    value that is not a string, as a decoded record may hold)."""
    parts = name.split("/") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] != "":
        raise InvalidNameError(f"invalid topic name {name!r}: expected '/namespace/topic'")
    return check_segment(parts[1], "namespace"), check_segment(parts[2], "topic")


class Keys:
    """Builds the keys of one deployment, all below ``prefix``."""

    def __init__(self, prefix: str = "/danube") -> None:
        prefix = prefix.rstrip("/")
        if not prefix.startswith("/"):
            raise InvalidNameError(f"invalid key prefix {prefix!r}: it must start with '/'")
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"Keys({self.prefix!r})"

    def _topic_path(self, topic: str) -> str:
        ns, name = split_topic(topic)
        return f"{ns}/{name}"

    # brokers

    def brokers_prefix(self) -> str:
        """Prefix of every broker registration."""
        return f"{self.prefix}/brokers/"

    def broker(self, broker_id: str) -> str:
        """A broker's registration ``{url, started_ms}``, under its session lease."""
        return f"{self.brokers_prefix()}{check_segment(broker_id, 'broker id')}"

    # topics

    def topics_prefix(self, ns: str | None = None) -> str:
        """Prefix of every topic key, or of one namespace's."""
        if ns is None:
            return f"{self.prefix}/topics/"
        return f"{self.prefix}/topics/{check_segment(ns, 'namespace')}/"

    def topic(self, topic: str) -> str:
        """The topic's ``TopicRecord``."""
        return f"{self.prefix}/topics/{self._topic_path(topic)}"

    def topic_owner(self, topic: str) -> str:
        """The topic's owner ``{broker, url, epoch}``, under the owner's lease."""
        return f"{self.topic(topic)}/owner"

    def topic_epoch(self, topic: str) -> str:
        """The last ownership epoch handed out for the topic (no lease, never decreases)."""
        return f"{self.topic(topic)}/epoch"

    def topic_unload(self, topic: str) -> str:
        """An unload request ``{broker, requested_ms}`` (``topics unload``), under a short
        lease: the named broker hands the topic over and does not take it back meanwhile."""
        return f"{self.topic(topic)}/unload"

    def topic_offsets(self, topic: str) -> str:
        """The topic's offset reservation ``{reserved}``."""
        return f"{self.topic(topic)}/offsets"

    # subscriptions

    def subscriptions_prefix(self, topic: str) -> str:
        """Prefix of every subscription of the topic (records and cursors)."""
        return f"{self.prefix}/subscriptions/{self._topic_path(topic)}/"

    def subscription(self, topic: str, subscription: str) -> str:
        """The subscription's ``SubscriptionRecord``."""
        sub = check_segment(subscription, "subscription name")
        return f"{self.subscriptions_prefix(topic)}{sub}"

    def subscription_cursor(self, topic: str, subscription: str) -> str:
        """The subscription's cursor: every offset below it is acked."""
        return f"{self.subscription(topic, subscription)}/cursor"

    # clients

    def clients_prefix(self) -> str:
        """Prefix of every client registration (and of ``clients/next_id``)."""
        return f"{self.prefix}/clients/"

    def client(self, client_id: int) -> str:
        """A persisted producer or consumer registration."""
        if client_id < 1:
            raise InvalidNameError(f"invalid client id {client_id}: ids start at 1")
        return f"{self.clients_prefix()}{client_id}"

    def producer_id_owner(self, producer_id: int) -> str:
        """The principal an idempotent batch producer id is bound to (``auth.enabled``)."""
        return f"{self.prefix}/producer-ids/{producer_id}"

    def clients_next_id(self) -> str:
        """Where earlier versions kept the next client id (ids are random now): skipped when
        listing registrations."""
        return f"{self.clients_prefix()}next_id"

    def client_name(self, topic: str, name: str, subscription: str | None = None) -> str:
        """Index from a producer name (or a subscription's consumer name) to its client id, so
        a re-registering client is found without scanning every registration. Names are
        percent-quoted: clients may use any characters."""
        path = self._topic_path(topic)
        quoted = quote(name, safe="")
        if subscription is None:
            return f"{self.prefix}/client-names/{path}/producer/{quoted}"
        return f"{self.prefix}/client-names/{path}/consumer/{quote(subscription, safe='')}/{quoted}"

    # schemas, storage, WAL marks, tables

    def schemas_prefix(self) -> str:
        """Prefix of the schema registry's keys (laid out by ``danube_ingest.schema``)."""
        return f"{self.prefix}/schemas/"

    def wal_floor(self, broker_id: str, region: str, topic: str) -> str:
        """The prune mark of a topic in one broker's WAL region."""
        return f"{self.wal_floors_prefix(broker_id, region)}{self._topic_path(topic)}"

    def wal_floors_prefix(self, broker_id: str, region: str) -> str:
        """Prefix of every prune mark of one broker's WAL region."""
        broker = check_segment(broker_id, "broker id")
        return f"{self.prefix}/wal/{broker}/{check_segment(region, 'region')}/floor/"

    def storage_objects_prefix(self, topic: str) -> str:
        """Prefix of the topic's manifest entries (in offset order: the keys are zero-padded)."""
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/objects/"

    def storage_object(self, topic: str, start_offset: int) -> str:
        """The manifest entry of the object holding the topic's range from ``start_offset``."""
        if start_offset < 0:
            raise InvalidNameError(f"invalid start offset {start_offset} for {topic}")
        return f"{self.storage_objects_prefix(topic)}{start_offset:020d}"

    def topic_clock(self, topic: str) -> str:
        """The topic's ingest clock: offsets committed to the manifest and the time after them."""
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/clock"

    def storage_topic_prefix(self, topic: str) -> str:
        """Prefix of everything the cold path keeps of a topic (manifest, clock, floor...)."""
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/"

    def topic_floor(self, topic: str) -> str:
        """The topic's retained floor: retention removed every manifest range below it."""
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/floor"

    def producers(self, topic: str) -> str:
        """The idempotent producer table handed over with the topic (``metadata.producers``)."""
        return f"{self.storage_topic_prefix(topic)}producers"

    def storage_jumps_prefix(self, topic: str) -> str:
        """Prefix of the topic's recorded offset jumps (in offset order: zero-padded keys)."""
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/jumps/"

    def storage_jump(self, topic: str, start_offset: int) -> str:
        """The offset jump of the topic starting at ``start_offset`` (``OffsetJump``)."""
        if start_offset < 0:
            raise InvalidNameError(f"invalid jump offset {start_offset} for {topic}")
        return f"{self.storage_jumps_prefix(topic)}{start_offset:020d}"

    def storage_durable_end(self, topic: str, broker_id: str) -> str:
        """``broker_id``'s recorded durable end of the topic (``metadata.durable``)."""
        check_segment(broker_id, "broker id")
        return f"{self.prefix}/storage/topics/{self._topic_path(topic)}/durable/{broker_id}"

    def handovers_prefix(self) -> str:
        """Prefix of every topic's takeover record (``metadata.handover``)."""
        return f"{self.prefix}/handovers/"

    def handover(self, topic: str) -> str:
        """The topic's takeover record: which broker's unuploaded tail a new owner waits for."""
        return f"{self.handovers_prefix()}{self._topic_path(topic)}"

    def forgotten_broker(self, broker_id: str) -> str:
        """Set by ``brokers forget``: takeovers from this broker skip its tail at once."""
        return f"{self.prefix}/forgotten/{check_segment(broker_id, 'broker id')}"

    def cluster_id(self) -> str:
        """The cluster id (``metadata.cluster``), written once by the first broker."""
        return f"{self.prefix}/cluster/id"

    def storage_retired_prefix(self) -> str:
        """Prefix of the retirement records (objects a manifest change stopped naming)."""
        return f"{self.prefix}/storage/retired/"

    def storage_retired(self, object_key: str) -> str:
        """The retirement record of an object (its key in the object store, as is)."""
        if not object_key or object_key.startswith("/"):
            raise InvalidNameError(f"invalid object key {object_key!r}")
        return f"{self.storage_retired_prefix()}{object_key}"

    def tables_prefix(self, topic: str) -> str:
        """Prefix of the topic's Parquet frontiers and renditions."""
        return f"{self.prefix}/tables/{self._topic_path(topic)}/"

    # retention policies, etcd compaction

    def policies_prefix(self) -> str:
        """Prefix of every retention policy (namespaces' and topics')."""
        return f"{self.prefix}/policies/"

    def policy(self, scope: str) -> str:
        """The retention policy of ``scope``: a namespace ``/ns`` or a topic ``/ns/topic``."""
        parts = scope.split("/")
        if len(parts) == 2 and parts[0] == "":
            return f"{self.policies_prefix()}{check_segment(parts[1], 'namespace')}"
        if len(parts) == 3 and parts[0] == "":
            return f"{self.policies_prefix()}{self._topic_path(scope)}"
        raise InvalidNameError(
            f"invalid retention scope {scope!r}: expected '/namespace' or '/namespace/topic'"
        )

    def compaction_samples(self) -> str:
        """The (time, revision) samples the etcd compaction job keeps."""
        return f"{self.prefix}/compaction/samples"

    def revision_holds_prefix(self) -> str:
        """Prefix of the revision holds (readers of old revisions that compaction must keep)."""
        return f"{self.prefix}/revision_holds/"

    def revision_hold(self, name: str) -> str:
        """A revision hold ``{revision, holder}``, under its holder's lease."""
        return f"{self.revision_holds_prefix()}{check_segment(name, 'revision hold name')}"
