"""Producing and reading back records with confluent-kafka, as the Kafka tests do."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition


def durable_producer(bootstrap_servers: str, **config: Any) -> Producer:
    """An idempotent producer acknowledged only by all in-sync replicas (``acks=all``)."""
    return Producer(
        {
            "bootstrap.servers": bootstrap_servers,
            "acks": "all",
            "enable.idempotence": True,
            "log_level": 0,
            **config,
        }
    )


class Acks:
    """Delivery reports of one producer: the values Kafka acknowledged, and the errors."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.errors: list[str] = []

    def __call__(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.errors.append(f"{message.value()!r}: {error}")
        else:
            value = message.value()
            assert isinstance(value, bytes)
            self.values.append(value)


def read_all(bootstrap_servers: str, topic: str, count: int, timeout: float = 30.0) -> list[bytes]:
    """The first ``count`` values of partition 0 of ``topic``, read from its beginning (fewer
    if ``timeout`` seconds pass first)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": "danube-test-reader",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            assert message.error() is None, message.error()
            value = message.value()
            assert isinstance(value, bytes)
            values.append(value)
    finally:
        consumer.close()
    return values
