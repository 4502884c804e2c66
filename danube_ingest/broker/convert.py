"""Conversions between Danube's wire messages and stored entries."""

from __future__ import annotations

from typing import Any

from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.wal.framing import Entry


def entry_from_message(msg: Any) -> Entry:
    """The Entry to store for a published ``StreamMessage``.

    proto3 strings have no presence: an empty routing key means none, a zero schema id none.
    """
    return Entry(
        msg.payload,
        publish_ms=msg.publish_time,
        producer_name=msg.producer_name,
        routing_key=msg.routing_key or None,
        attributes=dict(msg.attributes) if msg.attributes else None,
        schema_id=msg.schema_id or None,
        schema_version=msg.schema_version,
        producer_id=msg.msg_id.producer_id,
        request_id=msg.request_id,
    )


def message_from_entry(entry: Entry, topic: str, subscription: str, broker_addr: str) -> Any:
    """The ``StreamMessage`` delivered for a stored entry: the published message with
    ``msg_id.topic_offset`` set to the entry's offset and the producer's ``request_id`` kept.

    Runs once per delivery: the attribute map is filled only when there are attributes
    (``attributes={}`` would cost a third of the construction; the wire bytes are the same).
    """
    message = pb.StreamMessage(
        request_id=entry.request_id,
        msg_id=pb.MsgID(
            producer_id=entry.producer_id,
            topic_name=topic,
            broker_addr=broker_addr,
            topic_offset=entry.offset,
        ),
        payload=entry.payload,
        publish_time=entry.publish_ms,
        producer_name=entry.producer_name,
        subscription_name=subscription,
        schema_id=entry.schema_id or 0,
        schema_version=entry.schema_version,
        routing_key=entry.routing_key or "",
    )
    if entry.attributes:
        message.attributes.update(entry.attributes)
    return message
