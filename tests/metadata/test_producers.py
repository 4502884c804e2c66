"""The handed-over producer table's value (``metadata.producers``): it round-trips, keeps the
most recently used producers and their last batches within its stated bound, and a damaged
value is a ``MetadataError`` naming the key."""

from __future__ import annotations

import pytest

from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import Delete, Put
from danube_ingest.metadata.producers import (
    HANDOVER_MAX_PRODUCERS,
    HANDOVER_WINDOW,
    HandedProducers,
    handover_ops,
)

BIT = 1 << 63


def test_a_table_round_trips() -> None:
    handed = HandedProducers(
        500, 7, "broker-a", {BIT | 1: [(0, 0, 50), (1, 50, 50)], BIT | 2: [(9, 100, 1)]}
    )
    assert HandedProducers.decode(handed.encode(), "k") == handed


def test_the_value_is_bounded_to_the_newest_producers_and_batches() -> None:
    producers = {
        BIT | pid: [(seq, seq * 10, 10) for seq in range(HANDOVER_WINDOW + 5)]
        for pid in range(HANDOVER_MAX_PRODUCERS + 100)
    }
    handed = HandedProducers(10**12, 2**40, "b" * 64, producers)
    data = handed.encode()
    assert len(data) < 700_000  # the bound the module docstring states (etcd: 1.5 MiB)
    back = HandedProducers.decode(data, "k").producers
    assert list(back) == list(producers)[-HANDOVER_MAX_PRODUCERS:]  # least recently used go
    assert all(w == producers[pid][-HANDOVER_WINDOW:] for pid, w in back.items())


def test_a_damaged_value_names_its_key() -> None:
    data = HandedProducers(5, 1, "a", {BIT: [(0, 0, 5)]}).encode()
    for bad in (b"nope", data[:-3], data + b"x"):
        with pytest.raises(MetadataError, match="malformed producer table at /p/k"):
            HandedProducers.decode(bad, "/p/k")


def test_an_empty_table_deletes_an_older_value() -> None:
    keys = Keys("/p")
    key = keys.producers("/default/t")
    assert key == "/p/storage/topics/default/t/producers"
    assert handover_ops(keys, "/default/t", HandedProducers(5, 1, "a", {})) == [Delete(key)]
    [put] = handover_ops(keys, "/default/t", HandedProducers(5, 1, "a", {BIT: [(0, 0, 5)]}))
    assert isinstance(put, Put) and put.key == key
