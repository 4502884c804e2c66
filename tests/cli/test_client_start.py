"""Where a new subscription starts: the ``x-danube-ingest-start`` Subscribe metadata through a
real daemon and the real danube-client, and ``danube-ingest produce`` / ``consume`` as child
processes (the README's example: produce N, then consume N with a fresh subscription)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from danube import DanubeClientBuilder, DispatchStrategy, SubType
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.server import Broker
from danube_ingest.broker.start import METADATA_KEY, StartPosition
from danube_ingest.testing import broker_config, running_broker

pytestmark = pytest.mark.etcd

#: Seconds to wait for a message that is expected (generous: CI machines stall).
RECEIVE_TIMEOUT = 10.0
#: Bound on one CLI child process (start-up of danube-client and our package included).
CLI_TIMEOUT = 60.0


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


class _Client:
    """danube-client plus raw stubs on one broker; everything closed on exit."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._closers: list[Any] = []

    async def __aenter__(self) -> _Client:
        self.client = await DanubeClientBuilder().service_url(self.url).build()
        self.channel = grpc.aio.insecure_channel(self.url.removeprefix("http://"))
        self.consumers = pb_grpc.ConsumerServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for close in reversed(self._closers):
            await close()
        for connection in list(self.client.connection_manager._connections.values()):
            await connection.channel.close()
        await self.channel.close()

    async def produce(self, topic: str, count: int, name: str = "p1") -> None:
        producer = (
            self.client.new_producer()
            .with_topic(topic)
            .with_name(name)
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .build()
        )
        await producer.create()
        self._closers.append(producer.close)
        for i in range(count):
            await producer.send(f"m{i}".encode(), {})

    async def subscribe_raw(self, topic: str, sub: str, name: str, start: str | None) -> int:
        """One Subscribe with our start metadata (None: none, as danube-client sends)."""
        metadata = None if start is None else ((METADATA_KEY, start),)
        request = pb.ConsumerRequest(
            request_id=1,
            topic_name=topic,
            consumer_name=name,
            subscription=sub,
            subscription_type=int(SubType.EXCLUSIVE),
        )
        response = await self.consumers.Subscribe(request, metadata=metadata)
        return int(response.consumer_id)

    async def consume(self, topic: str, sub: str, name: str) -> asyncio.Queue[Any]:
        consumer = (
            self.client.new_consumer()
            .with_topic(topic)
            .with_consumer_name(name)
            .with_subscription(sub)
            .with_subscription_type(SubType.EXCLUSIVE)
            .build()
        )
        await consumer.subscribe()
        self._closers.append(consumer.close)
        return await consumer.receive()


async def _offsets(queue: asyncio.Queue[Any], n: int) -> list[int]:
    got = []
    try:
        async with asyncio.timeout(RECEIVE_TIMEOUT):
            while len(got) < n:
                got.append(int((await queue.get()).msg_id.topic_offset))
    except TimeoutError:
        raise AssertionError(f"got {len(got)} of {n} messages: offsets {got}") from None
    return got


async def _nothing_within(queue: asyncio.Queue[Any], seconds: float) -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(seconds):
            message = await queue.get()
            raise AssertionError(f"unexpected message at {message.msg_id.topic_offset}")


@pytest.mark.parametrize(
    ("start", "first"),
    [("earliest", 0), ("offset:3", 3), ("4", 4), ("offset:0", 0)],
)
async def test_a_new_subscription_starts_where_asked(
    broker: Broker, start: str, first: int
) -> None:
    t = "/default/start_at"
    async with _Client(broker.url) as c:
        await c.produce(t, 6)
        await c.subscribe_raw(t, "s", "c1", start)
        queue = await c.consume(t, "s", "c1")  # same name: same consumer, takes over
        assert await _offsets(queue, 6 - first) == list(range(first, 6))


async def test_without_metadata_a_new_subscription_starts_at_the_end(broker: Broker) -> None:
    """danube-client sends no start position: Danube's default (latest) stays."""
    t = "/default/start_latest"
    async with _Client(broker.url) as c:
        await c.produce(t, 3)
        queue = await c.consume(t, "s", "c1")
        await _nothing_within(queue, 0.5)
        await c.produce(t, 1, name="p2")
        assert await _offsets(queue, 1) == [3]


