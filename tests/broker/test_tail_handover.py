"""The previous owner's side of a takeover (``objects.handover``), with one broker in this
process and takeover records written by the test: how it resolves a wait on its tail (recovered
only from the WAL the tail was written to), and its two configured waits: how often it looks
for such records (storage.uploader.handover_check_seconds), and how long a clean shutdown waits
for its WAL tails to be uploaded (storage.uploader.shutdown_upload_seconds).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from danube import DanubeClientBuilder, DispatchStrategy

from danube_ingest.datadir import data_dir_id
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import LOST, PENDING, RECOVERED, Handover, read_handover
from danube_ingest.metadata.jumps import read_jumps
from danube_ingest.metadata.keys import Keys
from danube_ingest.testing import broker_config, running_broker

TOPIC = "/default/timing"


def _config(tmp_path: Path, etcd_server: str, etcd_prefix: str, **uploader: Any) -> Any:
    overrides: dict[str, Any] = {
        "storage.mode": "wal_cloud",
        "storage.cloud.backend": "fs",
        "storage.cloud.root": str(tmp_path / "objects"),
        **{f"storage.uploader.{key}": value for key, value in uploader.items()},
    }
    return broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix, overrides=overrides)


def _awaiting_broker_1(topic: str, wal_id: str | None = None) -> Handover:
    """A takeover record waiting on broker-1's tail of ``topic``, written to the WAL
    ``wal_id``, after ``[0, 100)`` was reserved and nothing committed."""
    return Handover(
        topic=topic,
        previous="broker-1",
        reserved=100,
        committed=0,
        owner="other",
        epoch=1,
        previous_wal_id=wal_id,
    )


async def _resolved(kv: EtcdKV, keys: Keys, topic: str) -> Handover:
    async with asyncio.timeout(20):
        while True:
            found = await read_handover(kv, keys, topic)
            assert found is not None
            if found[0].state != PENDING:
                return found[0]
            await asyncio.sleep(0.05)


async def _state(kv: EtcdKV, keys: Keys, topic: str) -> str:
    found = await read_handover(kv, keys, topic)
    assert found is not None
    return found[0].state


async def test_a_wait_is_recovered_only_from_the_wal_the_tail_was_written_to(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, kv: EtcdKV, keys: Keys
) -> None:
    config = _config(tmp_path, etcd_server, etcd_prefix)
    config.wal_dir().mkdir(parents=True)
    wal_id = data_dir_id(config.wal_dir())  # the broker finds it as its WAL's identity
    same, other, unknown = f"{TOPIC}-same", f"{TOPIC}-other", f"{TOPIC}-unknown"
    for topic, written_to in ((same, wal_id), (other, "a-wiped-wal"), (unknown, None)):
        await kv.put(keys.handover(topic), _awaiting_broker_1(topic, written_to).encode())
    async with asyncio.timeout(30), running_broker(config):
        # Its own WAL, holding no entry of the topic: the tail was uploaded and its segments
        # retired, so the manifest's end (0) is the exact end.
        done = await _resolved(kv, keys, same)
        assert (done.state, done.end) == (RECOVERED, 0)
        # Another WAL (the disk was wiped or replaced): offsets up to 100 may have been
        # acknowledged and are gone; the new owner continues at 100 after a recorded jump.
        done = await _resolved(kv, keys, other)
        assert (done.state, done.end, done.lost_offsets) == (LOST, 100, 100)
        [jump] = await read_jumps(kv, keys, other)
        assert (jump.start, jump.end, jump.broker, jump.reason) == (0, 100, "broker-1", "lost")
        # A record written before WALs were named: treated as this WAL's, as before.
        done = await _resolved(kv, keys, unknown)
        assert (done.state, done.end) == (RECOVERED, 0)
    assert await read_jumps(kv, keys, same) == []


async def test_takeover_records_are_looked_for_at_the_configured_interval(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, kv: EtcdKV, keys: Keys
) -> None:
    early, late = f"{TOPIC}-early", f"{TOPIC}-late"
    await kv.put(keys.handover(early), _awaiting_broker_1(early).encode())
    config = _config(tmp_path, etcd_server, etcd_prefix, handover_check_seconds=30)
    async with asyncio.timeout(30), running_broker(config):
        # A start looks at once: the record found then is resolved.
        while await _state(kv, keys, early) != RECOVERED:
            await asyncio.sleep(0.05)
        # One recorded after that look is noticed at the next one only, 30 s away.
        await kv.put(keys.handover(late), _awaiting_broker_1(late).encode())
        await asyncio.sleep(2.5)
        assert await _state(kv, keys, late) == PENDING


async def test_a_clean_shutdown_waits_for_uploads_at_most_the_configured_time(
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
    kv: EtcdKV,
    keys: Keys,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="danube_ingest.broker.topics")
    config = _config(tmp_path, etcd_server, etcd_prefix, shutdown_upload_seconds=0)
    async with asyncio.timeout(30), running_broker(config) as broker:
        client = await DanubeClientBuilder().service_url(broker.url).build()
        producer = (
            client.new_producer()
            .with_topic(TOPIC)
            .with_name("p1")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .build()
        )
        await producer.create()
        for i in range(5):
            await producer.send(f"m{i}".encode())
        await producer.close()
    # Not waited for: the tail is left to this broker's restart, the reservation is its block
    # (a wait of the default 10 s would have handed the exact end, 5, over).
    stored = await kv.get(keys.topic_offsets(TOPIC))
    assert stored is not None
    reservation = json.loads(stored.value)
    assert reservation["broker"] == "broker-1" and reservation["reserved"] > 5
    assert "shutdown: WAL tails not committed within 0 s topics=" + TOPIC in caplog.text
