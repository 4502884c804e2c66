"""SIGKILL of a topic's owner while a second broker takes over (issue 15): two ``wal_cloud``
daemons on one etcd prefix and one fs object store, producers of both clients (danube-client,
which follows the topic through lookups, and our batch client with idempotence on), a live
acking subscriber and an ``audit`` subscription read at the end, all logged to a ``History``.

1. The owner is SIGKILLed with acknowledged messages only in its local WAL; the survivor takes
   the topic over and serves nothing of it (UNAVAILABLE: it waits for that tail) until the old
   owner is restarted and hands the tail over; then it serves, continuing without a gap. The
   kill and restart alternate between the two daemons for ``CYCLES`` cycles. The checker: 0
   lost, 0 duplicates beyond the window, contiguous offsets, no recorded jump, a gap-free
   manifest.
2. The owner is SIGKILLed and never restarted: an operator runs ``danube-ingest brokers forget``
   and the survivor continues after the recorded ``lost`` jump. The checker allows that jump as
   the only gap and reports the acknowledged messages inside it as *declared lost*: exactly the
   acknowledged writes at offsets the dead owner assigned past the manifest's end.

How the clients follow the topic: our batch client talks to one daemon and does not look
topics up, so each batch load publishes to one broker: the owner's is stopped (every message
answered) before the kill, and a new one publishes to the survivor from the kill on, through
the wait. danube-client looks a topic up again only on the broker it is connected to: the
producer keeps publishing through the kill and reaches the new owner through the restarted old
one (scenario 1); for a broker gone for good the application reconnects through the survivor
(scenario 2). The live subscriber is a danube-client consumer reopened on the survivor after
each takeover. Left alone it stops receiving, by danube-client's design: its health-check loop
ends for good on the first failed check (the owner is down), and its receive loop retries the
stream on the broker it knows without backoff and without a new lookup (seen: 27,284
``UNAVAILABLE "owned by ..."`` answers from the restarted old owner in about 20 s); only a
health check answering CLOSE (one that happens to fall after the restart) makes it subscribe
again through a lookup.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.metadata import Keys
from danube_ingest.metadata.handover import LOST, PENDING, RECOVERED, Handover, read_handover
from danube_ingest.metadata.jumps import OffsetJump, read_jumps
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.testing import BrokerProcess, History, Report, assert_history_ok, manifest_spans
from danube_ingest.testing_history import Delivery, Write, check
from tests.broker.support import metadata, raw_stubs
from tests.broker.test_both_clients import create_topic

from . import harness
from .conftest import BrokerFactory
from .harness import Load, Reader, acked_count, read_all, record, summary

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

log = logging.getLogger(__name__)

TOPIC = "/default/owner-kill"
LEASE_TTL = 4
#: Kill/restart cycles of scenario 1 (the owner alternates: A, B, A).
CYCLES = 3
#: Acknowledged messages per cycle before the kill, per client.
DANUBE_PER_CYCLE = 40
BATCH_PER_CYCLE = 1000
#: danube-client's retries before it looks the topic up again (on the broker it is connected
#: to: the restarted old owner redirects it to the new one). The harness's budget (a minute of
#: retries, to ride through a restart of the only daemon) would keep it on a broker that no
#: longer owns the topic for that minute.
FOLLOW_BUDGET = {"max_retries": 8, "base_backoff_ms": 100, "max_backoff_ms": 500}
#: Bound of each wait (a loaded 2-core machine starts a broker in about 2.5 s).
WAIT = 45.0


class BatchLoad(Load):
    """A batch-client load that stops sending after ``limit`` messages (their answers are still
    awaited and logged): unbounded, it publishes tens of thousands a second while a cycle waits
    for danube-client, more than the subscribers can read back in the test's time."""

    def __init__(self, url: str, history: History, name: str, limit: int) -> None:
        self._stop_asked = False
        super().__init__("batch", url, TOPIC, history, name)
        self.limit = limit

    @property
    def _stopping(self) -> bool:
        return self._stop_asked or self.sent >= self.limit

    @_stopping.setter
    def _stopping(self, value: bool) -> None:
        self._stop_asked = value


