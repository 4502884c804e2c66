"""The daemon keeps each topic's ingest clock (``storage/topics/{ns}/{topic}/clock``): real
brokers on a real etcd in ``wal_cloud`` mode on an fs object store, the real danube-client.

What the clock promises (``danube_ingest.metadata.clock``) is checked against what really is
there: the clock and the manifest are read in one etcd transaction (one revision), and entries'
ingest times are read back from the broker's store (WAL, and objects below it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.kv import Get
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.wal.framing import Entry

from .conftest import BrokerFactory
from .support import Clients

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

T = "/default/clocked"
#: Seconds between clock passes and between segment seals in these tests (defaults: 10 and 10).
INTERVAL = 0.5
SEGMENT_SECONDS = 1.0
#: Slack for a loaded 2-core machine on top of what the design promises.
SLACK = 5.0


def _cold(objects: Path, **more: Any) -> dict[str, Any]:
    return {
        "storage.mode": "wal_cloud",
        "storage.cloud.backend": "fs",
        "storage.cloud.root": str(objects),
        "storage.wal.segment_seconds": SEGMENT_SECONDS,
        "storage.clock_interval_seconds": INTERVAL,
        **more,
    }


async def _snapshot(kv: EtcdKV, keys: Keys) -> tuple[TopicClock | None, list[ObjectRange]]:
    """The topic's clock and its manifest as of one etcd revision."""
    clock_key = keys.topic_clock(T)
    read = await kv.txn([], [Get(clock_key), Get(keys.storage_objects_prefix(T), prefix=True)])
    stored = read.kv(0)
    clock = None if stored is None else TopicClock.decode(stored.value, clock_key)
    ranges = [ObjectRange.decode(item.value, item.key) for item in read.responses[1].kvs]
    return clock, ranges


async def _entries(broker: Broker) -> list[Entry]:
    """Every entry of the topic the broker can read (objects, then its WAL), with ingest times."""
    assert broker.store is not None
    info = broker.store.info(T)
    assert info is not None
    reader = broker.store.create_reader(T, 0)
    out: list[Entry] = []
    try:
        while reader.position < info.high_watermark:
            out.extend(await asyncio.wait_for(reader.next_batch(), 10))
    finally:
        reader.close()
    return out


class ClockWatch:
    """Polls the clock, checking at every read that it never moved back and that every
    produced offset below its ``offset`` is in the manifest at that same revision."""

    def __init__(self, kv: EtcdKV, keys: Keys) -> None:
        self.kv = kv
        self.keys = keys
        self.seen: list[TopicClock] = []
        self.produced: set[int] = set()

    async def read(self) -> TopicClock | None:
        clock, ranges = await _snapshot(self.kv, self.keys)
        if clock is None:
            assert not self.seen, "the clock disappeared"
            return None
        if self.seen:
            last = self.seen[-1]
            assert clock.offset >= last.offset and clock.ingest_ms >= last.ingest_ms, (
                last,
                clock,
            )
        self.seen.append(clock)
        missing = [
            o
            for o in sorted(self.produced)
            if o < clock.offset and not any(r.start_offset <= o < r.end_offset for r in ranges)
        ]
        assert not missing, f"clock {clock} claims offsets {missing} not in the manifest"
        return clock

    async def until(self, done: Any, timeout: float, what: str) -> TopicClock:
        deadline = time.monotonic() + timeout
        while True:
            clock = await self.read()
            if clock is not None and done(clock):
                return clock
            assert time.monotonic() < deadline, f"clock never {what}: {clock}"
            await asyncio.sleep(0.05)

    def check_lower_bound(self, entries: list[Entry]) -> None:
        """Every entry at or above a clock's offset was ingested at or after its time."""
        for clock in self.seen:
            early = [
                (e.offset, e.ingest_ms)
                for e in entries
                if e.offset >= clock.offset and e.ingest_ms < clock.ingest_ms
            ]
            assert not early, f"clock {clock} is not a lower bound of entries {early}"


async def _publish(clients: Clients, n: int, tag: str) -> None:
    producer = await clients.producer(T, f"p-{tag}")
    for i in range(n):
        await producer.send(f"{tag}{i}".encode())


