"""A daemon whose WAL and fs objects share a disk that really fills up (a small tmpfs), driven
over loopback gRPC: a full disk is RESOURCE_EXHAUSTED backpressure, never INTERNAL, and
publishes go through again once space is freed, without a restart."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from danube_ingest.cli import main
from danube_ingest.testing import (
    broker_config,
    fill_filesystem,
    running_broker,
    small_filesystem,
)

from .support import Clients, message, producer_request, raw_stubs

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

MiB = 1 << 20
T = "/default/diskfull"
FLOOR = 4 * MiB


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "disk", 32 * MiB) as path:
        yield path


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def test_full_disk_is_resource_exhausted_and_recovers_once_space_is_freed(
    disk: Path, etcd_server: str, etcd_prefix: str
) -> None:
    ballast = disk / "ballast"
    fill_filesystem(ballast, leave=14 * MiB)
    config = broker_config(
        disk / "data",
        etcd_server,
        prefix=etcd_prefix,
        overrides={
            "storage.mode": "wal_cloud",
            "storage.cloud.backend": "fs",  # objects on the WAL's disk
            "storage.wal.segment_bytes": "256KiB",
            "storage.wal.max_batch_bytes": "256KiB",
            "storage.wal.segment_seconds": 1,
            "storage.wal.retention.max_bytes": "64MiB",
            "storage.wal.retention.min_free_bytes": FLOOR,
            "storage.wal.retention.check_seconds": 0.2,
            "storage.uploader.retry_base_ms": 20,
            "storage.uploader.retry_max_ms": 200,
            "storage.uploader.max_retries": 0,
        },
    )
    sent: dict[int, bytes] = {}
    async with (
        asyncio.timeout(90),
        running_broker(config) as broker,
        Clients(broker.url) as clients,
        raw_stubs(broker.url) as raw,
    ):
        created = await raw.producers.CreateProducer(producer_request(T))
        sub = await clients.consumer(T, "s", "c1")
        # Publish until the disk is full for good: refusals come first while uploads and
        # forced pruning still make room, then every publish is refused.
        refused: list[grpc.aio.AioRpcError] = []
        refused_since: float | None = None
        loop = asyncio.get_running_loop()
        i = 0
        while refused_since is None or loop.time() - refused_since < 2.0:
            payload = os.urandom(64 * 1024)  # incompressible: objects as big as segments
            try:
                await raw.producers.SendMessage(
                    message(created.producer_id, T, payload, request_id=i + 1)
                )
            except grpc.aio.AioRpcError as exc:
                refused.append(exc)
                refused_since = refused_since or loop.time()
                await asyncio.sleep(0.05)
                continue
            refused_since = None
            sent[i] = payload
            i += 1
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, [
            e.details() for e in refused if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
        ]
        assert all("min_free_bytes" in (e.details() or "") for e in refused)
        assert len(sent) > 50
        assert free(disk) > 0
        assert broker.uploader is not None and broker.uploader.stats.segments > 0

        # A danube-client publish rides out the backpressure (it retries
        # RESOURCE_EXHAUSTED) and is acknowledged once the operator frees space.
        producer = await clients.producer(T, "p2")
        blocked = asyncio.ensure_future(producer.send(b"after the disk was freed"))
        await asyncio.sleep(1.0)
        assert not blocked.done()
        ballast.unlink()
        await asyncio.wait_for(blocked, 30)

        # Every acknowledged message is delivered, nothing refused is.
        got = await sub.take(len(sent) + 1, timeout=30)
        assert [m.payload for m in got] == [*sent.values(), b"after the disk was freed"]
        assert [m.msg_id.topic_offset for m in got] == list(range(len(sent) + 1))
        await sub.ack_all(got)
    assert main(["wal", "verify", "--wal-dir", str(disk / "data" / "wal")]) == 0
