"""The daemon on the Kafka WAL (``storage.wal.backend: kafka``): SIGKILLed with acknowledged
batches not yet uploaded, its data directory deleted, restarted: every acknowledged message is
served, offsets continue with no gap, and an idempotent producer's re-sent batches are still
recognised (its sequence state lived in the Kafka WAL, not in the deleted directory)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.client import Consumer, Producer, new_producer_id
from danube_ingest.testing import BrokerProcess
from danube_ingest.wal.framing import Entry
from tests.broker.test_batch_restart import TOPIC, batch_request, publish

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.kafka, pytest.mark.timeout(180)]

LEASE_TTL = 4


def _kafka_storage(kafka_server: str, objects: Path) -> dict[str, Any]:
    return {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(objects)},
        # Sealed (and so uploaded) only after the test is over: the tail is only in Kafka.
        "wal": {
            "segment_seconds": 600,
            "segment_bytes": "8MiB",
            "backend": "kafka",
            "kafka": {
                "bootstrap_servers": kafka_server,
                "replication_factor": 1,
                "topic_prefix": f"t{uuid.uuid4().hex[:10]}.",
            },
        },
    }


def _wipe(data_dir: Path, keep: set[str]) -> None:
    """Delete the data directory but the test's own files (config, log)."""
    for path in data_dir.iterdir():
        if path.name in keep:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


async def test_acknowledged_messages_survive_the_loss_of_the_data_directory(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, kafka_server: str
) -> None:
    broker = BrokerProcess(
        tmp_path / "b1",
        etcd_server,
        prefix=etcd_prefix,
        lease_ttl=LEASE_TTL,
        storage=_kafka_storage(kafka_server, tmp_path / "objects"),
    )
    await asyncio.to_thread(broker.start, 90.0)
    pid = new_producer_id()
    try:
        first = await publish(broker.url, [batch_request(pid, seq) for seq in range(10)])
        assert [(a.code, a.base_offset) for a in first] == [(0, 50 * seq) for seq in range(10)]
        async with Producer(broker.url, TOPIC, max_batch_messages=100) as producer:
            futures = [await producer.send(b"p%d" % i) for i in range(3000)]
            sent = await asyncio.gather(*futures)
        assert sent == list(range(500, 3500))
        assert not list((tmp_path / "objects").rglob("*.bin")), "nothing uploaded yet"

        broker.kill()
        _wipe(broker.data_dir, {broker.log_path.name, f"{broker.broker_id}.yml"})
        assert not (broker.data_dir / "wal").exists()
        # A new data directory under the same broker id waits out the dead one's registration.
        await asyncio.sleep(LEASE_TTL + 0.5)
        await asyncio.to_thread(broker.start, 90.0)

        again = await publish(broker.url, [batch_request(pid, seq) for seq in (8, 9, 10)])
        assert [(a.code, a.base_offset, a.duplicate) for a in again] == [
            (0, 400, True),
            (0, 450, True),
            (0, 3500, False),
        ]
        async with Consumer(broker.url, TOPIC, "check", start="earliest") as consumer:
            seen: list[Entry] = []
            while len(seen) < 3550:
                delivered = await consumer.receive(timeout=30)
                seen.extend(delivered.entries)
                consumer.ack(delivered)
        assert [e.offset for e in seen] == list(range(3550))
        assert [e.payload for e in seen[500:3500]] == [b"p%d" % i for i in range(3000)]
        assert [e.payload for e in seen[:50]] == [b"0-%d" % i for i in range(50)]
    finally:
        broker.kill()
