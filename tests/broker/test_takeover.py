"""Lossless takeover: two ``wal_cloud`` brokers on one etcd and one fs store, the owner
SIGKILLed with acknowledged messages only in its local WAL.

The survivor serves nothing of the topic (UNAVAILABLE) until the old owner is back and hands
its tail over (every acknowledged message delivered once through the survivor, offsets without
a gap), or until an operator runs ``brokers forget`` (the survivor continues after a recorded
jump, shown by ``status``). A broker on another object store than the cluster's does not start.

The acked/delivered checks are plain set and range checks (``_check_history``), kept in one
place so a fuller history checker can replace them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.cli.admin import scrape
from danube_ingest.client import Consumer as BatchConsumer
from danube_ingest.client import Producer as BatchProducer
from danube_ingest.metadata.durable import read_durable_end
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import LOST, PENDING, RECOVERED, Handover, read_handover
from danube_ingest.metadata.jumps import read_jumps
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.testing import BrokerProcess

from .conftest import StartProcess
from .pair import TOPIC, danube_client, exclusive_consumer, reliable_producer, reserved_end
from .support import LEASE_TTL, wal_cloud_storage

#: Seconds the old owner stays down before it is restarted (the survivor waits meanwhile).
RESTART_AFTER = 2.0
#: Seconds danube-client publishes one message at a time before the kill: with segments sealed
#: every 2 s, the last ~2 s of acknowledged messages are in the owner's local WAL only.
PUBLISH_SECONDS = 2.5
#: Bound of every wait below (a loaded 2-core machine is slow to start brokers).
WAIT = LEASE_TTL + 40.0

StartBroker = Callable[..., Awaitable[BrokerProcess]]


@pytest.fixture
def start_broker(start_process: StartProcess, objects_root: Path) -> StartBroker:
    """``await start_broker("broker-a")``: a ``wal_cloud`` broker process on the shared fs
    object root (or ``root``), sealing segments every 2 s."""

    async def start(broker_id: str, root: Path | None = None) -> BrokerProcess:
        return await start_process(broker_id, wal_cloud_storage(root or objects_root, 2))

    return start


def _cli(etcd: str, prefix: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *args, "--etcd", etcd, "--prefix", prefix],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _publish_to_owner(url: str) -> tuple[set[bytes], int]:
    """Publish through both clients to the owner at ``url``: a batch (our client), then
    danube-client one message at a time for PUBLISH_SECONDS. Returns (acknowledged payloads,
    how many danube-client sends were acknowledged)."""
    acked: set[bytes] = set()
    async with BatchProducer(url, TOPIC, producer_name="batch", linger_ms=1) as batch:
        payloads = [f"batch-{i}".encode() for i in range(300)]
        await asyncio.wait_for(await batch.send_many(payloads), WAIT)
        acked.update(payloads)
    client = await danube_client(url)
    producer = await reliable_producer(client, "p1")
    deadline = time.monotonic() + PUBLISH_SECONDS
    sent = 0
    while time.monotonic() < deadline:
        payload = f"dc-{sent}".encode()
        await producer.send(payload)
        acked.add(payload)
        sent += 1
    return acked, sent


async def _subscribe_before(url: str) -> None:
    """Create the topic and its subscription s1 at offset 0 (before anything is published)."""
    client = await danube_client(url)
    await reliable_producer(client, "p1")  # creates the topic
    consumer, _ = await exclusive_consumer(client)
    await consumer.close()


class _Pair(NamedTuple):
    """Two brokers after ``_owner_with_a_tail``."""

    a: BrokerProcess
    """The topic's owner: its last acknowledged entries are in its local WAL only."""
    b: BrokerProcess
    """The other broker (the survivor once A is killed)."""
    acked: set[bytes]
    """The payloads A acknowledged."""
    sent: int
    """How many of them danube-client sent."""
    reserved: int
    """The end of A's reserved offset block."""


