"""An etcd outage longer than the broker's lease, seen by danube-client objects that stay alive.

The broker (in this process) gives its topics up when its lease runs out (fencing), but keeps
its consumers' ``ReceiveMessages`` streams open and answers them nothing until etcd is back and
the topic is acquired again; then dispatch resumes on the same streams from the persisted
cursor. The test stops the real etcd server process under a live producer and consumer,
restarts it on the same data dir and port, and checks that the same consumer object receives
every acknowledged message without being re-subscribed.

``DANUBE_TEST_ETCD_OUTAGE`` sets the outages in seconds, comma-separated (default ``17,30``: 30 s
is the outage the defect was reported with) and ``DANUBE_TEST_LEASE_TTL`` the broker's lease TTL
(default 2). The 17 s outage is longer
than the lease plus danube-client's 5 s health-check interval (so a health check always falls in
the time the broker owns nothing), and ends between two of gRPC's default reconnect attempts
(~15.8 and ~26.3 s after etcd went away), where a broker that kept gRPC's default backoff would
reach etcd again only ~9 s after it is back.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from danube import SubType

from danube_ingest.testing import LocalEtcd, broker_config, running_broker

from .support import Clients

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

TOPIC = "/default/outage"
OUTAGES = [float(s) for s in os.environ.get("DANUBE_TEST_ETCD_OUTAGE", "17,30").split(",")]
#: The broker's lease TTL: the outage must outlast it, so the broker really loses its topics.
LEASE_TTL = int(os.environ.get("DANUBE_TEST_LEASE_TTL", "2"))
#: Seconds from etcd answering again to the first acknowledged publish and the first delivery:
#: measured 0.4-1.0 s; ~9 s or more before the etcd client's reconnect backoff was bounded.
RECOVERY_BOUND = 5.0
#: Messages the producer must get acknowledged after etcd is back before it stops.
AFTER = 50


@pytest.mark.parametrize("outage", OUTAGES)
async def test_consumer_keeps_receiving_across_an_etcd_outage(
    tmp_path: Path, outage: float
) -> None:
    assert outage > LEASE_TTL, "the outage must outlast the broker's lease"
    async with (
        LocalEtcd() as etcd,
        running_broker(
            broker_config(
                tmp_path / "b1", etcd.endpoint, overrides={"etcd.lease_ttl_seconds": LEASE_TTL}
            )
        ) as broker,
        Clients(broker.url) as clients,
    ):
        producer = await clients.producer(TOPIC, "p1")
        sub = await clients.consumer(TOPIC, "s1", "c1", SubType.EXCLUSIVE)
        receive_loops = list(sub.consumer._tasks)

        acked: list[bytes] = []
        received: list[bytes] = []
        restarted: list[float] = []  # when etcd answered again
        first_ack_after: list[float] = []
        first_delivery_after: list[float] = []
        stop_producing = asyncio.Event()

        async def produce() -> None:
            i = 0
            stop_after = 0
            while not stop_producing.is_set():
                payload = f"m{i}".encode()
                try:
                    await producer.send(payload, {"i": str(i)})
                except Exception:
                    # Refused while etcd is away (UNAVAILABLE after danube-client's retries):
                    # the application sends the same message again.
                    await asyncio.sleep(0.2)
                    continue
                acked.append(payload)
                if restarted and not first_ack_after:
                    first_ack_after.append(time.monotonic() - restarted[0])
                    stop_after = len(acked) + AFTER
                if first_ack_after and len(acked) >= stop_after:
                    return
                i += 1
                await asyncio.sleep(0.01)

        async def consume() -> None:
            while True:
                message = await sub.queue.get()
                received.append(message.payload)
                if restarted and not first_delivery_after:
                    first_delivery_after.append(time.monotonic() - restarted[0])
                await sub.consumer.ack(message)

        consuming = asyncio.create_task(consume())
        producing = asyncio.create_task(produce())
        try:
            await _until(lambda: len(received) >= 20, "deliveries before the outage", 10)
            await asyncio.to_thread(etcd.server.stop)
            await asyncio.sleep(outage)
            await asyncio.to_thread(etcd.server.start)
            await asyncio.to_thread(etcd.server.wait_healthy)
            restarted.append(time.monotonic())
            await asyncio.wait_for(producing, 30)

            def missing() -> set[bytes]:
                return set(acked) - set(received)

            await _until(lambda: not missing(), "every acknowledged message", 30, missing)
        finally:
            stop_producing.set()
            for task in (producing, consuming):
                task.cancel()
            await asyncio.gather(producing, consuming, return_exceptions=True)

        # The same consumer object, never re-subscribed by the test, still has its receive
        # loop running (danube-client ends it silently when a re-subscribe fails).
        assert sub.consumer._tasks == receive_loops
        assert not any(task.done() for task in receive_loops), "the receive loop ended"
        print(
            f"etcd down {outage:.0f}s (lease {LEASE_TTL}s): {len(acked)} messages acknowledged, "
            f"{len(received)} deliveries ({len(received) - len(set(received))} redelivered); "
            f"etcd back -> first acknowledged publish {first_ack_after[0]:.2f}s, "
            f"-> first delivery {first_delivery_after[0]:.2f}s"
        )
        assert first_ack_after[0] < RECOVERY_BOUND
        assert first_delivery_after[0] < RECOVERY_BOUND


async def _until(
    condition: Callable[[], bool],
    what: str,
    timeout: float,
    detail: Callable[[], object] | None = None,
) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` (and ``detail()``) on timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            extra = f": {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        await asyncio.sleep(0.05)
