"""Records: codecs and CRUD of topics, subscriptions, cursors and clients."""

from __future__ import annotations

import asyncio
import json

import pytest

from danube_ingest.metadata import (
    KV,
    ClientRecord,
    InvalidNameError,
    Keys,
    MetadataError,
    Records,
    SubscriptionRecord,
    TopicRecord,
    decode_cursor,
    encode_cursor,
)


@pytest.fixture
def records(kv: KV, keys: Keys) -> Records:
    return Records(kv, keys)


def test_codecs_round_trip_and_tolerate_unknown_fields() -> None:
    topic = TopicRecord("/ns/t", reliable=False, partitions=3, schema_subject="s", created_ms=5)
    assert TopicRecord.decode(topic.encode()) == topic
    client = ClientRecord(
        7, "consumer", "/ns/t", "c1", subscription="sub", sub_type="KeyShared", key_filters=("a*",)
    )
    assert ClientRecord.decode(client.encode()) == client
    newer = json.loads(topic.encode()) | {"added_in_a_later_version": True}
    assert TopicRecord.decode(json.dumps(newer).encode()) == topic
    with pytest.raises(MetadataError, match="/some/key"):
        TopicRecord.decode(b'{"reliable": true}', "/some/key")  # no name
    with pytest.raises(MetadataError):
        TopicRecord.decode(b"not json")
    with pytest.raises(InvalidNameError):
        TopicRecord("no-namespace")
    with pytest.raises(InvalidNameError):
        ClientRecord(1, "consumer", "/ns/t", "c")  # a consumer needs a subscription


async def test_topics_create_get_list_delete(records: Records, kv: KV, keys: Keys) -> None:
    orders = TopicRecord("/shop/orders")
    assert await records.create_topic_if_absent(orders) == (orders, True)
    conflicting = TopicRecord("/shop/orders", reliable=False)
    assert await records.create_topic_if_absent(conflicting) == (orders, False)  # first wins
    await records.create_topic_if_absent(TopicRecord("/shop/users"))
    await records.create_topic_if_absent(TopicRecord("/other/x"))
    await kv.put(keys.topic_owner("/shop/orders"), b'{"broker":"b","url":"u","epoch":1}')
    await kv.put(keys.topic_epoch("/shop/orders"), b"1")
    assert await records.get_topic("/shop/orders") == orders
    assert await records.get_topic("/shop/none") is None
    assert [t.name for t in await records.list_topics()] == [
        "/other/x",
        "/shop/orders",
        "/shop/users",
    ]
    assert [t.name for t in await records.list_topics("shop")] == ["/shop/orders", "/shop/users"]

    await records.put_subscription(SubscriptionRecord("/shop/orders", "s1", "Shared"))
    await records.set_cursor("/shop/orders", "s1", 42)
    assert await records.delete_topic("/shop/orders")
    assert not await records.delete_topic("/shop/orders")
    assert await records.get_topic("/shop/orders") is None
    assert await records.list_subscriptions("/shop/orders") == []
    assert await records.get_cursor("/shop/orders", "s1") is None
    assert await kv.get(keys.topic_owner("/shop/orders")) is None
    assert await kv.get(keys.topic_epoch("/shop/orders")) is not None  # epochs never restart


async def test_subscriptions_and_cursors(records: Records) -> None:
    t = "/shop/orders"
    s1 = SubscriptionRecord(t, "s1", "Exclusive")
    s2 = SubscriptionRecord(t, "s2", "KeyShared")
    await records.put_subscription(s2)
    await records.put_subscription(s1)
    await records.set_cursor(t, "s1", 10)
    assert await records.get_subscription(t, "s1") == s1
    assert await records.get_subscription(t, "nope") is None
    assert await records.list_subscriptions(t) == [s1, s2]  # cursors are not subscriptions
    assert await records.get_cursor(t, "s1") == 10
    assert records.cursor_key(t, "s1") == records.keys.subscription_cursor(t, "s1")
    assert decode_cursor(encode_cursor(7)) == 7
    assert await records.get_cursor(t, "s2") is None
    assert await records.delete_subscription(t, "s1")
    assert await records.get_cursor(t, "s1") is None
    assert await records.list_subscriptions(t) == [s2]


