"""The topic clock record: encoding, validation, reading (MemoryKV and real etcd share the KV
contract, so one backend suffices here)."""

from __future__ import annotations

import pytest

from danube_ingest.metadata.clock import TopicClock, read_clock
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import MemoryKV


async def test_round_trip_and_absent() -> None:
    kv, keys = MemoryKV(), Keys("/t")
    assert await read_clock(kv, keys, "/default/a") is None
    clock = TopicClock(offset=42, ingest_ms=1_700_000_000_000, broker="b1", epoch=3)
    await kv.put(keys.topic_clock("/default/a"), clock.encode())
    assert await read_clock(kv, keys, "/default/a") == clock
    assert keys.topic_clock("/default/a") == "/t/storage/topics/default/a/clock"


def test_complete_means_the_interval_ends_at_or_before_the_clock() -> None:
    clock = TopicClock(offset=10, ingest_ms=3_600_000)
    assert clock.complete(3_600_000)
    assert not clock.complete(3_600_001)


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b"{",
        b'{"offset": 1}',
        b'{"offset": -1, "ingest_ms": 0}',
        b'{"offset": true, "ingest_ms": 0}',
    ],
)
async def test_malformed_clock_names_its_key(raw: bytes) -> None:
    kv, keys = MemoryKV(), Keys("/t")
    await kv.put(keys.topic_clock("/default/a"), raw)
    with pytest.raises(MetadataError, match="/t/storage/topics/default/a/clock"):
        await read_clock(kv, keys, "/default/a")
