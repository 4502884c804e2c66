"""Cursors reach etcd within a short life: a daemon (a child process) that a consumer acked
through for about 1.5 s before a SIGKILL has persisted the subscription's cursor, life after
life, so each restart redelivers only what was acked in the last flush interval (found by the
SIGKILL fault scenario: killed every few seconds, each restart redelivered from 0)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from danube_ingest.testing import BrokerProcess

from .support import Clients, metadata, stop_all

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/cursorlife"
#: Messages published in each life (more than the consumer acks in one).
MESSAGES = 800
#: Daemon lives, each killed after the consumer acked for ACKING_SECONDS.
LIVES = 3
ACKING_SECONDS = 1.5
#: The cursor flush interval the daemon promises ("cursors are persisted about once a second"),
#: plus what an etcd write may take on a loaded machine.
FLUSH_INTERVAL = 1.0
WRITE_SLACK = 0.25


@pytest.mark.timeout(120)
async def test_a_cursor_acked_for_a_second_survives_each_sigkill(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix, lease_ttl=4)
    previous: int | None = None
    try:
        for life in range(LIVES):
            await asyncio.to_thread(broker.start)
            acked: list[tuple[float, int]] = []  # (monotonic time, offset)
            async with Clients(broker.url) as clients:
                producer = await clients.producer(TOPIC)
                consumer = await clients.consumer(TOPIC, "sub", "c1")  # first: at offset 0
                for i in range(MESSAGES):
                    await producer.send(b"m%d" % i, None)
                start = time.monotonic()
                while time.monotonic() - start < ACKING_SECONDS:
                    (message,) = await consumer.take(1)
                    offset = message.msg_id.topic_offset
                    if not acked:
                        assert offset == (previous or 0), f"life {life} resumed at {offset}"
                    await consumer.consumer.ack(message)
                    acked.append((time.monotonic(), offset))
                    await asyncio.sleep(0.002)  # a consumer that works a little per message
                broker.kill()
                killed = time.monotonic()
            # What was acked a flush interval before the kill must be in etcd.
            due = [offset for at, offset in acked if at < killed - FLUSH_INTERVAL - WRITE_SLACK]
            assert due, f"life {life}: nothing acked before the last flush interval"
            async with metadata(etcd_server, etcd_prefix) as records:
                cursor = await records.get_cursor(TOPIC, "sub")
            assert cursor is not None and cursor > max(due), (
                f"life {life}: cursor {cursor} in etcd after acks of offsets {acked[0][1]}-"
                f"{acked[-1][1]} over {ACKING_SECONDS}s; those up to {max(due)} were acked more "
                f"than {FLUSH_INTERVAL}s before the kill and would be redelivered"
            )
            previous = cursor
    finally:
        await stop_all([broker])
