"""Exceptions raised by danube_ingest.kafka.

::

    DanubeIngestError
     └── KafkaServerError            a local Kafka could not be found, formatted, started or reached
          ├── KafkaJarsMissingError   the project's Kafka jars are not there (run ``make setup``)
          ├── JavaMissingError        no ``java`` to run them with
          └── KafkaPortInUseError     a port the node would listen on is taken by another process

None is retriable: each needs someone to change something first (fetch the jars, install
Java, free or choose the port), or, for a node that failed to start, to read its log.
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class KafkaServerError(DanubeIngestError):
    """A local Kafka node could not be found, formatted, started or reached (the message
    names the node's address and, when it ran, the tail of its log)."""


class KafkaJarsMissingError(KafkaServerError):
    """The folder the Kafka jars should be in has no ``kafka_2.13-*.jar`` (``make setup``
    fetches them with Maven from ``tools/kafka/pom.xml``)."""


class JavaMissingError(KafkaServerError):
    """No ``java`` on ``PATH`` nor under ``$JAVA_HOME/bin``."""


class KafkaPortInUseError(KafkaServerError):
    """The node's client or controller port is taken by another process."""