async def _owner_with_a_tail(start_broker: StartBroker, kv: EtcdKV, keys: Keys) -> _Pair:
    """Start brokers A and B; create the topic and subscription s1 on A, then publish to A
    (``_publish_to_owner``)."""
    a = await start_broker("broker-a")
    b = await start_broker("broker-b")
    await _subscribe_before(a.url)
    acked, sent = await _publish_to_owner(a.url)
    return _Pair(a, b, acked, sent, await reserved_end(kv, keys))


async def _wait_record(kv: EtcdKV, keys: Keys, state: str) -> Handover:
    deadline = time.monotonic() + WAIT
    while True:
        found = await read_handover(kv, keys, TOPIC)
        if found is not None and found[0].state == state:
            return found[0]
        assert time.monotonic() < deadline, f"no {state} takeover record: {found}"
        await asyncio.sleep(0.1)


async def _deliver_all(url: str, expected: set[bytes]) -> list[tuple[int, bytes]]:
    """(offset, payload) of what subscription s1 receives through ``url`` until every
    ``expected`` payload came (acked as received), then whatever follows within a second."""
    client = await danube_client(url)
    consumer, queue = await exclusive_consumer(client)
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + WAIT
    try:
        while not expected <= {p for _, p in got}:
            assert time.monotonic() < deadline, f"missing {len(expected - {p for _, p in got})}"
            try:
                message = await asyncio.wait_for(queue.get(), 1.0)
            except TimeoutError:
                continue
            got.append((message.msg_id.topic_offset, message.payload))
            await consumer.ack(message)
        while True:
            try:
                message = await asyncio.wait_for(queue.get(), 1.0)
            except TimeoutError:
                break
            got.append((message.msg_id.topic_offset, message.payload))
            await consumer.ack(message)
    finally:
        await consumer.close()
    return got


def _check_history(acked: set[bytes], delivered: list[tuple[int, bytes]]) -> tuple[int, int]:
    """Every acknowledged payload delivered; offsets unique and contiguous from 0. Returns
    (lost, duplicated) for the report (both asserted 0)."""
    payloads = [p for _, p in delivered]
    lost = len(acked - set(payloads))
    duplicated = len(payloads) - len(set(payloads))
    offsets = sorted(o for o, _ in delivered)
    assert lost == 0, f"{lost} acknowledged messages never delivered"
    assert duplicated == 0, f"{duplicated} messages delivered twice"
    assert offsets == list(range(len(offsets))), "offsets not contiguous from 0"
    return lost, duplicated


@pytest.mark.slow
async def test_a_restarted_owner_hands_its_tail_to_the_survivor(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys
) -> None:
    a, b, acked, sent, reserved = await _owner_with_a_tail(start_broker, kv, keys)
    manifest = Manifest(kv, keys)

    a.kill(signal.SIGKILL)
    killed = time.monotonic()
    # Our batch client publishes through the survivor: it retries UNAVAILABLE (A's lease,
    # then the takeover wait) until B serves the topic.
    after = [f"after-{i}".encode() for i in range(100)]
    survivor = BatchProducer(b.url, TOPIC, producer_name="after", linger_ms=1)
    reader = BatchConsumer(b.url, TOPIC, "while-pending", start="earliest")
    await survivor.start()
    try:
        stored = asyncio.ensure_future(await survivor.send_many(after))
        record = await _wait_record(kv, keys, PENDING)
        assert (record.previous, record.owner, record.reserved) == (
            "broker-a",
            "broker-b",
            reserved,
        )
        assert record.committed == await manifest.end_offset(TOPIC)
        tail = len(acked) - record.committed  # acknowledged, in A's WAL only
        # A consumer subscribing now is told the topic is not served yet (UNAVAILABLE) and
        # subscribes again, as after a lost stream, until it is.
        subscribing = asyncio.ensure_future(reader.start())
        await asyncio.sleep(RESTART_AFTER)
        assert not stored.done(), "the survivor served before the old owner's tail was back"
        assert not subscribing.done(), "a subscription began before the old owner's tail was back"
        await asyncio.to_thread(a.start)
        ranges = await asyncio.wait_for(stored, WAIT)
        serving = time.monotonic() - killed
        await asyncio.wait_for(subscribing, WAIT)
        assert reader.reconnects >= 1
        first = await reader.receive(timeout=WAIT)
        assert first.offsets[:1] == [0]
    finally:
        await survivor.close()
        await reader.close()

    done = await _wait_record(kv, keys, RECOVERED)
    assert done.end is not None and len(acked) <= done.end <= len(acked) + 1  # + one in flight
    assert [list(r) for r in ranges] == [list(range(done.end, done.end + len(after)))]
    delivered = await _deliver_all(b.url, acked | set(after))
    lost, duplicated = _check_history(acked | set(after), delivered)
    assert await read_jumps(kv, keys, TOPIC) == []  # no gap to explain
    assert "orphaned tail committed for the new owner" in a.log_text()
    assert "Traceback" not in a.log_text() + b.log_text()
    print(
        f"restart after {RESTART_AFTER:.0f}s: survivor serving {serving:.1f}s after SIGKILL; "
        f"acked {len(acked)} ({sent} via danube-client), {tail} only in the dead owner's WAL; "
        f"lost {lost}, duplicated {duplicated}; survivor continued at {done.end}"
    )


