"""Recorded offset jumps: fenced by the owner's epoch, read back in order, gaps they cover."""

from __future__ import annotations

import json

import pytest

from danube_ingest.metadata import KV, FencedError, Keys, MetadataError, Put
from danube_ingest.metadata.jumps import OffsetJump, read_jumps, record_jump, uncovered

from .conftest import Broker

TOPIC = "/default/orders"


async def test_only_the_owner_records_a_jump_and_it_reads_back(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    owner = await a.ownership.acquire(TOPIC)
    with pytest.raises(FencedError):
        await record_jump(b.ownership, TOPIC, 10, 110)
    assert await record_jump(a.ownership, TOPIC, 10, 10) is None  # no jump, no write
    assert await read_jumps(kv, keys, TOPIC) == []
    jump = await record_jump(a.ownership, TOPIC, 10, 110)
    assert jump is not None
    stored = await kv.get(keys.storage_jump(TOPIC, 10))
    assert stored is not None
    doc = json.loads(stored.value)
    assert {k: doc[k] for k in ("from", "to", "epoch", "broker", "reason")} == {
        "from": 10,
        "to": 110,
        "epoch": owner.epoch,
        "broker": "a",
        "reason": "reservation",
    }
    await record_jump(a.ownership, TOPIC, 2, 5)
    assert [(j.start, j.end) for j in await read_jumps(kv, keys, TOPIC)] == [(2, 5), (10, 110)]


async def test_a_malformed_record_names_its_key(kv: KV, keys: Keys) -> None:
    key = keys.storage_jump(TOPIC, 7)
    await kv.txn([], [Put(key, b'{"from": 7, "to": 3}')])
    with pytest.raises(MetadataError, match=key):
        await read_jumps(kv, keys, TOPIC)


def _jump(start: int, end: int) -> OffsetJump:
    return OffsetJump(TOPIC, start, end, 1, "a", "reservation", 0)


@pytest.mark.parametrize(
    ("jumps", "left"),
    [
        ([], [(100, 200)]),
        ([(100, 200)], []),
        ([(50, 250)], []),
        ([(100, 150)], [(150, 200)]),
        ([(120, 130), (160, 170)], [(100, 120), (130, 160), (170, 200)]),
        ([(0, 100), (200, 300)], [(100, 200)]),
        ([(100, 150), (140, 200)], []),
    ],
)
def test_uncovered_parts_of_a_gap(
    jumps: list[tuple[int, int]], left: list[tuple[int, int]]
) -> None:
    assert uncovered(100, 200, [_jump(s, e) for s, e in jumps]) == left
