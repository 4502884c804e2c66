"""``danube-ingest topics create|describe`` and ``subscriptions`` (with lag) against a real
daemon and etcd."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.testing import broker_config, running_broker
from tests.cli.cli_support import ROOT, run_cli

pytestmark = pytest.mark.etcd


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


@pytest.mark.slow
async def test_create_describe_and_subscription_lag(broker: Broker) -> None:
    etcd = ("--etcd", broker.config.etcd.endpoints[0], "--prefix", broker.config.etcd.prefix)
    url = ("--service-url", broker.url)
    topic = "/default/described"
    code, out, err = await run_cli("topics", "create", topic, "--partitions", "2", *etcd)
    assert code == 0, err
    assert out == f"topic {topic} created (reliable, 2 partitions)\n"
    code, _, err = await run_cli("topics", "create", topic, "--partitions", "2", *etcd)
    assert code == 1 and f"topic {topic} exists already" in err, err
    code, _, err = await run_cli("topics", "create", f"{topic}-part-0", "--non-reliable", *etcd)
    assert code == 1 and "exists and is reliable" in err, err

    code, _, err = await run_cli("produce", *url, "--topic", topic, "--partitions", "2")
    assert code == 0, err
    code, _, err = await run_cli(
        "consume", *url, "--topic", topic, "--subscription", "s", "--count", "10"
    )
    assert code == 0, err
    # 4 of the 10 (5 per partition), acked cumulatively.
    code, _, err = await run_cli(
        "consume", *url, "--topic", topic, "--subscription", "half", "--count", "4"
    )
    assert code == 0, err
    code, _, err = await run_cli(
        "schemas", "register", "described", "--type", "avro", "--file",
        str(ROOT / "config" / "schemas" / "order.avsc"), *url,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = await run_cli("schemas", "attach", topic, "described", *url)
    assert code == 0, err
    # Each partition is attached.
    assert [line.split()[1] for line in out.splitlines()] == [f"{topic}-part-{p}" for p in (0, 1)]
    code, _, err = await run_cli("retention", "set", "/default", "--max-age", "7d", *etcd)
    assert code == 0, err

    code, out, err = await run_cli("topics", "describe", topic, *etcd)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:3] == [
        f"topic: {topic}",
        f"partitions: 2 ({topic}-part-0, {topic}-part-1)",
        "dispatch: reliable",
    ], out
    assert "retention: max_age=7d" in out, out
    assert "\nschema: subject described (schema id" in out and "policy warn" in out, out
    assert f"{topic}-part-0  broker-1 (epoch " in out, out
    # The owner writes cursors to etcd within progress.interval (1 s); lag is live.
    for _ in range(50):
        code, out, err = await run_cli("subscriptions", "--topic", topic, *etcd)
        assert code == 0, err
        rows = {tuple(line.split()[:3]): line.split()[3:] for line in out.splitlines()[1:]}
        assert set(rows) == {
            (f"{topic}-part-{p}", sub, "Exclusive") for p in (0, 1) for sub in ("half", "s")
        }, out
        counts = [
            rows[(f"{topic}-part-{p}", sub, "Exclusive")] for p in (0, 1) for sub in ("half", "s")
        ]
        if all(lag != "-" and int(cursor) + int(lag) == 5 for cursor, lag in counts):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"cursor + lag is not each partition's 5 messages:\n{out}")
    assert sum(int(rows[(f"{topic}-part-{p}", "half", "Exclusive")][0]) for p in (0, 1)) == 4
    assert all(rows[(f"{topic}-part-{p}", "s", "Exclusive")] == ["5", "0"] for p in (0, 1))

    code, _, err = await run_cli("topics", "describe", "/default/nothing", *etcd)
    assert code == 1 and "topic /default/nothing does not exist" in err, err
    code, _, err = await run_cli("topics", "create", "no-slash", *etcd)
    assert code == 2 and "no-slash" in err, err
