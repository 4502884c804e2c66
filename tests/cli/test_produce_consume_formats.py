"""``produce --stdin`` with keys and attributes, ``consume --output`` and ``--print``, through
both clients against a real daemon; malformed input exits 2 and sends nothing."""

from __future__ import annotations

import io
import json
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli import build_parser, main
from danube_ingest.cli.client import produce_records
from danube_ingest.cli.messages import Message, render
from danube_ingest.testing import broker_config, running_broker
from tests.cli.cli_support import run_cli

pytestmark = pytest.mark.etcd

LINES = b"k1:first\nk2:second: with a colon\n:no key\n"


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


@pytest.mark.slow
@pytest.mark.parametrize("client", ["ingest", "danube"])
async def test_stdin_keys_attributes_then_json_print_and_raw(broker: Broker, client: str) -> None:
    url = ("--service-url", broker.url)
    topic = f"/default/formats_{client}"
    code, _, err = await run_cli(
        "produce", *url, "--topic", topic, "--client", client, "--stdin", "--key-separator",
        ":", "-H", "source=test", "-H", "kind=a=b", stdin=LINES,
    )  # fmt: skip
    assert code == 0, err
    assert "sent 3/3 messages" in err, err

    code, out, err = await run_cli(
        "consume", *url, "--topic", topic, "--client", client, "--subscription", "j",
        "--count", "3", "--output", "json",
    )  # fmt: skip
    assert code == 0, err
    documents = [json.loads(line) for line in out.splitlines()]
    assert [(d["offset"], d["key"], d["payload"]) for d in documents] == [
        (0, "k1", "first"),
        (1, "k2", "second: with a colon"),
        (2, None, "no key"),
    ]
    assert all(d["attributes"] == {"source": "test", "kind": "a=b"} for d in documents)
    assert all(d["topic"] == topic and d["producer"] == "cli-producer" for d in documents)
    assert datetime.fromisoformat(documents[0]["publish_time"]).tzinfo is not None
    # The batch path carries the broker's ingest time; danube-client's messages do not.
    assert (documents[0]["ingest_time"] is None) == (client == "danube"), documents[0]

    code, out, err = await run_cli(
        "consume", *url, "--topic", topic, "--client", client, "--subscription", "p",
        "--count", "3", "--print", "{offset}\\t{key}|{payload}|{attributes}",
    )  # fmt: skip
    assert code == 0, err
    attributes = '{"kind": "a=b", "source": "test"}'
    assert out.splitlines() == [
        f"0\tk1|first|{attributes}",
        f"1\tk2|second: with a colon|{attributes}",
        f"2\t|no key|{attributes}",
    ]
    code, out, err = await run_cli(
        "consume", *url, "--topic", topic, "--client", client, "--subscription", "r",
        "--count", "3", "--output", "raw",
    )  # fmt: skip
    assert code == 0, err
    assert out == "first\nsecond: with a colon\nno key\n"


def test_malformed_input_is_refused_before_connecting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No broker listens at this URL: exit 2 (not 1, unreachable) shows nothing was sent.
    common = ["--service-url", "http://127.0.0.1:1", "--topic", "/default/refused"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"k:ok\nno separator\n")))
    assert main(["produce", *common, "--stdin", "--key-separator", ":"]) == 2
    assert "stdin line 2: no key separator ':'" in capsys.readouterr().err
    for argv, message in [
        (["--key-separator", ":"], "--key-separator applies to --stdin lines"),
        (["--stdin", "--size", "8"], "--stdin sends stdin's lines"),
    ]:
        assert main(["produce", *common, *argv]) == 2, argv
        assert message in capsys.readouterr().err
    for argv, message in [
        (["produce", "-H", "novalue"], "attribute 'novalue': expected NAME=VALUE"),
        (["consume", "--print", "{offset} {nope}"], "unknown field {nope}"),
        (["consume", "--output", "xml"], "invalid choice: 'xml'"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main([*argv, *common])
        assert exit.value.code == 2, argv
        assert message in capsys.readouterr().err


def test_json_output_keeps_undecodable_payloads_as_base64() -> None:
    message = Message("/ns/t", 7, b"\xff\x00", "p", publish_ms=1_700_000_000_000)
    document = json.loads(render(message, "json", None))
    assert document["payload"] == "/wA=" and document["payload_encoding"] == "base64"
    assert document["key"] is None and document["ingest_time"] is None
    assert document["publish_time"] == "2023-11-14T22:13:20.000+00:00"
    assert render(message, "raw", None) == b"\xff\x00\n"
    assert render(message, "text", None) == "/ns/t@7 [p] \ufffd\x00\n".encode()


@pytest.mark.parametrize(("count", "sent"), [([], 3), (["--count", "2"], 2), (["--count", "0"], 3)])
def test_stdin_sends_every_line_unless_count_is_given(
    count: list[str], sent: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = build_parser().parse_args(["produce", "--topic", "/ns/t", "--stdin", *count])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a\nb\nc")))
    assert [r.payload for r in produce_records(args)] == [b"a", b"b", b"c"][:sent]
    # Without --stdin the default count (10) applies.
    args = build_parser().parse_args(["produce", "--topic", "/ns/t"])
    assert len(produce_records(args)) == 10