async def test_an_idle_topics_clock_passes_an_instant_through_time_markers(
    make_broker: BrokerFactory, tmp_path: Path, kv: EtcdKV, keys: Keys
) -> None:
    broker: Broker = await make_broker(**_cold(tmp_path / "objects"))
    watch = ClockWatch(kv, keys)
    async with Clients(broker.url) as clients:
        await _publish(clients, 5, "a")
    watch.produced = {e.offset for e in await _entries(broker)}
    # The topic is idle from here on: only time markers can move its clock past this instant.
    instant = int(time.time() * 1000) + 1000
    clock = await watch.until(
        lambda c: c.ingest_ms >= instant, INTERVAL + SEGMENT_SECONDS + 1 + SLACK, "passed"
    )
    late_s = (time.time() * 1000 - instant) / 1000
    assert clock.offset == max(watch.produced) + 1  # everything is uploaded: N is the end
    assert (clock.broker, clock.epoch) == ("broker-1", 1)
    # And it goes on advancing, one pass after another, never back.
    again = await watch.until(
        lambda c: c.ingest_ms >= clock.ingest_ms + 1000, 1 + INTERVAL + SLACK, "advanced"
    )
    assert again.offset == clock.offset
    # New entries are stamped at or after every clock seen.
    async with Clients(broker.url) as clients:
        await _publish(clients, 5, "b")
    entries = await _entries(broker)
    watch.produced = {e.offset for e in entries}
    await watch.until(lambda c: c.offset > max(watch.produced), 10 + SLACK, "covered b")
    watch.check_lower_bound(entries)
    keeper = broker.clock_keeper
    assert keeper is not None
    # One topic: at most one clock write per pass (the etcd write rate is bounded).
    assert 0 < keeper.writes <= keeper.passes + 1, (keeper.writes, keeper.passes)
    print(
        f"idle clock passed the instant {late_s:.2f}s after it; "
        f"{keeper.writes} clock writes in {keeper.passes} passes"
    )


async def test_offsets_not_uploaded_keep_the_clock_behind_them(
    make_broker: BrokerFactory, tmp_path: Path, kv: EtcdKV, keys: Keys
) -> None:
    # Segments seal only after a minute here: what is published stays in the active segment.
    broker: Broker = await make_broker(
        **_cold(tmp_path / "objects", **{"storage.wal.segment_seconds": 60})
    )
    assert broker.store is not None and broker.clock_keeper is not None
    watch = ClockWatch(kv, keys)
    async with Clients(broker.url) as clients:
        await _publish(clients, 3, "a")
    entries = await _entries(broker)
    watch.produced = {e.offset for e in entries}
    first = entries[0]
    # Several passes: time markers are staged and made durable, but not uploaded.
    passes = broker.clock_keeper.passes
    deadline = time.monotonic() + 10 * INTERVAL + SLACK
    while broker.clock_keeper.passes < passes + 4:
        assert time.monotonic() < deadline, "the clock keeper does not run"
        await watch.read()
        await asyncio.sleep(0.05)
    clock = await watch.read()
    # An interval ending after the first entry's time is not complete: that entry is not in
    # the manifest (the clock may have been written before it, at offset 0).
    assert clock is None or (clock.offset <= first.offset and clock.ingest_ms <= first.ingest_ms)
    # Once the segment is sealed and uploaded, the clock moves past all of them.
    broker.store.regions[0].rotate()
    await watch.until(lambda c: c.offset > max(watch.produced), 10 + SLACK, "covered a")
    watch.check_lower_bound(await _entries(broker))


async def test_a_later_owner_never_stamps_below_the_stored_clock(
    make_broker: BrokerFactory, tmp_path: Path, kv: EtcdKV, keys: Keys
) -> None:
    objects = tmp_path / "objects"
    a: Broker = await make_broker("broker-a", **_cold(objects))
    watch = ClockWatch(kv, keys)
    async with Clients(a.url) as clients:
        await _publish(clients, 3, "a")
    watch.produced = {e.offset for e in await _entries(a)}
    clock = await watch.until(lambda c: c.offset > max(watch.produced), 10 + SLACK, "covered a")
    await a.stop()
    # The clock as an earlier owner whose wall clock ran an hour ahead would have left it.
    ahead = TopicClock(clock.offset, int(time.time() * 1000) + 3_600_000, "broker-z", clock.epoch)
    await kv.put(keys.topic_clock(T), ahead.encode())
    watch.seen.append(ahead)

    # Restart: the same broker on its own WAL, whose times are an hour behind the clock.
    restarted: Broker = await make_broker(
        "broker-a2",
        **_cold(
            objects,
            **{
                "broker.data_dir": str(tmp_path / "broker-a"),
                "broker.broker_id": "broker-a",
            },
        ),
    )
    async with Clients(restarted.url) as clients:
        await _publish(clients, 3, "r")
    after_restart = await _entries(restarted)
    watch.produced = {e.offset for e in after_restart}
    await watch.until(lambda c: c.offset > max(watch.produced), 10 + SLACK, "covered r")
    await restarted.stop()

    # Takeover: another broker with its own (empty) WAL, on the same etcd and objects.
    b: Broker = await make_broker("broker-b", **_cold(objects))
    async with Clients(b.url) as clients:
        await _publish(clients, 3, "b")
    entries = await _entries(b)
    assert [e.payload for e in entries][-9:] == [
        *(f"a{i}".encode() for i in range(3)),
        *(f"r{i}".encode() for i in range(3)),
        *(f"b{i}".encode() for i in range(3)),
    ]
    watch.produced = {e.offset for e in entries}
    final = await watch.until(lambda c: c.offset > max(watch.produced), 10 + SLACK, "covered b")
    assert final.broker == "broker-b" and final.ingest_ms >= ahead.ingest_ms
    assert [e.ingest_ms >= ahead.ingest_ms for e in after_restart[3:]] == [True] * 3
    watch.check_lower_bound(after_restart)
    watch.check_lower_bound(entries)