async def test_client_ids_are_unique_random_and_63_bit(records: Records) -> None:
    ids = await asyncio.gather(*(records.allocate_client_id() for _ in range(50)))
    assert len(set(ids)) == 50
    assert all(0 < i < 2**63 for i in ids)
    # Not sequential (nor guessable from one another): neighbours of an id are not ids.
    assert not {i + 1 for i in ids} & set(ids)
    assert sum(i > 2**40 for i in ids) >= 45


async def test_clients_put_get_find_delete(records: Records) -> None:
    producer = ClientRecord(await records.allocate_client_id(), "producer", "/ns/t", "p1")
    consumer = ClientRecord(
        await records.allocate_client_id(), "consumer", "/ns/t", "c1", "sub", "Shared"
    )
    other = ClientRecord(
        await records.allocate_client_id(), "consumer", "/ns/t", "c1", "other-sub", "Shared"
    )
    for record in (producer, consumer, other):
        await records.put_client(record)
    assert await records.get_client(producer.client_id) == producer
    assert await records.get_client(99) is None
    assert sorted(c.client_id for c in await records.list_clients()) == sorted(
        r.client_id for r in (producer, consumer, other)
    )
    assert await records.find_producer("/ns/t", "p1") == producer
    assert await records.find_producer("/ns/t", "c1") is None
    assert await records.find_consumer("/ns/t", "sub", "c1") == consumer
    assert await records.find_consumer("/ns/t", "other-sub", "c1") == other
    assert await records.find_consumer("/ns/u", "sub", "c1") is None
    assert await records.delete_client(consumer.client_id)
    assert not await records.delete_client(consumer.client_id)
    assert await records.find_consumer("/ns/t", "sub", "c1") is None


async def test_clients_are_found_by_name_through_the_index(records: Records) -> None:
    producer = ClientRecord(
        client_id=await records.allocate_client_id(),
        kind="producer",
        topic="/shop/orders",
        name="odd name/with slash",
    )
    consumer = ClientRecord(
        client_id=await records.allocate_client_id(),
        kind="consumer",
        topic="/shop/orders",
        name="odd name/with slash",
        subscription="sub/1",
        sub_type="Shared",
    )
    await records.put_client(producer)
    await records.put_client(consumer)

    assert await records.find_producer("/shop/orders", "odd name/with slash") == producer
    assert await records.find_consumer("/shop/orders", "sub/1", "odd name/with slash") == consumer
    assert await records.find_producer("/shop/orders", "odd name") is None
    assert await records.find_consumer("/shop/orders", "sub", "odd name/with slash") is None
    assert await records.find_producer("/shop/other", "odd name/with slash") is None

    assert await records.delete_client(producer.client_id)
    assert await records.find_producer("/shop/orders", "odd name/with slash") is None
    assert await records.find_consumer("/shop/orders", "sub/1", "odd name/with slash") == consumer


@pytest.mark.parametrize(
    "value",
    [
        b'{"offset": Infinity}',  # int() raised OverflowError
        b'{"offset": 1e400}',  # the same, through a float that overflows
        b"[" * 100_000,  # json.loads raised RecursionError
    ],
)
def test_cursor_values_json_cannot_hold_raise_metadata_error(value: bytes) -> None:
    """Found by tests/fuzz/test_records.py: these escaped as OverflowError/RecursionError."""
    with pytest.raises(MetadataError, match="cursor at k"):
        decode_cursor(value, "k")


@pytest.mark.parametrize("value", [b'{"name": 0}', b'{"name": ["/a/b"]}', b"[" * 100_000])
def test_topic_record_of_wrong_types_raises_metadata_error(value: bytes) -> None:
    """Found by tests/fuzz/test_records.py: a non-string name raised AttributeError."""
    with pytest.raises(MetadataError):
        TopicRecord.decode(value, "k")