@pytest.mark.slow
async def test_a_forgotten_owner_is_skipped_with_a_recorded_jump(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys, etcd_server: str, etcd_prefix: str
) -> None:
    a, b, acked, _, reserved = await _owner_with_a_tail(start_broker, kv, keys)
    manifest = Manifest(kv, keys)
    # A records its WAL's durable end each second: wait for the record of what it acknowledged.
    deadline = time.monotonic() + WAIT
    while (durable := await read_durable_end(kv, keys, TOPIC, "broker-a")) is None or (
        durable.end < len(acked)
    ):
        assert time.monotonic() < deadline, f"no durable end record of broker-a: {durable}"
        await asyncio.sleep(0.2)

    a.kill(signal.SIGKILL)
    survivor = BatchProducer(b.url, TOPIC, producer_name="after", linger_ms=1)
    await survivor.start()
    try:
        stored = asyncio.ensure_future(await survivor.send_many([b"after-0", b"after-1"]))
        record = await _wait_record(kv, keys, PENDING)
        assert record.committed == await manifest.end_offset(TOPIC)
        listing = _cli(etcd_server, etcd_prefix, "brokers", "list")
        assert listing.returncode == 0, listing.stderr
        assert f"{TOPIC}  pending  broker-a" in listing.stdout, listing.stdout
        # Refused while A is registered; accepted once its lease ran out.
        deadline = time.monotonic() + WAIT
        while await kv.get(keys.broker("broker-a")) is not None:
            refused = _cli(etcd_server, etcd_prefix, "brokers", "forget", "broker-a")
            assert refused.returncode == 2 and "is alive" in refused.stderr, refused
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
        forgot = _cli(etcd_server, etcd_prefix, "brokers", "forget", "broker-a")
        assert forgot.returncode == 0, forgot.stderr
        assert f"{TOPIC}: offsets {record.committed}..{reserved - 1}" in forgot.stdout
        # The skipped range is only a bound; the recorded durable end says what was acknowledged.
        about = durable.end - record.committed
        assert durable.end < reserved
        assert (
            f"up to {reserved - record.committed} acknowledged messages lost; about {about} by "
            f"the broker's last recorded durable end ({durable.end} at " in forgot.stdout
        ), forgot.stdout
        ranges = await asyncio.wait_for(stored, WAIT)
    finally:
        await survivor.close()

    assert [list(r) for r in ranges] == [[reserved, reserved + 1]]
    lost = await _wait_record(kv, keys, LOST)
    assert lost.end == reserved
    [jump] = await read_jumps(kv, keys, TOPIC)
    assert (jump.start, jump.end, jump.broker, jump.reason) == (
        record.committed,
        reserved,
        "broker-a",
        "lost",
    )
    status = _cli(etcd_server, etcd_prefix, "status")
    assert status.returncode == 0, status.stderr
    assert (
        f"1 declared lost (up to {reserved - record.committed} acknowledged messages lost: the "
        f"offsets skipped; about {about} by the recorded durable ends)" in status.stdout
    ), status.stdout
    registered = await kv.get(keys.broker("broker-b"))
    assert registered is not None
    figures = scrape(f"{json.loads(registered.value)['metrics_url']}/metrics")
    assert figures[("danube_ingest_takeover_lost_offsets_total", ())] == lost.lost_offsets
    print(
        f"forgotten: {len(acked)} acked, {len(acked) - record.committed} of them lost with "
        f"broker-a; survivor continued at {reserved}"
    )


