"""``danube-ingest produce`` / ``consume`` through the batch client (the default) and ``bench``,
as child processes against a real daemon: messages cross between the two clients, ``bench``
reports its figures, bad input and an unreachable broker exit with a clear message."""

from __future__ import annotations

import io
import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli.progress import ProgressLine
from danube_ingest.testing import broker_config, free_port, running_broker
from tests.cli.test_client_start import _cli

pytestmark = pytest.mark.etcd


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


def _offsets(out: str, topic: str) -> list[int]:
    lines = out.splitlines()
    assert all(line.startswith(f"{topic}@") for line in lines), out
    return [int(line.split()[0].split("@")[1]) for line in lines]


@pytest.mark.slow
async def test_messages_cross_between_the_batch_client_and_danube_client(broker: Broker) -> None:
    t = "/default/cli_cross"
    url = ("--service-url", broker.url)
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "30", "--batch", "7")
    assert code == 0, err
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "5", "--client", "danube")
    assert code == 0, err
    # danube-client reads what the batch client wrote, and the other way round.
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "d", "--count", "35", "--client", "danube"
    )
    assert code == 0, err
    assert _offsets(out, t) == list(range(35))
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "b", "--count", "35", "--max-batch", "4"
    )
    assert code == 0, err
    assert _offsets(out, t) == list(range(35))
    assert out.splitlines()[0].endswith("[cli-producer] hello from danube-ingest"), out
    # The batch consumer acked exactly what it printed: the next run resumes after it.
    code, _, err = await _cli("produce", *url, "--topic", t, "--count", "3", "--size", "8")
    assert code == 0, err
    code, out, err = await _cli(
        "consume", *url, "--topic", t, "--subscription", "b", "--count", "3"
    )
    assert code == 0, err
    assert _offsets(out, t) == [35, 36, 37]
    assert out.splitlines()[0].endswith(" xxxxxxxx"), out


@pytest.mark.slow
async def test_progress_is_plain_lines_when_not_a_terminal(broker: Broker) -> None:
    code, out, err = await _cli(
        "produce", "--service-url", broker.url, "--topic", "/default/cli_plain", "--count", "20"
    )
    assert code == 0, err
    assert out == ""
    assert err.splitlines()[-1].startswith("sent 20/20 messages ("), err
    assert "\x1b" not in err, err


def test_progress_is_a_bar_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with ProgressLine("sent", 10, stream=stream) as progress:
        for _ in range(10):
            progress.step()
    text = stream.getvalue()
    assert "10/10" in text and "━" in text, text
    assert "sent 10/10 messages" not in text  # not the plain line

    plain = io.StringIO()
    with ProgressLine("received", 0, stream=plain) as progress:
        progress.step(5)
    assert re.fullmatch(r"received 5 messages \([\d,]+ msg/s\)\n", plain.getvalue())


@pytest.mark.slow
async def test_bench_reports_throughput_latency_and_cpu(broker: Broker) -> None:
    t = "/default/cli_bench"
    common = ("bench", "--service-url", broker.url, "--topic", t, "--json")
    code, out, err = await _cli(
        *common, "--count", "3000", "--size", "64", "--batch", "100", "--concurrency", "3",
        "--consume",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out.splitlines()[-1])
    publish = result["publish"]
    assert publish["client"] == "ingest"
    assert (publish["messages"], publish["stored"], publish["size"]) == (3000, 3000, 64)
    assert (publish["batch"], publish["concurrency"]) == (100, 3)
    assert publish["msg_per_s"] > 0 and publish["cpu_s"] > 0
    latency = publish["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert publish["first_offset"] == 0
    assert result["consume"]["messages"] == 3000
    assert set(result["cpu_pressure_avg10"]) == {"start", "end"}

    code, out, err = await _cli(*common, "--count", "40", "--client", "danube")
    assert code == 0, err
    publish = json.loads(out.splitlines()[-1])["publish"]
    assert (publish["client"], publish["stored"], publish["batch"]) == ("danube", 40, 1)

    code, out, err = await _cli(*common[:-1], "--count", "50")
    assert code == 0, err
    assert "throughput" in out and "p99" in out and "CPU" in out, out


@pytest.mark.slow
async def test_bad_input_and_an_unreachable_broker_exit_with_a_clear_message(
    broker: Broker,
) -> None:
    url = ("--service-url", broker.url)
    nowhere = ("--service-url", f"http://127.0.0.1:{free_port()}", "--connect-timeout", "1")
    for command in ("produce", "consume", "bench"):
        code, _, err = await _cli(command, *nowhere, "--topic", "/default/x")
        assert code == 1, (command, err)
        assert "no broker answered at http://127.0.0.1:" in err and "--service-url" in err, err
    code, _, err = await _cli("produce", *nowhere, "--topic", "/default/x", "--client", "danube")
    assert code == 1 and "no broker answered" in err, err

    code, _, err = await _cli("produce", *url, "--topic", "default/no-slash")
    assert code == 2 and "invalid topic name 'default/no-slash'" in err, err
    code, _, err = await _cli("bench", *url, "--topic", "/default/a/b")
    assert code == 2 and "invalid topic name" in err, err
    for option, value in (("--size", "-1"), ("--count", "x"), ("--batch", "0")):
        code, _, err = await _cli("bench", *url, option, value)
        assert code == 2 and f"argument {option}" in err and repr(value) in err, err
    code, _, err = await _cli("produce", *url, "--topic", "/default/x", "--non-reliable")
    assert code == 2 and "--client danube" in err, err
    code, _, err = await _cli("bench", *url, "--client", "danube", "--consume")
    assert code == 2 and "--consume needs the batch client" in err, err

    # A payload over limits.max_payload_bytes: refused by the broker, nothing stored, exit 1.
    big = str(broker.config.limits.max_payload_bytes + 1)
    for command in ("produce", "bench"):
        code, _, err = await _cli(
            command, *url, "--topic", "/default/cli_big", "--size", big, "--count", "3"
        )
        assert code == 1, err
        assert "refused (INVALID_ARGUMENT)" in err and "max_payload_bytes" in err, err
        assert "(3 messages refused, 0 stored)" in err, err
    assert broker.store is not None
    info = broker.store.info("/default/cli_big")
    assert info is None or info.next_offset == 0

    code, _, err = await _cli("consume", *url, "--topic", "/default/never_made", "--count", "1")
    assert code == 1 and "NOT_FOUND" in err and "/default/never_made" in err, err
