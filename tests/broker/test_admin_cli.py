"""``danube-ingest topics``, ``subscriptions`` and ``status`` against a running daemon's etcd
(the commands run in a worker thread: they start their own event loop, as from a shell)."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli import main

from .conftest import BrokerFactory
from .support import Clients, eventually

T = "/default/admin"


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    assert await asyncio.to_thread(main, list(argv)) == 0
    return capsys.readouterr().out


async def test_topics_subscriptions_and_status(
    make_broker: BrokerFactory,
    etcd_server: str,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker: Broker = await make_broker(
        **{"storage.mode": "wal_cloud", "storage.wal.segment_seconds": 0.5}
    )
    etcd = ("--etcd", etcd_server, "--prefix", etcd_prefix)
    async with Clients(broker.url) as clients:
        producer = await clients.producer(T, "p1")
        sub = await clients.consumer(T, "s1", "c1")
        for i in range(5):
            await producer.send(f"m{i}".encode())
        await sub.ack_all(await sub.take(5))
        assert broker.uploader is not None
        await eventually(lambda: broker.uploader.stats.ranges >= 1, "an upload")  # type: ignore[union-attr]
        out = await run_cli(capsys, "topics", *etcd)
        line = next(row for row in out.splitlines() if row.startswith(T))
        assert "reliable" in line and "broker-1 (epoch 1)" in line
        assert line.split()[-1].startswith("0..")  # offsets held in objects

        # The progress updater writes the cursor within about a second.
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            out = await run_cli(capsys, "subscriptions", "--topic", T, *etcd)
            # topic, subscription, type, cursor, lag (the owner's, from its /metrics)
            if any(row.split() == [T, "s1", "Exclusive", "5", "0"] for row in out.splitlines()):
                break
            assert asyncio.get_running_loop().time() < deadline, out
            await asyncio.sleep(0.2)

        out = await run_cli(capsys, "status", *etcd)
        assert "brokers (1 live):" in out and "broker-1" in out
        assert "topics: 1" in out
        assert "clients: 1 producers, 1 consumers registered" in out
        # Nothing was lost: no "up to 0 ... lost" bound beside the counts.
        assert "takeovers: 0 pending, 0 declared lost\n" in out, out


async def test_objects_verify_finds_a_damaged_object(
    make_broker: BrokerFactory,
    etcd_server: str,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker: Broker = await make_broker(
        **{"storage.mode": "wal_cloud", "storage.wal.segment_seconds": 0.5}
    )
    async with Clients(broker.url) as clients:
        producer = await clients.producer(T, "p1")
        for i in range(20):
            await producer.send(f"m{i}".encode())
        assert broker.uploader is not None
        await eventually(lambda: broker.uploader.stats.ranges >= 1, "an upload")  # type: ignore[union-attr]
    argv = (
        "objects",
        "verify",
        "--data-dir",
        str(broker.data_dir),
        "--etcd",
        etcd_server,
        "--prefix",
        etcd_prefix,
        "--deep",
    )
    out = await run_cli(capsys, *argv)
    assert f"topic {T}:" in out and ": ok" in out, out

    # Damage one object on disk: verify says which and exits 1.
    objects = sorted((broker.data_dir / "objects").rglob("*.bin"))
    assert objects
    data = bytearray(objects[0].read_bytes())
    data[20] ^= 0x01
    objects[0].write_bytes(bytes(data))
    capsys.readouterr()
    assert await asyncio.to_thread(main, list(argv)) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and objects[0].name in out and "CRC32C" in out, out
