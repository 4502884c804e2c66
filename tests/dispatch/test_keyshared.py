"""The consistent hash ring and key filters."""

from __future__ import annotations

from collections import Counter

import pytest

from danube_ingest.dispatch import HashRing, KeyFilter, routing_key_of
from danube_ingest.wal import Entry

KEYS = [f"key-{i}" for i in range(2000)]


def assignment(ring: HashRing) -> dict[str, int | None]:
    return {key: ring.lookup(key) for key in KEYS}


def test_mapping_is_deterministic_and_independent_of_attach_order() -> None:
    forward, backward = HashRing(), HashRing()
    for consumer_id in range(5):
        forward.add(consumer_id)
    for consumer_id in reversed(range(5)):
        backward.add(consumer_id)
    assert assignment(forward) == assignment(backward)
    counts = Counter(assignment(forward).values())
    assert set(counts) == set(range(5))
    assert max(counts.values()) < 2 * len(KEYS) / 5  # no consumer gets twice its share


def test_a_joining_consumer_takes_about_its_share_and_nothing_else_moves() -> None:
    ring = HashRing()
    for consumer_id in range(4):
        ring.add(consumer_id)
    before = assignment(ring)
    ring.add(4)
    after = assignment(ring)
    moved = [key for key in KEYS if before[key] != after[key]]
    assert all(after[key] == 4 for key in moved)
    assert 0.1 * len(KEYS) < len(moved) < 0.3 * len(KEYS)

    ring.remove(4)
    assert assignment(ring) == before
    ring.remove(2)
    without_2 = assignment(ring)
    assert all(without_2[k] == before[k] for k in KEYS if before[k] != 2)
    assert 2 not in without_2.values()


def test_filters_restrict_keys_and_nobody_may_accept() -> None:
    ring = HashRing()
    ring.add(1, KeyFilter(["order-*"]))
    ring.add(2, KeyFilter(["user-?", "user-[xy]*"]))
    assert ring.lookup("order-17") == 1
    assert ring.lookup("user-1") == 2
    assert ring.lookup("user-yes") == 2
    assert ring.lookup("user-10") is None
    assert ring.lookup("Order-17") is None  # case-sensitive
    assert ring.lookup("anything") is None
    ring.add(3)
    assert ring.lookup("anything") == 3
    assert ring.lookup("order-17") in (1, 3)


def test_key_filter_semantics() -> None:
    assert KeyFilter().accepts_all and KeyFilter().matches("x")
    f = KeyFilter(["eu-*-order", "us-?"])
    assert f.matches("eu-west-1-order")
    assert not f.matches("eu-west-1-payment")
    assert f.matches("us-a") and not f.matches("us-ab")
    assert KeyFilter(["a.b"]).matches("a.b") and not KeyFilter(["a.b"]).matches("axb")


def test_routing_key_falls_back_to_producer_name() -> None:
    assert routing_key_of(Entry(b"", routing_key="k", producer_name="p")) == "k"
    assert routing_key_of(Entry(b"", producer_name="p")) == "p"
    assert routing_key_of(Entry(b"", routing_key="", producer_name="p")) == "p"


def test_empty_ring_and_bad_size() -> None:
    assert HashRing().lookup("k") is None
    with pytest.raises(ValueError):
        HashRing(0)
