"""A batch consumer whose process dies (SIGKILL, no goodbye on its stream) is detached by the
daemon as soon as its connection closes: the messages it held unacknowledged go to the other
consumers of the subscription within about a second, not after the stall sweep
(``topics.CONSUMER_STALL_SECONDS``) or the ack timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.broker.topics import CONSUMER_STALL_SECONDS
from danube_ingest.client import Consumer, Producer

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(60)]

TOPIC = "/default/consumer-death"
HELD = 50
#: How soon the dead consumer's messages must reach the survivor: its connection closes at
#: once on loopback; the bound leaves room for a busy machine, far below the stall sweep.
REDELIVERY_BOUND_S = 2.5
#: Kills per test: whether gRPC cancels the handler or ends its request stream first when a
#: connection dies is a race, and only the first left the consumer attached (before the fix,
#: about half the kills): four rounds catch that nearly every time.
ROUNDS = 4


@pytest.mark.parametrize(
    "backlog",
    [
        pytest.param(0, id="nothing-more-to-send"),
        # More than the dead consumer's connection takes in: the daemon is sending to it.
        pytest.param(2000, id="daemon-sending-to-it"),
    ],
)
async def test_a_killed_consumers_unacked_messages_go_to_another_within_seconds(
    broker: Broker, backlog: int
) -> None:
    assert REDELIVERY_BOUND_S < CONSUMER_STALL_SECONDS / 2
    async with Producer(broker.url, TOPIC, linger_ms=1) as producer:
        for _ in range(ROUNDS):
            await _kill_a_holder(broker, producer, backlog)


async def _kill_a_holder(broker: Broker, producer: Producer, backlog: int) -> None:
    """Publish; a child consumer takes the first ``HELD`` and is SIGKILLed; a survivor must get
    those within the bound, then everything else."""
    sent = [await producer.send(b"%d" % i + bytes(1000)) for i in range(HELD + backlog)]
    offsets = await asyncio.gather(*sent)
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.broker.consumer_child", broker.url, TOPIC, "s", str(HELD)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.to_thread(child.stdout.readline)
        assert line.strip() == f"holding {HELD}".encode(), line + child.stdout.read()
        held = set(offsets[:HELD])  # (the only consumer then: it got the first batch)
        async with Consumer(
            broker.url, TOPIC, "s", consumer_name="survivor", sub_type="shared"
        ) as survivor:
            child.kill()
            await asyncio.to_thread(child.wait, 10)
            killed = time.monotonic()
            got: set[int] = set()
            while not held <= got:
                left = killed + REDELIVERY_BOUND_S - time.monotonic()
                try:
                    batch = await survivor.receive(timeout=max(left, 0.01))
                except TimeoutError:
                    raise AssertionError(
                        f"{len(held & got)} of the {HELD} messages the killed consumer held "
                        f"reached the survivor within {REDELIVERY_BOUND_S}s"
                    ) from None
                got.update(batch.offsets)
                survivor.ack(batch)
            while len(got) < len(offsets):  # (the rest: whatever the daemon had sent it)
                batch = await survivor.receive(timeout=20)
                got.update(batch.offsets)
                survivor.ack(batch)
            assert got == set(offsets)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
