"""Idempotent producers across a change of owner: two ``wal_cloud`` child daemons on one etcd
and one fs object store. Broker A stores an idempotent producer's batches; the topic moves to
B (``topics unload``, or A SIGKILLed, B waiting, A restarted and recovering its tail); the
producer re-sends its last batches with the same sequences to B: they are answered
``duplicate`` with their original offsets and stored once (the topic read back), and the
next sequence continues after them. B keeps the adopted table across its own restart."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from crc32c import crc32c

from danube_ingest.client import Consumer, new_producer_id
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import RECOVERED, read_handover
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import Put
from danube_ingest.metadata.producers import HandedProducers
from danube_ingest.proto import ingest_pb2 as ipb
from danube_ingest.proto import ingest_pb2_grpc as ipb_grpc
from danube_ingest.testing import BrokerProcess
from danube_ingest.wal.block import encode_block
from danube_ingest.wal.framing import Entry

from .conftest import StartProcess
from .support import LEASE_TTL, wal_cloud_storage

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(180)]

TOPIC = "/default/idempotent-moves"
#: Bound of every wait below (a loaded 2-core machine is slow to start brokers).
WAIT = LEASE_TTL + 40.0
#: Entries per batch, batches stored by A.
N = 50
BATCHES = 10

StartBroker = Callable[[str], Awaitable[BrokerProcess]]


@pytest.fixture
def start_broker(start_process: StartProcess, objects_root: Path) -> StartBroker:
    """``await start_broker("broker-a")``: a ``wal_cloud`` broker process on a shared fs
    object root, sealing segments every 2 s."""

    async def start(broker_id: str) -> BrokerProcess:
        return await start_process(broker_id, wal_cloud_storage(objects_root, 2))

    return start


def batch(pid: int, seq: int) -> Any:
    block, sizes = encode_block([Entry(b"%d-%d" % (seq, i)) for i in range(N)])
    return ipb.PublishRequest(
        topic=TOPIC,
        producer_id=pid,
        sequence=seq,
        count=N,
        entries=block,
        sizes=sizes,
        crc32c=crc32c(block),
        request_id=seq,
    )


async def publish(url: str, requests: list[Any]) -> list[Any]:
    """Send ``requests`` one at a time, each again while the broker answers UNAVAILABLE (the
    topic is still owned elsewhere, or a takeover waits); their final answers, in order."""
    answers = []
    deadline = time.monotonic() + WAIT
    async with grpc.aio.insecure_channel(url.split("://")[-1]) as channel:
        stub = ipb_grpc.IngestServiceStub(channel)  # type: ignore[no-untyped-call]
        for request in requests:
            while True:
                call = stub.Publish()
                await call.write(request)
                answer = await asyncio.wait_for(call.read(), 30)
                await call.done_writing()
                if answer.code != grpc.StatusCode.UNAVAILABLE.value[0]:
                    break
                assert time.monotonic() < deadline, f"still unavailable: {answer.error}"
                await asyncio.sleep(0.2)
            answers.append(answer)
    return answers


async def read_back(url: str, count: int) -> list[Entry]:
    async with Consumer(url, TOPIC, "check", start="earliest") as consumer:
        seen: list[Entry] = []
        while len(seen) < count:
            delivered = await consumer.receive(timeout=30)
            seen.extend(delivered.entries)
            consumer.ack(delivered)
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout=1.5)  # nothing more: nothing stored twice
    return seen


def cli(etcd: str, prefix: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *args, "--etcd", etcd, "--prefix", prefix],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def resend_and_check(b: BrokerProcess, pid: int) -> None:
    """The producer's last three batches again (stored by A), then the next one, through B;
    then B is SIGKILLed and restarted and answers a re-sent batch the same way."""
    again = await publish(b.url, [batch(pid, seq) for seq in (7, 8, 9, BATCHES)])
    assert [(a.code, a.error, a.base_offset, a.count, a.duplicate) for a in again] == [
        (0, "", 7 * N, N, True),
        (0, "", 8 * N, N, True),
        (0, "", 9 * N, N, True),
        (0, "", BATCHES * N, N, False),
    ]
    b.kill(signal.SIGKILL)
    await asyncio.to_thread(b.start)
    after = await publish(b.url, [batch(pid, seq) for seq in (9, BATCHES, BATCHES + 1)])
    assert [(a.code, a.base_offset, a.duplicate) for a in after] == [
        (0, 9 * N, True),
        (0, BATCHES * N, True),
        (0, (BATCHES + 1) * N, False),
    ]
    seen = await read_back(b.url, (BATCHES + 2) * N)
    assert [e.offset for e in seen] == list(range((BATCHES + 2) * N))
    assert [e.payload for e in seen] == [
        b"%d-%d" % (seq, i) for seq in range(BATCHES + 2) for i in range(N)
    ]
    assert "producer table adopted" in b.log_text()
    assert "Traceback" not in b.log_text()


@pytest.mark.parametrize("move", ["unload", "shutdown"])
async def test_a_handed_over_topics_producer_resends_are_duplicates_at_the_new_owner(
    start_broker: StartBroker, etcd_server: str, etcd_prefix: str, move: str
) -> None:
    """A clean hand-over: ``topics unload``, or A's clean shutdown (SIGTERM)."""
    a = await start_broker("broker-a")
    b = await start_broker("broker-b")
    pid = new_producer_id()
    first = await publish(a.url, [batch(pid, seq) for seq in range(BATCHES)])
    assert [(x.code, x.base_offset) for x in first] == [(0, N * s) for s in range(BATCHES)]

    if move == "unload":
        out = await asyncio.to_thread(cli, etcd_server, etcd_prefix, "topics", "unload", TOPIC)
        assert f"topic {TOPIC} unloaded from broker-a" in out, out
    else:
        await asyncio.to_thread(a.stop)
    await resend_and_check(b, pid)
    assert "producer table in the hand-over" in a.log_text()


