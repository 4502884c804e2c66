"""Two daemons in ``wal_cloud`` mode on one etcd and one object store: a new owner continues a
topic from the objects the old one uploaded, and a paused old owner cannot write the manifest.

Both brokers run as child processes (``BrokerProcess``) under one fresh etcd prefix and share
one fs object root; the clients are the real danube-client. Unlike ``test_cluster.py``
(``local_only``), nothing needs settling before a takeover: what the old owner uploaded is
read by the new one through the manifest.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from itertools import pairwise
from pathlib import Path

import grpc
import pytest

from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import (
    PENDING,
    RECOVERED,
    Handover,
    forget_broker,
    read_handover,
)
from danube_ingest.metadata.jumps import OffsetJump, read_jumps
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.orphans import manifest_integrity
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import BrokerProcess

from .conftest import StartProcess
from .pair import (
    TOPIC,
    danube_client,
    exclusive_consumer,
    lookup,
    next_messages,
    owner_of,
    reliable_producer,
    reserved_end,
    wait_connect,
    wait_cursor,
)
from .support import LEASE_TTL, wal_cloud_storage

#: How long a test waits for a segment to be sealed, uploaded and committed. Segments seal
#: after ``segment_seconds`` (1 s, or 5 s for the paused owner) plus an age check; the rest is
#: slack for a loaded 2-core CI machine.
UPLOAD_TIMEOUT = 30.0
#: What it may log (at ERROR, then retry) if its segment seals before its session is
#: registered again: without a live session it does not even look up the topic's owner.
NO_SESSION = "has no live session"

StartBroker = Callable[..., Awaitable[BrokerProcess]]


@pytest.fixture
def start_broker(start_process: StartProcess, objects_root: Path) -> StartBroker:
    """``await start_broker("broker-a", segment_seconds=1)``: a ``wal_cloud`` broker process
    with its own data dir and port, on the shared object root."""

    async def start(broker_id: str, segment_seconds: float = 1) -> BrokerProcess:
        return await start_process(broker_id, wal_cloud_storage(objects_root, segment_seconds))

    return start


def _error_lines(broker: BrokerProcess) -> list[str]:
    text = broker.log_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if " ERROR " in line]


def _covers(ranges: Iterable[ObjectRange], offsets: Iterable[int]) -> bool:
    spans = [(r.start_offset, r.end_offset) for r in ranges]
    return all(any(start <= o < end for start, end in spans) for o in offsets)


def _of(ranges: Iterable[ObjectRange], broker: str) -> list[ObjectRange]:
    return [r for r in ranges if r.broker == broker]


async def _wait_manifest(
    manifest: Manifest, done: Callable[[list[ObjectRange]], bool], what: str
) -> list[ObjectRange]:
    """The topic's manifest once ``done`` holds for it (polled)."""
    deadline = time.monotonic() + UPLOAD_TIMEOUT
    while True:
        ranges = await manifest.ranges(TOPIC)
        if done(ranges):
            return ranges
        assert time.monotonic() < deadline, f"manifest never {what}: {ranges}"
        await asyncio.sleep(0.1)


async def _wait_takeover(kv: EtcdKV, keys: Keys, url: str) -> Handover:
    """Look the topic up on ``url`` (the survivor) until it waits for the old owner's tail:
    it answers UNAVAILABLE and the pending takeover record is written."""
    deadline = time.monotonic() + LEASE_TTL + UPLOAD_TIMEOUT
    while True:
        try:
            await lookup(url)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        found = await read_handover(kv, keys, TOPIC)
        if found is not None and found[0].state == PENDING:
            with pytest.raises(grpc.aio.AioRpcError, match="waits for broker") as refused:
                await lookup(url)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            return found[0]
        assert time.monotonic() < deadline, "the survivor never took the topic over"
        await asyncio.sleep(0.1)


async def _wait_served(url: str) -> float:
    """Look the topic up on ``url`` until it is served there (UNAVAILABLE meanwhile); returns
    the seconds waited."""
    started = time.monotonic()
    while True:
        try:
            response = await lookup(url)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        else:
            assert response.connect_url == url
            return time.monotonic() - started
        assert time.monotonic() - started < UPLOAD_TIMEOUT, f"{url} never served the topic"
        await asyncio.sleep(0.1)


async def _forget(kv: EtcdKV, keys: Keys, broker_id: str) -> None:
    """``brokers forget`` once the dead broker's registration expired."""
    deadline = time.monotonic() + LEASE_TTL + UPLOAD_TIMEOUT
    while await kv.get(keys.broker(broker_id)) is not None:
        assert time.monotonic() < deadline, f"{broker_id} stays registered"
        await asyncio.sleep(0.1)
    assert len(await forget_broker(kv, keys, broker_id)) == 1


