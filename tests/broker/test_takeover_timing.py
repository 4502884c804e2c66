"""The takeover's two waits are configured, not fixed: how often a broker looks for topics
whose new owner waits for its tail (storage.uploader.handover_check_seconds), and how long a
clean shutdown waits for its WAL tails to be uploaded (storage.uploader.shutdown_upload_seconds).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from danube import DanubeClientBuilder, DispatchStrategy

from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import PENDING, RECOVERED, Handover, read_handover
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


def _awaiting_broker_1(topic: str) -> Handover:
    """A takeover record waiting on broker-1's tail of ``topic`` (its WAL holds nothing of it:
    resolved as recovered at the manifest's end, 0, once broker-1 looks)."""
    return Handover(
        topic=topic, previous="broker-1", reserved=100, committed=0, owner="other", epoch=1
    )


async def _state(kv: EtcdKV, keys: Keys, topic: str) -> str:
    found = await read_handover(kv, keys, topic)
    assert found is not None
    return found[0].state


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
