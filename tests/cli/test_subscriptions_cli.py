"""``danube-ingest subscriptions reset|delete`` through the topic's owner, against a real
daemon and etcd: every kind of position, refusal while a consumer is connected, deletion, and
bad input refused before anything is sent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli import main
from danube_ingest.testing import broker_config, running_broker
from tests.cli.cli_support import run_cli

pytestmark = pytest.mark.etcd


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


async def _offsets(broker: Broker, topic: str, sub: str, count: int) -> list[int]:
    code, out, err = await run_cli(
        "consume", "--service-url", broker.url, "--topic", topic, "--subscription", sub,
        "--count", str(count), "--print", "{offset}",
    )  # fmt: skip
    assert code == 0, err
    return [int(line) for line in out.splitlines()]


async def _reset(broker: Broker, topic: str, sub: str, to: str) -> tuple[int, str, str]:
    return await run_cli(
        "subscriptions", "reset", topic, sub, "--to", to, "--service-url", broker.url
    )


@pytest.mark.slow
async def test_reset_to_each_kind_of_position_then_delete(broker: Broker) -> None:
    url = ("--service-url", broker.url)
    etcd = ("--etcd", broker.config.etcd.endpoints[0], "--prefix", broker.config.etcd.prefix)
    topic = "/default/resets"
    code, _, err = await run_cli("produce", *url, "--topic", topic, "--count", "10")
    assert code == 0, err
    assert await _offsets(broker, topic, "s", 10) == list(range(10))

    code, out, err = await _reset(broker, topic, "s", "3")
    assert code == 0, err
    assert out == f"{topic} subscription s: cursor 10 -> 3 (offset:3)\n"
    assert await _offsets(broker, topic, "s", 7) == list(range(3, 10))
    code, out, err = await _reset(broker, topic, "s", "earliest")
    assert code == 0, err
    assert out.endswith("cursor 10 -> 0 (earliest)\n"), out
    assert await _offsets(broker, topic, "s", 10) == list(range(10))
    # An offset past the end is the end.
    code, out, err = await _reset(broker, topic, "s", "offset:99")
    assert code == 0 and out.endswith("cursor 10 -> 10 (offset:99)\n"), out + err

    # By time: the first message ingested at or after it.
    await asyncio.sleep(0.05)
    code, _, err = await run_cli("produce", *url, "--topic", topic, "--count", "5")
    assert code == 0, err
    code, out, err = await run_cli(
        "consume", *url, "--topic", topic, "--subscription", "t", "--count", "15",
        "--output", "json",
    )  # fmt: skip
    assert code == 0, err
    times = [json.loads(line)["ingest_time"] for line in out.splitlines()]
    code, out, err = await _reset(broker, topic, "s", times[10])
    assert code == 0, err
    assert " -> 10 (time:" in out, out
    assert await _offsets(broker, topic, "s", 5) == list(range(10, 15))
    code, out, err = await _reset(broker, topic, "s", "latest")
    assert code == 0 and out.endswith("cursor 15 -> 15 (latest)\n"), out + err
    code, out, err = await run_cli("subscriptions", "--topic", topic, *etcd)
    assert code == 0, err
    assert [line.split()[1:4] for line in out.splitlines()[1:]] == [
        ["s", "Exclusive", "15"],
        ["t", "Exclusive", "15"],
    ], out

    code, out, err = await run_cli("subscriptions", "delete", topic, "t", *url)
    assert code == 0, err
    assert out == f"{topic} subscription t: deleted\n"
    code, out, err = await run_cli("subscriptions", "--topic", topic, *etcd)
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["s"], out
    code, _, err = await run_cli("subscriptions", "delete", topic, "t", *url)
    assert code == 1 and f"topic {topic} has no subscription 't'" in err, err
    # A consumer that comes back creates it anew where it asks (consume: earliest).
    assert await _offsets(broker, topic, "t", 15) == list(range(15))
    code, _, err = await _reset(broker, "/default/none", "s", "0")
    assert code == 1 and "NOT_FOUND" in err, err


@pytest.mark.slow
async def test_refused_while_a_consumer_is_connected(broker: Broker) -> None:
    url = ("--service-url", broker.url)
    topic = "/default/busy"
    code, _, err = await run_cli("produce", *url, "--topic", topic, "--count", "3")
    assert code == 0, err
    consumer = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "danube_ingest.cli", "consume", *url, "--topic", topic,
        "--subscription", "live", "--print", "{offset}",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert consumer.stdout is not None
        async with asyncio.timeout(30):
            assert await consumer.stdout.readline() == b"0\n"
        for argv in (["reset", topic, "live", "--to", "earliest"], ["delete", topic, "live"]):
            code, _, err = await run_cli("subscriptions", *argv, *url)
            assert code == 1, err
            assert "FAILED_PRECONDITION" in err, err
            assert "has 1 connected consumer(s) (cli-consumer): stop them" in err, err
    finally:
        consumer.send_signal(signal.SIGINT)
        await consumer.wait()
    # Once it is gone the reset goes through (its stream's end may take a moment to arrive).
    for _ in range(50):
        code, out, err = await _reset(broker, topic, "live", "1")
        if code == 0:
            break
        assert "connected consumer" in err, err
        await asyncio.sleep(0.1)
    assert out.endswith("-> 1 (offset:1)\n"), out + err
    assert await _offsets(broker, topic, "live", 2) == [1, 2]


def test_bad_input_is_refused_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    url = ("--service-url", "http://127.0.0.1:1")
    cases = [
        (["reset", "/default/x", "s", "--to", "soon"], "start position 'soon' is not understood"),
        (["reset", "/default/x", "s", "--to", "-1"], "start position '-1'"),
        (["reset", "no-slash", "s", "--to", "0"], "no-slash"),
        (["reset", "/default/x", "a/b", "--to", "0"], "invalid subscription name 'a/b'"),
        (["delete", "/default/x"], "the following arguments are required: subscription"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit:
            main(["subscriptions", *argv, *url])
        assert exit.value.code == 2, argv
        assert message in capsys.readouterr().err