def _assert_one_line(ranges: list[ObjectRange]) -> None:
    """One history: ranges in offset order, disjoint, each broker under one epoch, and the
    epochs never decreasing as offsets grow."""
    assert ranges, "empty manifest"
    for before, after in pairwise(ranges):
        assert before.end_offset <= after.start_offset, (before.span(), after.span())
        assert before.epoch <= after.epoch, (before, after)
    assert all(r.kind == "segment" for r in ranges)
    epochs = {r.broker: r.epoch for r in ranges}
    assert len({(r.broker, r.epoch) for r in ranges}) == len(epochs) == len(set(epochs.values()))


async def _assert_integrity(kv: EtcdKV, keys: Keys, objects_root: Path) -> list[OffsetJump]:
    """The manifest integrity check passes (every object intact, every gap covered by a
    recorded jump); returns the topic's jumps."""
    store = ObjectStore("fs", options={"root": str(objects_root)})
    try:
        report = await manifest_integrity(kv, keys, store, deep=True)
    finally:
        await store.close()
    assert report.ok, report.problems
    assert [t.topic for t in report.topics] == [TOPIC]
    return await read_jumps(kv, keys, TOPIC)


@pytest.mark.slow
async def test_takeover_continues_a_subscription_from_the_old_owners_objects(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys, objects_root: Path
) -> None:
    a = await start_broker("broker-a")
    b = await start_broker("broker-b")
    manifest = Manifest(kv, keys)

    # On A: ten messages published, all received, only the first four acked.
    via_a = await danube_client(a.url)
    producer_a = await reliable_producer(via_a, "p1")  # creates the topic
    consumer_a, queue_a = await exclusive_consumer(via_a)
    sent = [f"a{i}".encode() for i in range(10)]
    for payload in sent:
        await producer_a.send(payload)
    before = await next_messages(queue_a, len(sent))
    assert [m.payload for m in before] == sent
    offsets_a = [m.msg_id.topic_offset for m in before]
    assert offsets_a == sorted(set(offsets_a))
    for message in before[:4]:
        await consumer_a.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_a[4])
    owner_a = await owner_of(kv, keys)
    assert owner_a == {"broker": "broker-a", "url": a.url, "epoch": 1}
    reserved_a = await reserved_end(kv, keys)
    assert reserved_a > offsets_a[-1]
    # Sealed within a second, uploaded and committed: then A may crash without losing them.
    await _wait_manifest(manifest, lambda r: _covers(r, offsets_a), "covered A's offsets")

    a.kill(signal.SIGKILL)
    for old in (producer_a, consumer_a):
        await old.close()
    # B serves nothing until A's tail is back or A is declared lost: A never comes back.
    record = await _wait_takeover(kv, keys, b.url)
    assert (record.previous, record.committed, record.reserved) == (
        "broker-a",
        offsets_a[-1] + 1,
        reserved_a,
    )
    await _forget(kv, keys, "broker-a")
    response, took, _ = await wait_connect(b.url)
    assert (response.connect_url, response.broker_url) == (b.url, b.url)
    assert await owner_of(kv, keys) == {"broker": "broker-b", "url": b.url, "epoch": 2}

    # The subscription goes on on B from its cursor: the six unacked messages, which only A's
    # objects hold (B has its own WAL), in order, at the offsets A gave them.
    via_b = await danube_client(b.url)
    consumer, queue = await exclusive_consumer(via_b)
    redelivered = await next_messages(queue, 6)
    assert [m.payload for m in redelivered] == sent[4:]
    assert [m.msg_id.topic_offset for m in redelivered] == offsets_a[4:]
    assert {m.msg_id.broker_addr for m in redelivered} == {b.url}

    # New publishes on B continue beyond A's reserved block, behind the redelivered ones.
    producer = await reliable_producer(via_b, "p1")
    fresh = [f"b{i}".encode() for i in range(5)]
    for payload in fresh:
        await producer.send(payload)
    after = await next_messages(queue, len(fresh))
    assert [m.payload for m in after] == fresh
    offsets_b = [m.msg_id.topic_offset for m in after]
    assert offsets_b == sorted(set(offsets_b))
    assert offsets_b[0] >= reserved_a > offsets_a[-1]
    for message in [*redelivered, *after]:
        await consumer.ack(message)
    await wait_cursor(kv, keys, "s1", offsets_b[-1] + 1)
    assert queue.empty(), "a message was delivered twice"

    # One history in the manifest: A's ranges (epoch 1) then B's (epoch 2).
    ranges = await _wait_manifest(manifest, lambda r: _covers(r, offsets_b), "covered B's")
    _assert_one_line(ranges)
    ranges_a, ranges_b = _of(ranges, "broker-a"), _of(ranges, "broker-b")
    assert ranges == ranges_a + ranges_b, ranges
    assert {r.epoch for r in ranges_a} == {1} and {r.epoch for r in ranges_b} == {2}
    assert _covers(ranges_a, offsets_a) and ranges_a[-1].end_offset <= reserved_a
    assert _covers(ranges_b, offsets_b) and ranges_b[0].start_offset >= reserved_a
    for entry in ranges_a:
        assert entry.object_key.startswith("segments/broker-a/"), entry
        assert (objects_root / entry.object_key).is_file(), entry
    # Forgetting A recorded the offsets B jumped over, from the manifest's end: the check
    # passes.
    [jump] = await _assert_integrity(kv, keys, objects_root)
    assert (jump.start, jump.end, jump.broker, jump.epoch, jump.reason) == (
        ranges_a[-1].end_offset,
        reserved_a,
        "broker-a",
        2,
        "lost",
    )
    assert jump.end <= ranges_b[0].start_offset
    await producer.close()
    await consumer.close()
    assert _error_lines(a) == [] and _error_lines(b) == []
    print(f"B took over {took:.1f}s after A's SIGKILL; offsets {offsets_a} then {offsets_b}")


