"""``danube-ingest topics unload``: two brokers on one etcd and one fs object store; after the
unload the other broker serves the topic, a consumer gets every offset once, and the producer
goes on through the new owner (all through the real danube-client)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import decode_cursor

from .conftest import BrokerFactory
from .support import Clients, offsets, payloads
from .test_admin_cli import run_cli

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

T = "/default/moving"


async def _cursor(kv: EtcdKV, keys: Keys, sub: str) -> int | None:
    stored = await kv.get(keys.subscription_cursor(T, sub))
    return None if stored is None else decode_cursor(stored.value)


async def test_unload_moves_the_topic_with_no_gap_and_no_duplicate(
    make_broker: BrokerFactory,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    shared: dict[str, Any] = {
        "storage.mode": "wal_cloud",
        "storage.cloud.backend": "fs",
        "storage.cloud.root": str(tmp_path / "objects"),
        # Nothing is uploaded on its own during the test: what the next owner reads of the
        # first broker's data, the unload itself sealed and uploaded.
        "storage.wal.segment_seconds": 600,
    }
    first: Broker = await make_broker("broker-1", **shared)
    second: Broker = await make_broker("broker-2", **shared)
    assert first.uploader is not None and first.manager is not None
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    keys = Keys(etcd_prefix)
    async with asyncio.timeout(120), Clients(first.url) as clients:
        producer = await clients.producer(T, "p1")
        sub = await clients.consumer(T, "s1", "c1")
        for i in range(20):
            await producer.send(f"m{i}".encode())
        got = await sub.take(20)
        await sub.ack_all(got)
        assert offsets(got) == list(range(20))
        assert first.uploader.stats.ranges == 0
        deadline = time.monotonic() + 15
        while await _cursor(kv, keys, "s1") != 20:
            assert time.monotonic() < deadline, "cursor never reached etcd"
            await asyncio.sleep(0.1)

        started = time.monotonic()
        out = await run_cli(
            capsys, "topics", "unload", T, "--etcd", etcd_server, "--prefix", etcd_prefix
        )
        assert f"topic {T} unloaded from broker-1" in out, out
        assert first.uploader.stats.ranges >= 1  # the WAL tail was committed first
        assert not first.manager.owns(T)

        # The producer and the consumer find the new owner on their own.
        for i in range(20, 40):
            await producer.send(f"m{i}".encode())
        moved = time.monotonic() - started
        got = await sub.take(20, timeout=60)
        await sub.ack_all(got)
        assert offsets(got) == list(range(20, 40)), offsets(got)
        assert payloads(got) == [f"m{i}".encode() for i in range(20, 40)]
        with pytest.raises(AssertionError):
            await sub.take(1, timeout=2.0)  # nothing twice
        assert second.manager is not None and second.manager.owns(T)
        print(f"unload -> 20 publishes acknowledged through the new owner: {moved:.2f}s")

        # The new owner serves every acknowledged offset, the first 20 from the objects the
        # unload uploaded.
        assert second.store is not None
        reader = second.store.create_reader(T, 0)
        seen: list[Any] = []
        async with asyncio.timeout(30):
            while len(seen) < 40:
                seen.extend(await reader.next_batch())
        reader.close()
        assert [e.offset for e in seen[:40]] == list(range(40))
        assert [e.payload for e in seen[:20]] == [f"m{i}".encode() for i in range(20)]
    await kv.close()