async def test_an_offset_past_the_end_means_from_the_end(broker: Broker) -> None:
    t = "/default/start_past_end"
    async with _Client(broker.url) as c:
        await c.produce(t, 3)
        await c.subscribe_raw(t, "s", "c1", "offset:1000")
        queue = await c.consume(t, "s", "c1")
        await _nothing_within(queue, 0.5)
        await c.produce(t, 1, name="p2")
        assert await _offsets(queue, 1) == [3]


async def test_time_starts_at_the_first_message_ingested_at_or_after_it(broker: Broker) -> None:
    t = "/default/start_time"
    async with _Client(broker.url) as c:
        await c.produce(t, 3)
        await asyncio.sleep(0.05)  # ingest times are in ms: make the boundary unambiguous
        boundary_ms = int(time.time() * 1000)
        await asyncio.sleep(0.05)
        await c.produce(t, 3, name="p2")
        iso = datetime.fromtimestamp(boundary_ms / 1000, UTC).isoformat()
        await c.subscribe_raw(t, "by_ms", "c1", f"time:{boundary_ms}")
        await c.subscribe_raw(t, "by_iso", "c2", iso)
        by_ms = await c.consume(t, "by_ms", "c1")
        by_iso = await c.consume(t, "by_iso", "c2")
        assert await _offsets(by_ms, 3) == [3, 4, 5]
        assert await _offsets(by_iso, 3) == [3, 4, 5]
        # A time after every message: from the end.
        await c.subscribe_raw(t, "future", "c3", "time:99999999999999")
        future = await c.consume(t, "future", "c3")
        await _nothing_within(future, 0.3)


async def test_an_existing_subscription_resumes_after_its_cursor(broker: Broker) -> None:
    t = "/default/start_existing"
    async with _Client(broker.url) as c:
        await c.produce(t, 2)
        await c.subscribe_raw(t, "s", "c1", "latest")  # created at offset 2
        await c.subscribe_raw(t, "s", "c1", "earliest")  # exists: ignored
        queue = await c.consume(t, "s", "c1")
        await c.produce(t, 1, name="p2")
        assert await _offsets(queue, 1) == [2]


@pytest.mark.parametrize("bad", ["", "soon", "offset:-1", "offset:x", "time:yesterday", "-3"])
async def test_a_malformed_start_is_invalid_argument_and_creates_nothing(
    broker: Broker, bad: str
) -> None:
    t = "/default/start_bad"
    async with _Client(broker.url) as c:
        await c.produce(t, 2)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await c.subscribe_raw(t, "s", "c1", bad)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start position" in str(caught.value.details())
        assert "earliest" in str(caught.value.details())  # says what to use
        # Nothing was created: a later subscription still gets its own start.
        await c.subscribe_raw(t, "s", "c1", "earliest")
        queue = await c.consume(t, "s", "c1")
        assert await _offsets(queue, 2) == [0, 1]


def test_parse_forms() -> None:
    assert StartPosition.parse("EARLIEST") == StartPosition("earliest")
    assert StartPosition.parse(" latest ") == StartPosition("latest")
    assert StartPosition.parse("17") == StartPosition("offset", 17)
    assert StartPosition.parse("time:1700000000000") == StartPosition("time", 1700000000000)
    assert StartPosition.parse("2023-11-14T22:13:20Z") == StartPosition("time", 1700000000000)
    # Naive times are UTC.
    assert StartPosition.parse("2023-11-14T22:13:20") == StartPosition("time", 1700000000000)
    for position in ("earliest", "offset:5", "time:12"):
        assert StartPosition.parse(position).to_metadata() == position


# -- the CLI ----------------------------------------------------------------------------------


async def _cli(*argv: str) -> tuple[int, str, str]:
    """Run ``danube-ingest ARGV`` as a child process; fail if it runs past ``CLI_TIMEOUT``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "danube_ingest.cli",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        async with asyncio.timeout(CLI_TIMEOUT):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        raise AssertionError(
            f"danube-ingest {' '.join(argv)} did not finish in {CLI_TIMEOUT}s: {err.decode()}"
        ) from None
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow
async def test_produce_then_consume_with_a_fresh_subscription_finishes(broker: Broker) -> None:
    """The README's example: ``produce --count N`` then ``consume --count N``."""
    t = "/default/cli_example"
    url = ("--service-url", broker.url)
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "50")
    assert code == 0, err
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "demo", "--count", "50"
    )
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [f"{t}@{i}" for i in range(50)]
    # Run again: the subscription exists and resumes after its cursor, so it gets only what
    # is new, whatever --from says.
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "5")
    assert code == 0, err
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "demo", "--count", "5"
    )
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == [f"{t}@{i}" for i in range(50, 55)]


