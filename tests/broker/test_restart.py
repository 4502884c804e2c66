"""A broker crash (SIGKILL) and restart, seen by danube-client objects that stay connected.

The broker runs in a child process (``BrokerProcess``) on a real etcd. The producer and the
consumer are built once, before the crash, and are never rebuilt: the daemon must serve the
producer and consumer ids it issued before the crash (they are persisted in etcd), re-attach a
known consumer id on ``ReceiveMessages``, and continue the topic's offsets after its WAL.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import grpc
import pytest
from danube import (
    ConsumerOptions,
    DanubeClientBuilder,
    DispatchStrategy,
    ProducerOptions,
    SubType,
)
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.errors import ListenError
from danube_ingest.broker.server import Broker
from danube_ingest.datadir import DataDirLock
from danube_ingest.metadata.errors import MetadataUnavailableError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.jumps import read_jumps
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.records import decode_cursor
from danube_ingest.testing import BrokerProcess, broker_config, free_port

pytestmark = pytest.mark.slow

TOPIC = "/default/restart"

#: danube-client's default retry budget (5 retries, linear backoff 0.1-0.2 s ... 0.5-1 s,
#: 1.5-3 s in all) does not bridge an outage of more than 5 s: a send pending at the crash
#: fails (measured: UNAVAILABLE after 2.5 s even for a 1.5 s outage). Besides, grpc reconnects
#: a channel only on its backoff schedule (1 s, x1.6, +-20 % jitter: ~1, 2.6, 5.2, 9.3, 16,
#: 26 s after the crash), so a broker serving again at 6.5 s is reached at ~9.3 s, one serving
#: at 9.5 s (a loaded machine) only at ~16 s. The clients therefore get a larger budget through
#: their public options (danube-client unchanged): up to 120 retries, backoff capped at 0.5 s,
#: i.e. 30-60 s of trying, each try at most 0.5 s after the channel is back.
RETRY_BUDGET = {"max_retries": 120, "base_backoff_ms": 100, "max_backoff_ms": 500}
#: The broker's lease TTL (see LEASE_TTL in test_cluster.py: 2 s is too tight on a loaded machine).
LEASE_TTL = 4
#: Longer than danube-client's health-check interval (5 s): its health loop has failed by then,
#: so nothing but persisted ids can bring the clients back. Also longer than the lease TTL.
LONG_OUTAGE = 5.5


async def _next(queue: asyncio.Queue[pb.StreamMessage], timeout: float = 60.0) -> pb.StreamMessage:
    return await asyncio.wait_for(queue.get(), timeout)


async def _wait_cursor(kv: EtcdKV, keys: Keys, expected: int) -> None:
    """Wait until the cursor of subscription s1 (written debounced, ~1 s) is ``expected``."""
    deadline = time.monotonic() + 10
    while True:
        stored = await kv.get(keys.subscription_cursor(TOPIC, "s1"))
        if stored is not None and decode_cursor(stored.value) == expected:
            return
        assert time.monotonic() < deadline, f"the cursor never reached {expected} in etcd"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    "outage",
    [
        pytest.param(LONG_OUTAGE, id="after-lease-and-health-loop"),
        # Restarted at once (a supervisor): the crashed broker's registration is still
        # there (for up to LEASE_TTL); the new process takes it back (same data directory),
        # neither refusing to start nor waiting it out.
        pytest.param(0.0, id="within-lease"),
    ],
)
async def test_sigkill_restart_keeps_connected_clients(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, outage: float
) -> None:
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=LEASE_TTL)
    await asyncio.to_thread(broker.start)
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    keys = Keys(etcd_prefix)
    try:
        client = await DanubeClientBuilder().service_url(broker.url).build()
        producer = (
            client.new_producer()
            .with_topic(TOPIC)
            .with_name("p1")
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .with_options(ProducerOptions(**RETRY_BUDGET))
            .build()
        )
        await producer.create()
        consumer = (
            client.new_consumer()
            .with_topic(TOPIC)
            .with_consumer_name("c1")
            .with_subscription("s1")
            .with_subscription_type(SubType.EXCLUSIVE)
            .with_options(ConsumerOptions(**RETRY_BUDGET))
            .build()
        )
        await consumer.subscribe()
        queue = await consumer.receive()

        # Before the crash: 10 messages, all delivered; the first 6 acked, 4 left in flight.
        for i in range(10):
            await producer.send(f"m{i}".encode(), {"i": str(i)})
        before = [await _next(queue) for _ in range(10)]
        assert [m.payload for m in before] == [f"m{i}".encode() for i in range(10)]
        offsets_before = [m.msg_id.topic_offset for m in before]
        assert offsets_before == list(range(10))
        for message in before[:6]:
            await consumer.ack(message)
        # Once the cursor is in etcd, exactly the unacked 4 must come again, not the acked ones.
        await _wait_cursor(kv, keys, offsets_before[6])

        broker.kill(signal.SIGKILL)
        killed = time.monotonic()
        # Sends issued while the broker is down: they must wait out the outage and succeed.
        during = asyncio.create_task(producer.send(b"m10", {"i": "10"}))
        await asyncio.sleep(outage)
        assert not during.done(), "a send succeeded while the broker was down"
        await asyncio.to_thread(broker.start)
        serving = time.monotonic() - killed

        await asyncio.wait_for(during, 60)
        resumed = time.monotonic() - killed
        for i in range(11, 20):
            await producer.send(f"m{i}".encode(), {"i": str(i)})

        # The same consumer object, on the same receive() queue: the 4 unacked messages again,
        # then everything sent during and after the outage, in offset order.
        after = [await _next(queue) for _ in range(14)]
        assert [m.payload for m in after] == [f"m{i}".encode() for i in range(6, 20)]
        assert [m.msg_id.topic_offset for m in after[:4]] == offsets_before[6:]
        offsets_after = [m.msg_id.topic_offset for m in after[4:]]
        # No offset is reused and none is skipped: the same broker, back with its WAL, made
        # the topic's last offset reservation, so it continues right after its WAL.
        assert offsets_after[0] == max(offsets_before) + 1
        assert offsets_after == list(range(offsets_after[0], offsets_after[0] + 10))
        assert await read_jumps(kv, keys, TOPIC) == []  # no jump, so none recorded
        for message in after:
            await consumer.ack(message)
        await _wait_cursor(kv, keys, offsets_after[-1] + 1)
        assert queue.empty(), "a message was delivered twice after the restart"
        print(
            f"broker serving again {serving:.1f}s after SIGKILL; the pending send went "
            f"through at {resumed:.1f}s; offsets {offsets_before} then {offsets_after}"
        )

        await producer.close()
        await consumer.close()
        log = broker.log_text()
        assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    finally:
        await kv.close()
        await asyncio.to_thread(broker.stop)


async def _publish(url: str, topic: str, payloads: list[bytes]) -> None:
    client = await DanubeClientBuilder().service_url(url).build()
    producer = (
        client.new_producer()
        .with_topic(topic)
        .with_name(f"p-{time.monotonic_ns()}")
        .with_dispatch_strategy(DispatchStrategy.RELIABLE)
        .with_options(ProducerOptions(**RETRY_BUDGET))
        .build()
    )
    await producer.create()
    for payload in payloads:
        await producer.send(payload, {})
    await producer.close()


async def test_second_broker_on_the_same_data_dir_fails_at_once_and_the_first_keeps_serving(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """Issue 11 item 2: the second process used to recover (rotate, delete) the first one's WAL
    segments, after which every publish to the first failed with INTERNAL."""
    # No time-based segment roll by the first while the test compares the segment files.
    no_roll = {"wal": {"segment_seconds": 3600}}
    first = BrokerProcess(tmp_path / "data", etcd_server, prefix=etcd_prefix, storage=no_roll)
    await asyncio.to_thread(first.start)
    second = BrokerProcess(tmp_path / "data", etcd_server, broker_id="broker-2", prefix=etcd_prefix)
    try:
        await _publish(first.url, TOPIC, [f"a{i}".encode() for i in range(20)])
        segments = sorted((tmp_path / "data" / "wal").rglob("*.wal"))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"broker exited \(2\)"):
            await asyncio.to_thread(second.start)
        assert time.monotonic() - started < 10  # Python start-up only: it waits for nothing
        assert first.process is not None
        text = second.log_text()
        assert f"is in use by pid {first.process.pid} on" in text, text
        assert "Traceback" not in text and "recover" not in text.lower(), text
        # Nothing of the first one's WAL was touched, and it keeps acknowledging publishes.
        assert sorted((tmp_path / "data" / "wal").rglob("*.wal")) == segments
        await _publish(first.url, TOPIC, [f"b{i}".encode() for i in range(20)])
        assert first.process.poll() is None
        log = first.log_text()
        assert " ERROR " not in log and "Traceback" not in log, log[-3000:]
    finally:
        await asyncio.to_thread(second.kill)
        await asyncio.to_thread(first.stop)


async def test_sigkill_restart_takes_its_registration_back_without_waiting_for_the_lease(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """Issue 11 item 5: a restart used to wait out its own previous lease (up to the TTL, 10 s
    here) before serving. The data directory's lock proves the old process dead."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=10)
    await asyncio.to_thread(broker.start)
    try:
        await _publish(broker.url, TOPIC, [b"before"])
        broker.kill(signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.to_thread(broker.start)
        await _publish(broker.url, TOPIC, [b"after"])
        acknowledged = time.monotonic() - killed
        print(f"SIGKILL -> first acknowledged publish: {acknowledged:.2f}s (lease TTL 10 s)")
        assert acknowledged < 5.0, broker.log_text()[-3000:]
        assert "taking back the registration of a previous process" in broker.log_text()
    finally:
        await asyncio.to_thread(broker.stop)


async def test_calls_during_start_up_fail_fast_with_unavailable(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """While the broker is bound but not yet serving (here: waiting out a registration of an
    older version under its URL), calls are answered UNAVAILABLE at once instead of hanging
    until their deadline; the broker then serves, and on a failed start unlocks its data."""
    port = free_port()
    config = broker_config(
        tmp_path / "b1",
        etcd_server,
        port=port,
        prefix=etcd_prefix,
        overrides={"etcd.lease_ttl_seconds": 3},
    )
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    lease = await kv.grant_lease(3)
    registration = {"url": f"http://127.0.0.1:{port}", "started_ms": 0, "regions": 1}
    await kv.put(
        Keys(etcd_prefix).broker("broker-1"), json.dumps(registration).encode(), lease=lease
    )
    broker = Broker(config)
    starting = asyncio.create_task(broker.start())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    lookup = pb_grpc.DiscoveryStub(channel).TopicLookup
    try:
        while broker.port == 0:
            await asyncio.sleep(0.01)
        assert not starting.done()
        sent = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await lookup(pb.TopicLookupRequest(topic=TOPIC), timeout=2.5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert "starting" in (caught.value.details() or "")
        assert time.monotonic() - sent < 1.0
        assert not starting.done()
        await asyncio.wait_for(starting, 10)
        with pytest.raises(grpc.aio.AioRpcError) as served:  # now the real service answers
            await lookup(pb.TopicLookupRequest(topic=TOPIC), timeout=5)
        assert served.value.code() == grpc.StatusCode.NOT_FOUND, served.value
    finally:
        await channel.close()
        await broker.stop(grace=1.0)
        await kv.close()
    # A start that fails (etcd unreachable) releases the data directory again.
    unreachable = f"http://127.0.0.1:{free_port()}"
    failing = Broker(
        broker_config(
            tmp_path / "b1",
            unreachable,
            prefix=etcd_prefix,
            overrides={"etcd.connect_timeout_seconds": 1},
        )
    )
    with pytest.raises(MetadataUnavailableError):
        await failing.start()
    DataDirLock.acquire(tmp_path / "b1").release()


async def test_a_port_in_use_is_refused_not_shared(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """gRPC's default SO_REUSEPORT let a second broker bind a running one's port and take
    part of its new connections; now the second one fails before touching anything."""
    port = free_port()
    first = Broker(broker_config(tmp_path / "b1", etcd_server, port=port, prefix=etcd_prefix))
    await first.start()
    try:
        second = Broker(
            broker_config(
                tmp_path / "b2", etcd_server, broker_id="broker-2", port=port, prefix=etcd_prefix
            )
        )
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: the port is in"):
            await second.start()
        # The port is bound before the WAL is opened: no region was created or recovered.
        assert [p.name for p in (tmp_path / "b2" / "wal").iterdir()] == ["LOCK"]
        await _publish(first.url, TOPIC, [b"still served"])
    finally:
        await first.stop(grace=1.0)
