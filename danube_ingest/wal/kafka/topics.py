"""Creating and checking a region's Kafka topics, and reading them back (blocking calls, run
in worker threads).

Refusals, each a ``KafkaWalError`` naming the topic or the setting:

* a replication factor the cluster cannot hold (fewer brokers than replicas) when none was
  configured: set ``storage.wal.kafka.replication_factor`` explicitly to run on fewer;
* a WAL topic with size- or time-based retention (``retention.bytes`` or ``retention.ms`` not
  -1): Kafka would delete acknowledged entries the object store does not hold yet;
* a WAL topic with more than one partition (the region's order is one partition's order).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType  # type: ignore[attr-defined]

from danube_ingest.errors import StorageError
from danube_ingest.wal.kafka.settings import KafkaWal, RegionTopics

log = logging.getLogger(__name__)

#: Seconds an administrative request (create, describe, delete records) may take.
ADMIN_TIMEOUT = 30.0
#: Record key of a data record: (segment seq, byte position), big-endian.
DATA_KEY = struct.Struct(">QQ")
#: Key of the meta topic's records (compaction keeps the latest).
META_KEY = b"region-meta"
#: Header of a meta record: the lowest segment seq still kept (``kept_from``).
KEPT_FROM = "kept_from"


class KafkaWalError(StorageError):
    """The Kafka WAL cannot be used as configured, or Kafka did not answer in time (the message
    names the topic, the setting or the Kafka error)."""


def ensure_topics(settings: KafkaWal, names: RegionTopics) -> None:
    """Create the region's topics if missing; refuse settings that would lose data."""
    admin = AdminClient(settings.common())
    existing = _existing(admin, [names.data, names.meta])
    missing = [name for name in (names.data, names.meta) if name not in existing]
    if missing:
        brokers = _broker_count(admin)
        if settings.replicas > brokers:
            hint = (
                "set storage.wal.kafka.replication_factor explicitly to run on fewer"
                if settings.replication_factor is None
                else "lower storage.wal.kafka.replication_factor or add brokers"
            )
            raise KafkaWalError(
                f"the Kafka cluster at {settings.bootstrap_servers} has {brokers} broker(s), "
                f"fewer than the WAL's replication factor {settings.replicas}: {hint}"
            )
        _create(admin, settings, missing, names)
    _check(admin, [names.data, names.meta])


def _existing(admin: AdminClient, names: list[str]) -> dict[str, int]:
    """Topic -> partition count, of those of ``names`` that exist."""
    try:
        metadata = admin.list_topics(timeout=ADMIN_TIMEOUT)
    except KafkaException as exc:
        raise KafkaWalError(f"Kafka did not answer: {exc.args[0]}") from exc
    found = {}
    for name in names:
        topic = metadata.topics.get(name)
        if topic is not None and topic.error is None:
            found[name] = len(topic.partitions)
    return found


def _broker_count(admin: AdminClient) -> int:
    try:
        return len(admin.describe_cluster(request_timeout=ADMIN_TIMEOUT).result().nodes)
    except KafkaException as exc:
        raise KafkaWalError(f"Kafka did not describe its cluster: {exc.args[0]}") from exc


def _create(
    admin: AdminClient, settings: KafkaWal, missing: list[str], names: RegionTopics
) -> None:
    common = {
        "min.insync.replicas": str(settings.in_sync),
        "retention.ms": "-1",
        "retention.bytes": "-1",
        "unclean.leader.election.enable": "false",
    }
    topics = []
    for name in missing:
        config = dict(common)
        config["cleanup.policy"] = "compact" if name == names.meta else "delete"
        topics.append(NewTopic(name, 1, settings.replicas, config=config))
    for name, future in admin.create_topics(topics, request_timeout=ADMIN_TIMEOUT).items():
        try:
            future.result()
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # another process of this WAL made it meanwhile
            raise KafkaWalError(f"could not create WAL topic {name}: {exc.args[0]}") from exc
        log.info(
            "kafka wal topic created topic=%s replication_factor=%d min_insync_replicas=%d",
            name,
            settings.replicas,
            settings.in_sync,
        )


def _check(admin: AdminClient, names: list[str]) -> None:
    partitions = _existing(admin, names)
    for name in names:
        if partitions.get(name, 1) != 1:
            raise KafkaWalError(
                f"WAL topic {name} has {partitions[name]} partitions; a region's log is one "
                "partition (delete the topic or choose another storage.wal.kafka.topic_prefix)"
            )
    for name in names:
        config = _topic_config(admin, name)
        for key in ("retention.ms", "retention.bytes"):
            entry = config.get(key)
            if entry is not None and entry.value not in (None, "-1"):
                raise KafkaWalError(
                    f"WAL topic {name} has {key}={entry.value}: Kafka would delete "
                    "acknowledged entries before they are uploaded. Set it to -1 (the WAL "
                    "deletes what is uploaded and committed itself)"
                )


def _topic_config(admin: AdminClient, name: str) -> dict[str, Any]:
    """The topic's configuration; a topic just created may be unknown to the broker asked for
    a moment (its metadata is still spreading through the cluster): asked again then."""
    deadline = time.monotonic() + ADMIN_TIMEOUT
    while True:
        resource = ConfigResource(ResourceType.TOPIC, name)
        future = admin.describe_configs([resource], request_timeout=ADMIN_TIMEOUT)[resource]
        try:
            config: dict[str, Any] = future.result()
            return config
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART or time.monotonic() > deadline:
                raise KafkaWalError(
                    f"could not read the configuration of WAL topic {name}: {error}"
                ) from exc
            time.sleep(0.2)


def delete_below(settings: KafkaWal, topic: str, offset: int) -> None:
    """Kafka's DeleteRecords: remove the records of ``topic`` below ``offset``."""
    admin = AdminClient(settings.common())
    futures = admin.delete_records(
        [TopicPartition(topic, 0, offset)], request_timeout=ADMIN_TIMEOUT
    )
    for future in futures.values():
        try:
            future.result()
        except KafkaException as exc:
            raise KafkaWalError(
                f"DeleteRecords below {offset} on {topic} failed: {exc.args[0]}"
            ) from exc


def read_topic(settings: KafkaWal, topic: str, *, group: str) -> Iterator[Any]:
    """Every committed record of partition 0 of ``topic``, from its low watermark to its end
    (as ``confluent_kafka.Message``). Records of aborted transactions are skipped (a fenced
    writer's writes never count); the end is the last stable offset, so call this after the
    region's producer was initialised (which ends the previous writer's open transaction)."""
    consumer = Consumer(
        {
            **settings.common(),
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    try:
        try:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, 0), timeout=ADMIN_TIMEOUT
            )
        except KafkaException as exc:
            raise KafkaWalError(f"could not read the extent of {topic}: {exc.args[0]}") from exc
        if high <= low:
            return
        consumer.assign([TopicPartition(topic, 0, low)])
        idle = 0.0
        while True:
            message = consumer.poll(1.0)
            if message is None:
                idle += 1.0
                if idle >= ADMIN_TIMEOUT:
                    raise KafkaWalError(f"reading {topic} stalled for {ADMIN_TIMEOUT:.0f} s")
                continue
            idle = 0.0
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return
                raise KafkaWalError(f"reading {topic} failed: {error}")
            yield message
    finally:
        consumer.close()
