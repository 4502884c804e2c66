"""The Kafka backend of the WAL: a region's log in Kafka topics, cached in local files."""

from danube_ingest.wal.kafka.backend import KafkaBackend
from danube_ingest.wal.kafka.settings import KafkaWal, RegionTopics
from danube_ingest.wal.kafka.topics import KafkaWalError

__all__ = ["KafkaBackend", "KafkaWal", "KafkaWalError", "RegionTopics"]
