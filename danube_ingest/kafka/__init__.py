"""A local Apache Kafka (KRaft) run from the project's Maven-fetched jars.

``KafkaServer`` runs one node (broker and controller in one JVM) as a child process: what
``danube-ingest kafka`` runs, and what ``danube_ingest.testing`` starts one or three of.
``kafka`` imports nothing of the broker, the WAL or the metadata layer's clients.
"""

from danube_ingest.kafka.errors import (
    JavaMissingError,
    KafkaJarsMissingError,
    KafkaPortInUseError,
    KafkaServerError,
)
from danube_ingest.kafka.server import (
    DEFAULT_JARS_DIR,
    KafkaServer,
    KafkaVoter,
    new_cluster_id,
    wait_brokers,
)

__all__ = [
    "DEFAULT_JARS_DIR",
    "JavaMissingError",
    "KafkaJarsMissingError",
    "KafkaPortInUseError",
    "KafkaServer",
    "KafkaServerError",
    "KafkaVoter",
    "new_cluster_id",
    "wait_brokers",
]