async def test_a_recovered_takeover_hands_the_producer_table_over(
    start_broker: StartBroker, kv: EtcdKV, keys: Keys
) -> None:
    a = await start_broker("broker-a")
    b = await start_broker("broker-b")
    pid = new_producer_id()
    first = await publish(a.url, [batch(pid, seq) for seq in range(BATCHES)])
    assert [(x.code, x.base_offset) for x in first] == [(0, N * s) for s in range(BATCHES)]

    a.kill(signal.SIGKILL)
    # B waits for A's tail (UNAVAILABLE) while A is down; A comes back and recovers it.
    resent = asyncio.ensure_future(resend_and_check(b, pid))
    deadline = time.monotonic() + WAIT
    while (found := await read_handover(kv, keys, TOPIC)) is None:
        assert time.monotonic() < deadline, "B never began waiting for A's tail"
        assert not resent.done(), resent
        await asyncio.sleep(0.1)
    await asyncio.to_thread(a.start)
    await asyncio.wait_for(resent, 2 * WAIT)
    found = await read_handover(kv, keys, TOPIC)
    assert found is not None and found[0].state == RECOVERED
    assert found[0].end == BATCHES * N
    assert "producer table in the hand-over" in a.log_text()


async def test_a_stale_table_is_ignored_and_an_earlier_ownerships_table_cleared(
    start_broker: StartBroker, etcd_server: str, etcd_prefix: str, kv: EtcdKV, keys: Keys
) -> None:
    """B stores sequences 0-2, hands the topic to A (clean shutdown), A stores 3-4 and unloads
    back to B, but the table A handed over is replaced by a stale one (as when a later owner
    assigned offsets and lost them): B ignores and deletes it, and forgets the table its WAL
    kept from its first ownership, which would refuse sequence 5 as a gap after 2."""
    a = await start_broker("broker-a")
    b = await start_broker("broker-b")
    pid = new_producer_id()
    assert [x.base_offset for x in await publish(b.url, [batch(pid, s) for s in range(3)])] == [
        0,
        N,
        2 * N,
    ]
    await asyncio.to_thread(b.stop)
    moved = await publish(a.url, [batch(pid, s) for s in (2, 3, 4)])
    assert [(x.code, x.base_offset, x.duplicate) for x in moved] == [
        (0, 2 * N, True),
        (0, 3 * N, False),
        (0, 4 * N, False),
    ]
    await asyncio.to_thread(b.start)
    out = await asyncio.to_thread(cli, etcd_server, etcd_prefix, "topics", "unload", TOPIC)
    assert f"topic {TOPIC} unloaded from broker-a" in out, out
    stale = HandedProducers(N, 1, "broker-x", {pid: [(0, 0, N)]})
    await kv.txn([], [Put(keys.producers(TOPIC), stale.encode())])

    [answer] = await publish(b.url, [batch(pid, 5)])
    assert (answer.code, answer.error, answer.base_offset, answer.duplicate) == (
        0,
        "",
        5 * N,
        False,
    )
    assert await kv.get(keys.producers(TOPIC)) is None
    assert "stale producer table ignored" in b.log_text()
