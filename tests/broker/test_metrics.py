"""The daemon's HTTP port: every metric the design lists shows a non-zero value after real
traffic (danube-client publishing and consuming, uploads to an fs store that first fail), the
health and readiness probes, and ``status`` built on the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from danube_ingest.broker.errors import ListenError
from danube_ingest.broker.server import Broker
from danube_ingest.cli.admin import Figures, scrape
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.testing import LocalEtcd, broker_config, free_port, running_broker

from .conftest import BrokerFactory
from .support import Clients, eventually, producer_request, raw_stubs, rpc_error
from .test_admin_cli import run_cli
from .test_cold_path import take_acking

T = "/default/metered"

COLD: dict[str, Any] = {
    "storage.mode": "wal_cloud",
    "storage.wal.segment_bytes": "64KiB",
    "storage.wal.segment_seconds": 0.5,
    "storage.uploader.retry_base_ms": 50,
    "storage.uploader.retry_max_ms": 200,
    # A subscription without consumer stops reading ahead after 20 messages, and the cache
    # is small: when it is consumed again it reads what the cache no longer holds.
    "limits.max_unacked_messages": 20,
    "storage.cache.max_bytes": "16KiB",
    "storage.cache.topic_max_bytes": "16KiB",
}

SEND = "/danube.ProducerService/SendMessage"

#: The issue's metrics (as exposed), each with labels its sample must have.
MUST_SHOW: list[tuple[str, dict[str, str]]] = [
    ("danube_ingest_wal_append_seconds_count", {}),
    ("danube_ingest_wal_fsync_seconds_count", {}),
    ("danube_ingest_wal_appended_bytes_total", {}),
    ("danube_ingest_wal_group_messages_sum", {}),
    ("danube_ingest_wal_group_bytes_sum", {}),
    ("danube_ingest_wal_bytes", {}),
    ("danube_ingest_cache_hits_total", {}),
    ("danube_ingest_cache_misses_total", {}),
    ("danube_ingest_upload_bytes_total", {}),
    ("danube_ingest_upload_segments_total", {}),
    ("danube_ingest_upload_seconds_count", {}),
    ("danube_ingest_object_write_seconds_count", {}),
    ("danube_ingest_upload_retries_total", {}),
    ("danube_ingest_manifest_txn_seconds_count", {"op": "commit"}),
    ("danube_ingest_rpc_seconds_count", {"method": SEND, "code": "OK"}),
]
#: Shown while uploads fail and a subscription is behind.
MUST_SHOW_BACKLOG: list[tuple[str, dict[str, str]]] = [
    ("danube_ingest_upload_backlog_segments", {}),
    ("danube_ingest_upload_backlog_bytes", {}),
    ("danube_ingest_subscription_lag_messages", {"topic": T, "subscription": "behind"}),
]


def value(figures: Figures, name: str, labels: dict[str, str]) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v
        for (sample, sample_labels), v in figures.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    )


async def metrics(broker: Broker) -> Figures:
    assert broker.metrics_url is not None
    return await asyncio.to_thread(scrape, f"{broker.metrics_url}/metrics")


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET (no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_every_listed_metric_is_non_zero_after_traffic(
    make_broker: BrokerFactory,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A file where the fs store puts its segment objects: every upload fails (and is
    # retried) until it is removed.
    blocker = tmp_path / "broker-1" / "objects" / "segments"
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"")
    broker: Broker = await make_broker(**COLD)
    assert broker.uploader is not None
    before = await metrics(broker)
    payload = b"x" * 500
    async with Clients(broker.url) as clients:
        producer = await clients.producer(T, "p1")
        live = await clients.consumer(T, "live", "c-live")
        behind = await clients.consumer(T, "behind", "c-behind")
        await behind.consumer.close()
        for _ in range(300):
            await producer.send(payload)
        await take_acking(live, 300)
        await eventually(lambda: broker.uploader.stats.failures >= 2, "failing uploads")  # type: ignore[union-attr]

        during = await metrics(broker)
        for name, labels in MUST_SHOW_BACKLOG:
            assert value(during, name, labels) > 0, (name, labels)
        assert value(during, MUST_SHOW_BACKLOG[2][0], MUST_SHOW_BACKLOG[2][1]) == 300
        assert (
            value(during, "danube_ingest_subscription_lag_messages", {"subscription": "live"}) == 0
        )

        out = await run_cli(capsys, "status", "--etcd", etcd_server, "--prefix", etcd_prefix)
        assert "wal " in out and "upload backlog " in out, out
        lag_rows = [row.split() for row in out.splitlines()]
        assert [T, "behind", "300", "broker-1"] in lag_rows, out
        assert [T, "live", "0", "broker-1"] in lag_rows, out

        blocker.unlink()
        await eventually(lambda: broker.uploader.stats.segments >= 1, "an upload")  # type: ignore[union-attr]
        # The subscription far behind reads from offset 0: older than the cache holds.
        again = await clients.consumer(T, "behind", "c-behind")
        await take_acking(again, 300)
        await eventually(lambda: not broker.uploader.pending(), "all uploads")  # type: ignore[union-attr]

    after = await metrics(broker)
    for name, labels in MUST_SHOW:
        assert value(after, name, labels) > value(before, name, labels), (name, labels)


async def test_rpc_status_codes_are_counted(broker: Broker) -> None:
    before = await metrics(broker)
    async with raw_stubs(broker.url) as stubs:
        bad = await rpc_error(stubs.producers.CreateProducer(producer_request("no-slashes")))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        target = broker.url.removeprefix("http://")
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary("/nobody.Serves/This")(b"")
            assert (await rpc_error(call)).code() == grpc.StatusCode.UNIMPLEMENTED
    after = await metrics(broker)
    create = {"method": "/danube.ProducerService/CreateProducer", "code": "INVALID_ARGUMENT"}
    unknown = {"method": "/nobody.Serves/This", "code": "UNIMPLEMENTED"}
    for labels in (create, unknown):
        name = "danube_ingest_rpc_seconds_count"
        assert value(after, name, labels) == value(before, name, labels) + 1, labels


async def test_health_and_readiness(broker: Broker) -> None:
    url = broker.metrics_url
    assert await asyncio.to_thread(get, f"{url}/healthz") == (200, "ok\n")
    assert await asyncio.to_thread(get, f"{url}/readyz") == (200, "ready\n")
    status, body = await asyncio.to_thread(get, f"{url}/nothing")
    assert status == 404 and "/metrics" in body


@pytest.mark.timeout(60)
async def test_readyz_is_503_until_the_broker_serves(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, kv: EtcdKV
) -> None:
    """While a broker waits at start-up (here for the registration an older version of it
    left in etcd to expire) it is alive but not ready; then ready."""
    port, metrics_port = free_port(), free_port()
    lease = await kv.grant_lease(2)
    await kv.put(
        Keys(etcd_prefix).broker("broker-1"),
        json.dumps({"url": f"http://127.0.0.1:{port}"}).encode(),
        lease=lease,
    )
    config = broker_config(
        tmp_path,
        etcd_server,
        port=port,
        prefix=etcd_prefix,
        overrides={"metrics.listen": f"127.0.0.1:{metrics_port}"},
    )
    broker = Broker(config)
    starting = asyncio.create_task(broker.start())
    url = f"http://127.0.0.1:{metrics_port}"
    try:
        seen: list[tuple[int, str]] = []
        async with asyncio.timeout(20):
            while not starting.done():
                with contextlib.suppress(OSError):
                    seen.append(await asyncio.to_thread(get, f"{url}/readyz"))
                    assert await asyncio.to_thread(get, f"{url}/healthz") == (200, "ok\n")
                await asyncio.sleep(0.05)
        await starting
        assert (503, "not ready: starting: recovering the WAL and registering in etcd\n") in seen
        assert await asyncio.to_thread(get, f"{url}/readyz") == (200, "ready\n")
    finally:
        await broker.stop(grace=1.0)
    with pytest.raises(OSError):  # the port closes with the broker
        await asyncio.to_thread(get, f"{url}/healthz")


async def test_metrics_port_in_use_is_a_clear_error(tmp_path: Path, etcd_server: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        config = broker_config(
            tmp_path, etcd_server, overrides={"metrics.listen": f"127.0.0.1:{taken}"}
        )
        with pytest.raises(ListenError, match=r"metrics\.listen"):
            await Broker(config).start()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_readyz_is_503_while_etcd_is_lost_then_ready_again(tmp_path: Path) -> None:
    """etcd stopped for longer than the lease: /readyz says why the broker is not ready
    (/healthz stays 200), and turns 200 again once the session is back."""
    async with (
        LocalEtcd() as etcd,
        running_broker(broker_config(tmp_path / "b1", etcd.endpoint)) as broker,
    ):
        url = broker.metrics_url
        assert await asyncio.to_thread(get, f"{url}/readyz") == (200, "ready\n")
        await asyncio.to_thread(etcd.server.stop)
        try:
            async with asyncio.timeout(20):
                while (ready := await asyncio.to_thread(get, f"{url}/readyz"))[0] == 200:
                    await asyncio.sleep(0.2)
            assert ready[0] == 503 and ready[1].startswith("not ready: etcd session lost"), ready
            assert await asyncio.to_thread(get, f"{url}/healthz") == (200, "ok\n")
        finally:
            await asyncio.to_thread(etcd.server.start)
            await asyncio.to_thread(etcd.server.wait_healthy)
        async with asyncio.timeout(30):
            while (ready := await asyncio.to_thread(get, f"{url}/readyz"))[0] != 200:
                await asyncio.sleep(0.2)
