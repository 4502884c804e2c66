"""Wire messages <-> stored entries (``danube_ingest.broker.convert``): a delivered
``StreamMessage`` carries what was published, with the same field presence whatever the
message held (danube-client reads ``routing_key``, ``schema_id`` and ``schema_version`` as
optional fields)."""

from __future__ import annotations

import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.convert import entry_from_message, message_from_entry

TOPIC = "/default/convert"
BROKER = "http://127.0.0.1:6650"


def _published(**fields: object) -> pb.StreamMessage:
    return pb.StreamMessage(
        request_id=7,
        msg_id=pb.MsgID(producer_id=3, topic_name=TOPIC),
        payload=b"payload",
        publish_time=1_700_000_000_000,
        producer_name="producer",
        **fields,
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"attributes": {"k": "v", "other": ""}},
        {"routing_key": "key-1"},
        {"schema_id": 11, "schema_version": 2},
        {"attributes": {"k": "v"}, "routing_key": "r", "schema_id": 5, "schema_version": 1},
    ],
)
def test_a_delivery_carries_the_published_message(fields: dict[str, object]) -> None:
    entry = entry_from_message(_published(**fields))
    entry.offset = 42

    delivered = message_from_entry(entry, TOPIC, "sub", BROKER)

    expected = pb.StreamMessage(
        request_id=7,
        msg_id=pb.MsgID(producer_id=3, topic_name=TOPIC, broker_addr=BROKER, topic_offset=42),
        payload=b"payload",
        publish_time=1_700_000_000_000,
        producer_name="producer",
        subscription_name="sub",
        attributes=fields.get("attributes", {}),
        schema_id=fields.get("schema_id", 0),
        schema_version=fields.get("schema_version", 0),
        routing_key=fields.get("routing_key", ""),
    )
    assert delivered == expected
    assert delivered.SerializeToString(deterministic=True) == expected.SerializeToString(
        deterministic=True
    )
    # Presence as before: the optional fields are always set, an absent routing key as "".
    assert delivered.HasField("routing_key")
    assert delivered.HasField("schema_id")
    assert delivered.HasField("schema_version")
    assert dict(delivered.attributes) == fields.get("attributes", {})
