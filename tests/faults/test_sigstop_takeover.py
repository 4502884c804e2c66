"""SIGSTOP past the lease TTL while a second daemon takes over, then SIGCONT: two daemons in
``wal_cloud`` mode share one etcd prefix and one fs object store. A producer publishes and a
consumer acks through A (clients that know only A); A is paused past its lease, B takes the
topic over (a lookup on B), A is resumed and must be fenced; the clients move to B. Nothing
acknowledged may be lost (by A before the pause, or by B after), nothing duplicated beyond
the window, offsets contiguous apart from the range B records as jumped over."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.metadata import Keys
from danube_ingest.metadata.jumps import read_jumps
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.testing import History, assert_history_ok, manifest_spans
from tests.broker.support import metadata, raw_stubs
from tests.broker.test_both_clients import create_topic

from .conftest import BrokerFactory
from .harness import Load, Reader, read_all, record

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/takeover"
LEASE_TTL = 4


async def wait_owner(url: str, timeout: float) -> float:
    """Look ``TOPIC`` up on ``url`` until it has taken the topic over: it answers Connect, or
    UNAVAILABLE because, as the new owner, it waits for the paused owner's unuploaded tail
    (which only the paused owner, once continued, can hand over); seconds."""
    started = time.monotonic()
    async with raw_stubs(url) as raw:
        while True:
            try:
                answer = await raw.discovery.TopicLookup(
                    pb.TopicLookupRequest(request_id=1, topic=TOPIC), timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or "waits for broker" not in (
                    exc.details() or ""
                ):
                    raise
                return time.monotonic() - started
            if answer.response_type == pb.TopicLookupResponse.Connect:
                return time.monotonic() - started
            assert time.monotonic() - started < timeout, f"{url} never took {TOPIC} over"
            await asyncio.sleep(0.1)


@pytest.mark.timeout(150)
async def test_sigstop_past_the_lease_while_a_second_daemon_takes_over(
    brokers: BrokerFactory, history: History, tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    storage = {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(tmp_path / "objects")},
        "wal": {"segment_seconds": 1},
    }
    a = brokers("broker-a", storage=storage, lease_ttl=LEASE_TTL)
    b = brokers("broker-b", storage=storage, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(a.start)
    await asyncio.to_thread(b.start)
    await create_topic(a.url, TOPIC)
    audit = Reader("danube", a.url, TOPIC, "audit", history, name="audit")
    await audit.start()
    await audit.close()
    live = Reader("danube", a.url, TOPIC, "live", history)
    await live.start()
    load = Load("danube", a.url, TOPIC, history, "p1")
    await load.start()
    started = time.monotonic()
    try:
        await load.wait_acked(200)
        history.fault("sigstop", "broker-a")
        a.kill(signal.SIGSTOP)
        try:
            took = await wait_owner(b.url, timeout=LEASE_TTL + 15)
        finally:
            history.fault("sigcont", "broker-a")
            a.kill(signal.SIGCONT)
        await load.wait_acked(load.acked + 200, timeout=60)
        await load.stop()
        await read_all("danube", b.url, TOPIC, history, [live], timeout=20)
    finally:
        await live.close()
    async with metadata(etcd_server, etcd_prefix) as records:
        keys = Keys(etcd_prefix)
        ranges = await Manifest(records.kv, keys).ranges(TOPIC)
        jumps = [(j.start, j.end) for j in await read_jumps(records.kv, keys, TOPIC)]
    report = assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
        gaps={TOPIC: jumps},
    )
    record(
        "sigstop-past-lease-takeover",
        "danube",
        report,
        cycles=1,
        seconds=round(time.monotonic() - started, 1),
        recover_s_max=round(took, 2),
    )