async def _retrying(what: Callable[[], Awaitable[object]], codes: list[grpc.StatusCode]) -> None:
    """Await ``what()`` until it succeeds, as an application does on a retriable error:
    danube-client gives up after its own few retries (seconds). Every error must be a gRPC
    status (recorded in ``codes``); anything else fails the test."""
    deadline = time.monotonic() + WAIT
    while True:
        try:
            await what()
            return
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            assert time.monotonic() < deadline, f"still failing: {exc}"
            await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_danube_client_rides_through_a_pending_takeover(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys
) -> None:
    a, b, acked, sent, _ = await _owner_with_a_tail(start_broker, kv, keys)

    a.kill(signal.SIGKILL)
    # A producer and an Exclusive consumer (subscription s1, nothing acknowledged yet) that
    # know only the survivor's URL, started while the old owner is down.
    client = await danube_client(b.url)
    after = [f"after-{i}".encode() for i in range(20)]
    producer_codes: list[grpc.StatusCode] = []
    consumer_codes: list[grpc.StatusCode] = []
    served: list[tuple[int, bytes, str]] = []
    expected = acked | set(after)

    async def produce() -> None:
        holder: list[Any] = []

        async def create() -> None:
            holder[:] = [await reliable_producer(client, "p2")]

        await _retrying(create, producer_codes)
        for payload in after:
            await _retrying(lambda p=payload: holder[0].send(p), producer_codes)
        await holder[0].close()

    async def consume() -> None:
        holder: list[Any] = []

        async def subscribe() -> None:
            holder[:] = [await exclusive_consumer(client)]

        await _retrying(subscribe, consumer_codes)
        consumer, queue = holder[0]
        try:
            while not expected <= {p for _, p, _ in served}:
                message: pb.StreamMessage = await queue.get()
                served.append(
                    (message.msg_id.topic_offset, message.payload, message.msg_id.broker_addr)
                )
                await consumer.ack(message)
            with contextlib.suppress(TimeoutError):  # anything more would be a duplicate
                while True:
                    message = await asyncio.wait_for(queue.get(), 1.0)
                    served.append(
                        (message.msg_id.topic_offset, message.payload, message.msg_id.broker_addr)
                    )
        finally:
            await consumer.close()

    riders = asyncio.ensure_future(asyncio.gather(produce(), consume()))
    try:
        record = await _wait_record(kv, keys, PENDING)
        await asyncio.sleep(RESTART_AFTER)
        # A refusal reaches the test only after danube-client's own retries: wait for one on
        # each side rather than requiring them within RESTART_AFTER (two each came within it
        # on a busy 2-core machine; a slower machine or client need not fail the test).
        deadline = time.monotonic() + WAIT
        while not (producer_codes and consumer_codes):
            assert not riders.done(), "the clients stopped before they were refused"
            assert time.monotonic() < deadline, "the clients were not refused meanwhile"
            await asyncio.sleep(0.1)
        assert not riders.done() and not served, "served before the old owner's tail was back"
        await asyncio.to_thread(a.start)
        await asyncio.wait_for(asyncio.shield(riders), WAIT)
    finally:
        riders.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await riders

    # Refused only with UNAVAILABLE (retriable), then served by the survivor.
    assert set(producer_codes) | set(consumer_codes) == {grpc.StatusCode.UNAVAILABLE}
    assert {broker for _, _, broker in served} == {b.url}
    lost, duplicated = _check_history(expected, [(o, p) for o, p, _ in served])
    done = await _wait_record(kv, keys, RECOVERED)
    assert await read_jumps(kv, keys, TOPIC) == []
    assert "Traceback" not in a.log_text() + b.log_text()
    print(
        f"danube-client through a takeover: {len(acked)} acked before the kill ({sent} via "
        f"danube-client), {len(acked) - record.committed} only in the dead owner's WAL; "
        f"refused {len(producer_codes)}+{len(consumer_codes)} times (UNAVAILABLE); "
        f"lost {lost}, duplicated {duplicated}; survivor continued at {done.end}"
    )


