"""The key layout."""

from __future__ import annotations

import pytest

from danube_ingest.metadata import InvalidNameError, Keys, split_topic


def test_every_key_of_the_layout() -> None:
    k = Keys()
    t = "/default/orders"
    assert k.broker("b1") == "/danube/brokers/b1"
    assert k.topic(t) == "/danube/topics/default/orders"
    assert k.topic_owner(t) == "/danube/topics/default/orders/owner"
    assert k.topic_epoch(t) == "/danube/topics/default/orders/epoch"
    assert k.topic_offsets(t) == "/danube/topics/default/orders/offsets"
    assert k.topics_prefix() == "/danube/topics/"
    assert k.topics_prefix("default") == "/danube/topics/default/"
    assert k.subscription(t, "s") == "/danube/subscriptions/default/orders/s"
    assert k.subscription_cursor(t, "s") == "/danube/subscriptions/default/orders/s/cursor"
    assert k.client(7) == "/danube/clients/7"
    assert k.clients_next_id() == "/danube/clients/next_id"
    assert k.schemas_prefix() == "/danube/schemas/"
    assert k.wal_floor("b1", "r0", t) == "/danube/wal/b1/r0/floor/default/orders"
    assert k.storage_object(t, 42) == (
        "/danube/storage/topics/default/orders/objects/00000000000000000042"
    )
    assert k.storage_jump(t, 42) == (
        "/danube/storage/topics/default/orders/jumps/00000000000000000042"
    )
    assert k.tables_prefix(t) == "/danube/tables/default/orders/"


def test_prefix_is_normalised_and_checked() -> None:
    assert Keys("/x/").broker("b") == "/x/brokers/b"
    with pytest.raises(InvalidNameError):
        Keys("danube")


@pytest.mark.parametrize(
    "name", ["orders", "/orders", "/a/b/c", "//orders", "/a/", "/a b/c", "/a/b\n", "/./x"]
)
def test_bad_topic_names_are_rejected(name: str) -> None:
    with pytest.raises(InvalidNameError, match="invalid"):
        split_topic(name)


def test_topic_names_split() -> None:
    assert split_topic("/default/my-topic_1.v2") == ("default", "my-topic_1.v2")


def test_other_segments_are_checked() -> None:
    k = Keys()
    with pytest.raises(InvalidNameError):
        k.broker("a/b")
    with pytest.raises(InvalidNameError):
        k.subscription("/a/b", "s/x")
    with pytest.raises(InvalidNameError):
        k.client(0)