@pytest.mark.slow
async def test_paused_owner_hands_its_tail_over_when_it_wakes(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys, objects_root: Path
) -> None:
    # A seals every 5 s: time enough to publish and be paused before a seal; B every second.
    a = await start_broker("broker-a", segment_seconds=5)
    b = await start_broker("broker-b")
    manifest = Manifest(kv, keys)

    via_a = await danube_client(a.url)
    producer_a = await reliable_producer(via_a, "p1")
    owner_a = await owner_of(kv, keys)
    assert owner_a == {"broker": "broker-a", "url": a.url, "epoch": 1}
    for i in range(3):
        await producer_a.send(f"a{i}".encode())
    committed_a = await _wait_manifest(
        manifest, lambda r: sum(e.entries for e in r) == 3, "held A's first three messages"
    )
    # Three more, acknowledged, in A's active segment, which A is paused before sealing.
    for i in range(3, 6):
        await producer_a.send(f"a{i}".encode())
    a.kill(signal.SIGSTOP)
    try:
        assert await manifest.ranges(TOPIC) == committed_a, "A uploaded before its pause"
        reserved_a = await reserved_end(kv, keys)
        # B takes the topic once A's lease ran out, but serves nothing while A holds
        # acknowledged entries it did not upload (UNAVAILABLE to every client).
        record = await _wait_takeover(kv, keys, b.url)
        owner_b = {"broker": "broker-b", "url": b.url, "epoch": 2}  # A's + 1
        assert await owner_of(kv, keys) == owner_b
        assert (record.previous, record.owner, record.epoch) == ("broker-a", "broker-b", 2)
        assert (record.committed, record.reserved) == (3, reserved_a)
        assert await manifest.ranges(TOPIC) == committed_a
    finally:
        a.kill(signal.SIGCONT)

    # A, awake, seals its segment, uploads it and commits its range under B's record, which it
    # resolves at its exact end; B serves from there.
    took = await _wait_served(b.url)
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None and (found[0].state, found[0].end) == (RECOVERED, 6)
    via_b = await danube_client(b.url)
    producer = await reliable_producer(via_b, "p1")
    for i in range(3):
        await producer.send(f"b{i}".encode())
    ranges = await _wait_manifest(
        manifest, lambda r: sum(e.entries for e in _of(r, "broker-b")) == 3, "held B's"
    )
    # One line of offsets 0..8: A's first ranges (epoch 1), A's tail committed under B's
    # record (epoch 2), then B's (epoch 2), no gap, no recorded jump.
    tail_a = [r for r in _of(ranges, "broker-a") if r not in committed_a]
    ranges_b = _of(ranges, "broker-b")
    assert ranges == committed_a + tail_a + ranges_b, ranges
    assert [(r.start_offset, r.end_offset) for r in tail_a] == [(3, 6)]
    assert {r.epoch for r in tail_a + ranges_b} == {2}
    assert ranges_b[0].start_offset == 6 and ranges_b[-1].end_offset == 9
    for before, after in pairwise(ranges):
        assert before.end_offset == after.start_offset and before.epoch <= after.epoch
    assert await _assert_integrity(kv, keys, objects_root) == []
    assert "orphaned tail committed for the new owner" in a.log_text()
    errors = _error_lines(a)
    assert all("upload step failed" in e and NO_SESSION in e for e in errors), errors
    await producer.close()
    await producer_a.close()
    assert _error_lines(b) == []
    print(f"B served {took:.1f}s after A woke, from A's exact end 6 (A's tail was not lost)")