def _storage(root: Path, segment_seconds: int) -> dict[str, Any]:
    """``wal_cloud`` on a shared fs store; segments sealed (and uploaded) every
    ``segment_seconds``: what was acknowledged since is only in the owner's WAL."""
    return {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(root)},
        "wal": {"segment_seconds": segment_seconds},
    }


async def _handover(etcd: str, prefix: str, previous: str, state: str) -> Handover:
    """The topic's takeover record once it waits on / was resolved for ``previous``."""
    deadline = time.monotonic() + WAIT
    async with metadata(etcd, prefix) as records:
        while True:
            found = await read_handover(records.kv, Keys(prefix), TOPIC)
            if found is not None and (found[0].previous, found[0].state) == (previous, state):
                return found[0]
            assert time.monotonic() < deadline, f"no {state} record for {previous}: {found}"
            await asyncio.sleep(0.1)


async def _refused_while_waiting(url: str, previous: str) -> None:
    """A lookup on the survivor is refused UNAVAILABLE, naming the broker it waits for."""
    async with raw_stubs(url) as raw:
        try:
            answer = await raw.discovery.TopicLookup(
                pb.TopicLookupRequest(request_id=1, topic=TOPIC), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert f"waits for broker {previous}" in (exc.details() or ""), exc.details()
            return
    raise AssertionError(f"{url} answered a lookup while waiting for {previous}: {answer}")


async def _forget(etcd: str, prefix: str, broker_id: str) -> str:
    """``danube-ingest brokers forget ID`` as an operator runs it: refused (exit 2) while the
    broker is registered (its lease not yet expired), so retried until accepted; its stdout."""
    deadline = time.monotonic() + WAIT
    command = [sys.executable, "-m", "danube_ingest.cli", "brokers", "forget", broker_id]
    command += ["--etcd", etcd, "--prefix", prefix]
    while True:
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode == 0:
            return done.stdout
        assert done.returncode == 2 and "is alive" in done.stderr, done
        assert time.monotonic() < deadline, f"{broker_id} still registered: {done.stderr}"
        await asyncio.sleep(0.5)


async def _manifest_and_jumps(etcd: str, prefix: str) -> tuple[list[Any], list[OffsetJump]]:
    async with metadata(etcd, prefix) as records:
        keys = Keys(prefix)
        ranges = await Manifest(records.kv, keys).ranges(TOPIC)
        return list(ranges), await read_jumps(records.kv, keys, TOPIC)


async def _start(*brokers: BrokerProcess) -> None:
    for broker in brokers:
        await asyncio.to_thread(broker.start)


async def _subscriptions(owner: BrokerProcess, history: History) -> Reader:
    """Create the topic on ``owner``, the ``audit`` subscription at offset 0 (read at the end),
    and the live acking subscriber."""
    await create_topic(owner.url, TOPIC)
    audit = Reader("danube", owner.url, TOPIC, "audit", history, name="audit")
    await audit.start()
    await audit.close()
    live = Reader("danube", owner.url, TOPIC, "live", history)
    await live.start()
    return live


def _check(history: History, ranges: list[Any], jumps: list[OffsetJump], **options: Any) -> Report:
    return assert_history_ok(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        manifest=manifest_spans(ranges),
        gaps={TOPIC: [(j.start, j.end) for j in jumps]},
        **options,
    )


@pytest.mark.timeout(120)
async def test_owner_sigkilled_and_restarted_hands_its_tail_to_the_survivor(
    brokers: BrokerFactory,
    history: History,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _storage(tmp_path / "objects", segment_seconds=2)
    owner = brokers("broker-a", storage=storage, lease_ttl=LEASE_TTL)
    survivor = brokers("broker-b", storage=storage, lease_ttl=LEASE_TTL)
    await _start(owner, survivor)
    started = time.monotonic()
    live = await _subscriptions(owner, history)
    monkeypatch.setattr(harness, "RETRY_BUDGET", FOLLOW_BUDGET)
    danube = Load("danube", owner.url, TOPIC, history, "d0")
    batch = BatchLoad(owner.url, history, "b0", BATCH_PER_CYCLE)
    await danube.start()
    await batch.start()
    recoveries: list[float] = []
    try:
        for cycle in range(CYCLES):
            await batch.wait_acked(BATCH_PER_CYCLE, timeout=WAIT)
            await batch.stop()
            await danube.wait_acked(danube.acked + DANUBE_PER_CYCLE, timeout=WAIT)
            history.fault("sigkill", f"cycle {cycle} owner {owner.broker_id}")
            owner.kill()
            killed = time.monotonic()
            before = danube.acked
            await live.close()  # its consumer did not follow on its own (see the docstring)
            batch = BatchLoad(survivor.url, history, f"b{cycle + 1}", BATCH_PER_CYCLE)
            await batch.start()
            await _handover(etcd_server, etcd_prefix, owner.broker_id, PENDING)
            await _refused_while_waiting(survivor.url, owner.broker_id)
            assert batch.acked == 0, "the survivor served before the old owner's tail was back"
            await asyncio.to_thread(owner.start)
            await _handover(etcd_server, etcd_prefix, owner.broker_id, RECOVERED)
            live = Reader("danube", survivor.url, TOPIC, "live", history, name=f"c{cycle + 2}")
            await live.start()
            await batch.wait_acked(1, timeout=WAIT)
            await danube.wait_acked(before + 1, timeout=WAIT)
            recoveries.append(time.monotonic() - killed)
            log.info("cycle=%d owner=%s recovered_s=%.2f", cycle, owner.broker_id, recoveries[-1])
            owner, survivor = survivor, owner
        await batch.wait_acked(BATCH_PER_CYCLE, timeout=WAIT)
        await batch.stop()
        await danube.wait_acked(danube.acked + DANUBE_PER_CYCLE, timeout=WAIT)
        await danube.stop()
        await read_all("danube", owner.url, TOPIC, history, [live], timeout=30)
    finally:
        await live.close()
    ranges, jumps = await _manifest_and_jumps(etcd_server, etcd_prefix)
    assert jumps == [], f"a recovered takeover jumped: {jumps}"
    report = _check(history, ranges, jumps)
    assert report["declared_lost"] == 0
    record(
        "owner-sigkill-restart",
        "danube+batch",
        report,
        cycles=CYCLES,
        declared_lost=0,
        manifest_ranges=len(ranges),
        seconds=round(time.monotonic() - started, 1),
        **summary(recoveries),
    )


def _placed_offsets(history: History) -> dict[tuple[str, int], int]:
    """Each acknowledged write's offset: the one its producer was told (batch client), else the
    one a subscription received it at (danube-client does not say)."""
    placed: dict[tuple[str, int], int] = {}
    for event in history.events:
        if isinstance(event, Delivery) and event.producer is not None:
            assert event.sequence is not None
            placed.setdefault((event.producer, event.sequence), event.offset)
    acked = {
        (e.producer, e.sequence): e.offset
        for e in history.events
        if isinstance(e, Write) and e.acked
    }
    return {key: told if told is not None else placed[key] for key, told in acked.items()}


@pytest.mark.timeout(120)
async def test_owner_sigkilled_for_good_is_forgotten_and_its_tail_declared_lost(
    brokers: BrokerFactory,
    history: History,
    tmp_path: Path,
    etcd_server: str,
    etcd_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(harness, "RETRY_BUDGET", FOLLOW_BUDGET)
    # Segments sealed every 5 s: the tail acknowledged since is certainly not uploaded.
    storage = _storage(tmp_path / "objects", segment_seconds=5)
    owner = brokers("broker-a", storage=storage, lease_ttl=LEASE_TTL)
    survivor = brokers("broker-b", storage=storage, lease_ttl=LEASE_TTL)
    await _start(owner, survivor)
    started = time.monotonic()
    live = await _subscriptions(owner, history)
    danube = Load("danube", owner.url, TOPIC, history, "d0")
    batch = BatchLoad(owner.url, history, "b0", BATCH_PER_CYCLE)
    await danube.start()
    await batch.start()
    try:
        await batch.wait_acked(BATCH_PER_CYCLE, timeout=WAIT)
        await batch.stop()
        await danube.wait_acked(DANUBE_PER_CYCLE, timeout=WAIT)
        # Both loads stopped and the live subscriber caught up before the kill, so every
        # acknowledged write has a known offset (danube-client's acks do not carry one): the
        # declared-lost count can then be checked exactly.
        await danube.stop()
        assigned = acked_count(history, TOPIC)
        assert all(e.acked for e in history.events if isinstance(e, Write))
        await live.wait_count(assigned, timeout=WAIT)
        history.fault("sigkill", f"owner {owner.broker_id}, never restarted")
        owner.kill()
        killed = time.monotonic()
        # danube-client looks a topic up on the broker it is connected to, which is gone for
        # good: the application reconnects its clients through the survivor.
        await live.close()
        danube = Load("danube", survivor.url, TOPIC, history, "d1")
        batch = BatchLoad(survivor.url, history, "b1", BATCH_PER_CYCLE)
        await danube.start()
        await batch.start()
        pending = await _handover(etcd_server, etcd_prefix, owner.broker_id, PENDING)
        await _refused_while_waiting(survivor.url, owner.broker_id)
        assert (batch.acked, danube.acked) == (0, 0), "served before the tail was resolved"
        said = await _forget(etcd_server, etcd_prefix, owner.broker_id)
        assert f"{TOPIC}: offsets {pending.committed}..{pending.reserved - 1}" in said, said
        resolved = await _handover(etcd_server, etcd_prefix, owner.broker_id, LOST)
        live = Reader("danube", survivor.url, TOPIC, "live", history, name="c2")
        await live.start()
        await batch.wait_acked(1, timeout=WAIT)
        await danube.wait_acked(1, timeout=WAIT)
        recovered = time.monotonic() - killed
        await batch.wait_acked(BATCH_PER_CYCLE, timeout=WAIT)
        await batch.stop()
        await danube.wait_acked(DANUBE_PER_CYCLE, timeout=WAIT)
        await danube.stop()
        await read_all("danube", survivor.url, TOPIC, history, [live], timeout=30)
    finally:
        await live.close()
    ranges, jumps = await _manifest_and_jumps(etcd_server, etcd_prefix)
    [jump] = jumps
    assert (jump.start, jump.end, jump.broker, jump.reason) == (
        pending.committed,
        pending.reserved,
        owner.broker_id,
        "lost",
    )
    assert resolved.end == jump.end
    # The dead owner assigned offsets 0..assigned-1 (every write before the kill acknowledged);
    # those from the manifest's end on were only in its WAL.
    assert pending.committed < assigned <= pending.reserved
    in_jump = {k for k, o in _placed_offsets(history).items() if jump.start <= o < jump.end}
    assert len(in_jump) == assigned - pending.committed
    silent = check(
        history,
        subscriptions=[(TOPIC, "live"), (TOPIC, "audit")],
        gaps={TOPIC: [(jump.start, jump.end)]},
    )
    assert silent["lost"] >= len(in_jump)  # without the declaration, they count as lost
    report = _check(history, ranges, jumps, declared_lost={TOPIC: [(jump.start, jump.end)]})
    assert report["declared_lost"] == len(in_jump)
    record(
        "owner-sigkill-forgotten",
        "danube+batch",
        report,
        cycles=1,
        declared_lost=report["declared_lost"],
        manifest_ranges=len(ranges),
        seconds=round(time.monotonic() - started, 1),
        recover_s_max=round(recovered, 2),
    )