def _wipe(broker: BrokerProcess) -> None:
    """Replace the broker's disk: everything in its data directory but its log is gone."""
    for path in broker.data_dir.iterdir():
        if path != broker.log_path:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.slow
async def test_an_owner_restarted_on_a_wiped_data_dir_declares_its_tail_lost(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys
) -> None:
    a, b, acked, _, reserved = await _owner_with_a_tail(start_broker, kv, keys)
    wal_id = (a.data_dir / "wal" / "ID").read_text().strip()

    a.kill(signal.SIGKILL)
    survivor = BatchProducer(b.url, TOPIC, producer_name="after", linger_ms=1)
    await survivor.start()
    try:
        stored = asyncio.ensure_future(await survivor.send_many([b"after-0", b"after-1"]))
        record = await _wait_record(kv, keys, PENDING)
        assert record.previous_wal_id == wal_id
        tail = len(acked) - record.committed
        assert tail > 0, "every acknowledged message was uploaded before the kill"
        # A comes back on an empty disk: its acknowledged tail is gone. Resolving the wait as
        # recovered at the manifest's end would hand those offsets out again.
        _wipe(a)
        await asyncio.to_thread(a.start)
        ranges = await asyncio.wait_for(stored, WAIT)
    finally:
        await survivor.close()

    assert (a.data_dir / "wal" / "ID").read_text().strip() != wal_id
    lost = await _wait_record(kv, keys, LOST)
    assert (lost.end, lost.lost_offsets) == (reserved, reserved - record.committed)
    assert [list(r) for r in ranges] == [[reserved, reserved + 1]]
    [jump] = await read_jumps(kv, keys, TOPIC)
    assert (jump.start, jump.end, jump.broker, jump.reason) == (
        record.committed,
        reserved,
        "broker-a",
        "lost",
    )
    assert "tail lost with the previous WAL" in a.log_text()
    registered = await kv.get(keys.broker("broker-b"))
    assert registered is not None
    figures = scrape(f"{json.loads(registered.value)['metrics_url']}/metrics")
    assert figures[("danube_ingest_takeover_lost_offsets_total", ())] == lost.lost_offsets
    # What the survivor serves: the committed entries, then its own after the recorded jump;
    # no offset is served twice.
    delivered = await _deliver_all(b.url, {b"after-0", b"after-1"})
    offsets = [o for o, _ in delivered]
    assert sorted(offsets) == [*range(record.committed), reserved, reserved + 1]
    assert "Traceback" not in a.log_text() + b.log_text()
    print(f"wiped: {tail} acknowledged offsets lost with broker-a's disk, recorded as a jump")


@pytest.mark.slow
async def test_a_broker_on_another_object_store_refuses_to_start(
    start_broker: StartBroker, tmp_path: Path, kv: EtcdKV, keys: Keys
) -> None:
    await start_broker("broker-a")
    stored = await kv.get(keys.cluster_id())
    assert stored is not None
    cluster = stored.value.decode()
    with pytest.raises(RuntimeError, match=f"not this cluster's.*cluster {cluster}") as info:
        await start_broker("broker-c", root=tmp_path / "elsewhere")
    assert "(none)" in str(info.value) and "storage.cloud" in str(info.value)
    assert await kv.get(keys.broker("broker-c")) is None