@pytest.mark.slow
async def test_consume_from_an_offset_and_a_bad_value(broker: Broker) -> None:
    t = "/default/cli_from"
    url = ("--service-url", broker.url)
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "10")
    assert code == 0, err
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "s7", "--from", "7", "--count", "3"
    )
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == [f"{t}@{i}" for i in (7, 8, 9)]
    code, _, err = await _cli("consume", *url, "--topic", t, "--from", "someday")
    assert code == 2
    assert "--from" in err and "'someday'" in err and "earliest" in err


def test_produce_and_consume_help_show_defaults_and_where_a_subscription_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from danube_ingest.cli import main

    for command, shown in (
        ("produce", ["(default: 10)", "(default: cli-producer)", "(default: http://"]),
        ("consume", ["(default: earliest)", "(default: cli-subscription)", "(default: 0)"]),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for needle in shown:
            assert needle in text, (command, needle, text)
    with pytest.raises(SystemExit):
        main(["consume", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "existing one resumes after its cursor" in text


async def test_earliest_and_time_reach_into_objects_below_the_wal_floor(
    tmp_path: Path, etcd_server: str
) -> None:
    """With the WAL pruned beneath them, ``earliest`` and ``time:T`` start in the objects."""
    from danube_ingest.metadata import EtcdKV, Keys
    from danube_ingest.metadata.marks import PruneMarks

    t = "/default/start_cold"
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    cold = {
        "storage.mode": "wal_cloud",
        "storage.wal.segment_bytes": "64KiB",
        "storage.wal.segment_seconds": 1,
        "storage.wal.retention.check_seconds": 0.2,
        "storage.cache.max_bytes": "16KiB",
        "storage.cache.topic_max_bytes": "16KiB",
    }
    config = broker_config(tmp_path / "b1", etcd_server, prefix=prefix, overrides=cold)
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    try:
        async with running_broker(config) as broker, _Client(broker.url) as c:
            assert broker.store is not None and broker.cleaner is not None
            producer = (
                c.client.new_producer()
                .with_topic(t)
                .with_name("p1")
                .with_dispatch_strategy(DispatchStrategy.RELIABLE)
                .build()
            )
            await producer.create()
            c._closers.append(producer.close)
            for i in range(300):
                if i == 150:
                    await asyncio.sleep(0.05)
                    boundary_ms = int(time.time() * 1000)
                    await asyncio.sleep(0.05)
                await producer.send(f"m{i}".encode().ljust(500, b"."), {})
            info = broker.store.info(t)
            assert info is not None
            await PruneMarks(kv, Keys(prefix)).set_mark("broker-1", info.region, t, 300)
            async with asyncio.timeout(30):
                while (floor := broker.store.info(t).first_offset) <= 160:  # type: ignore[union-attr]
                    await asyncio.sleep(0.1)
            await c.subscribe_raw(t, "from_start", "c1", "earliest")
            await c.subscribe_raw(t, "from_time", "c2", f"time:{boundary_ms}")
            from_start = await c.consume(t, "from_start", "c1")
            from_time = await c.consume(t, "from_time", "c2")
            assert await _offsets(from_start, 300) == list(range(300)), floor
            assert await _offsets(from_time, 150) == list(range(150, 300)), floor
    finally:
        await kv.close()


@pytest.mark.slow
async def test_consume_of_a_partitioned_topic_starts_every_partition(broker: Broker) -> None:
    t = "/default/cli_parts"
    url = ("--service-url", broker.url)
    code, _, err = await _cli("produce", *url, "--topic", t, "--partitions", "3", "--count", "12")
    assert code == 0, err
    code, out, err = await _cli("consume", *url, "--topic", t, "--count", "12")
    assert code == 0, err
    topics = [line.split("@")[0] for line in out.splitlines()]
    assert len(topics) == 12 and set(topics) == {f"{t}-part-{i}" for i in range(3)}, out
