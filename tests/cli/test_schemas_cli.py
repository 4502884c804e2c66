"""``danube-ingest schemas register|list|show|check|attach`` and ``produce --schema-subject``
against a real daemon and etcd: the README's schema example as written, what it stored, and bad
input refused with exit 2 before anything is sent."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import fastavro
import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli import main
from danube_ingest.testing import broker_config, running_broker
from tests.cli.cli_support import ROOT, fake_clone, readme_block, run_cli, run_readme_line

pytestmark = pytest.mark.etcd

ORDER_AVSC = ROOT / "config" / "schemas" / "order.avsc"


@pytest.fixture
async def broker(tmp_path: Path, etcd_server: str) -> AsyncIterator[Broker]:
    prefix = f"/t{uuid.uuid4().hex[:12]}"
    async with running_broker(broker_config(tmp_path / "b1", etcd_server, prefix=prefix)) as b:
        yield b


def _etcd(broker: Broker) -> list[str]:
    config = broker.config
    return ["--etcd", config.etcd.endpoints[0], "--prefix", config.etcd.prefix]


@pytest.mark.slow
async def test_readme_schema_example_runs_as_written(broker: Broker, tmp_path: Path) -> None:
    config = broker.config
    clone = fake_clone(
        tmp_path / "clone",
        url=broker.url,
        etcd=config.etcd.endpoints[0],
        prefix=config.etcd.prefix,
    )
    outputs = {}
    for line in readme_block("schemas register"):
        code, out, err = await run_readme_line(line, clone)
        assert code == 0, f"{line!r} exit {code}:\n{out}\n{err}"
        outputs[line.split("#")[0].strip()] = out
    listed = next(out for line, out in outputs.items() if line.endswith("schemas list"))
    header = ["subject", "latest", "type", "schema", "id", "compatibility"]
    assert listed.split("\n")[0].split() == header, listed
    assert "orders-avro  1       avro" in listed, listed
    assert "orders-json  1       json_schema" in listed, listed
    described = next(out for line, out in outputs.items() if "topics describe" in line)
    assert "validation policy enforce, payload validation" in described, described
    assert "subject orders-avro" in described, described

    # What was stored: the two records, Avro-encoded with the subject's version 1.
    url = ("--service-url", broker.url)
    code, out, err = await run_cli(
        "consume", *url, "--topic", "/default/orders_avro", "--count", "2", "--output", "raw",
        "--client", "danube",
    )  # fmt: skip
    assert code == 0, err
    schema = fastavro.parse_schema(json.loads(ORDER_AVSC.read_text()))
    payloads = out.encode().split(b"\n")[:2]
    # Each line is one datum followed by the newline --output raw adds.
    decoded = [fastavro.schemaless_reader(io.BytesIO(p), schema, None) for p in payloads]
    assert decoded == [
        {"id": 1, "item": "tea", "price": 2.5},
        {"id": 2, "item": "cake", "price": 4.0},
    ]
    code, out, err = await run_cli(
        "consume", *url, "--topic", "/default/orders_avro", "--subscription", "j", "--count",
        "2", "--output", "json",
    )  # fmt: skip
    assert code == 0, err
    first = json.loads(out.splitlines()[0])
    assert first["schema_version"] == 1 and first["schema_id"] >= 1, first

    # enforce: a message without the subject's schema id is refused, and stored nowhere.
    code, _, err = await run_cli(
        "produce", *url, "--topic", "/default/orders_json", "--count", "1", "--client", "danube"
    )
    assert code == 1, err
    assert "INVALID_ARGUMENT" in err or "schema" in err, err


@pytest.mark.slow
async def test_show_check_and_refusals(broker: Broker, tmp_path: Path) -> None:
    url = ("--service-url", broker.url)
    avsc = str(ORDER_AVSC)
    code, out, err = await run_cli(
        "schemas", "register", "s1", "--type", "avro", "--file", avsc, *url
    )
    assert code == 0, err
    assert out.startswith("subject s1: registered as version 1 (schema id "), out
    code, out, err = await run_cli(
        "schemas", "register", "s1", "--type", "avro", "--file", avsc, *url
    )
    assert code == 0, err
    assert out.startswith("subject s1: already registered as version 1"), out
    v2 = str(ROOT / "config" / "schemas" / "order_v2.avsc")
    code, out, err = await run_cli(
        "schemas", "register", "s1", "--type", "avro", "--file", v2, *url
    )
    assert code == 0, err
    assert "registered as version 2" in out, out

    code, out, err = await run_cli("schemas", "show", "s1", *url)
    assert code == 0, err
    assert "version: 2 (of 1, 2)" in out and '"note"' in out, out
    code, out, err = await run_cli("schemas", "show", "s1", "--version", "1", *url)
    assert code == 0, err
    assert "version: 1 (of 1, 2)" in out and '"note"' not in out, out

    # A required field without a default is not backward compatible: exit 1, with the reason.
    breaking = tmp_path / "breaking.avsc"
    document = json.loads(ORDER_AVSC.read_text())
    document["fields"].append({"name": "customer", "type": "string"})
    breaking.write_text(json.dumps(document))
    code, out, err = await run_cli("schemas", "check", "s1", "--file", str(breaking), *url)
    assert code == 1, out + err
    assert "NOT compatible with subject s1" in out and "customer" in out, out
    code, out, err = await run_cli("schemas", "check", "s1", "--file", v2, *url)
    assert code == 0, err
    assert "compatible with subject s1" in out, out
    code, _, err = await run_cli(
        "schemas", "register", "s1", "--type", "avro", "--file", str(breaking), *url
    )
    assert code == 1, err
    assert "FAILED_PRECONDITION" in err, err

    # Unknown subject or version: exit 1, naming it.
    code, _, err = await run_cli("schemas", "show", "nobody", *url)
    assert code == 1 and "nobody" in err, err
    code, _, err = await run_cli("schemas", "show", "s1", "--version", "9", *url)
    assert code == 1 and "9" in err, err
    code, _, err = await run_cli("schemas", "attach", "/default/x", "nobody", *url)
    assert code == 1 and "nobody" in err, err

    code, out, err = await run_cli("schemas", "list", *_etcd(broker))
    assert code == 0, err
    assert out.splitlines()[1].split()[:2] == ["s1", "2"], out

    # produce --schema-subject: a line that is not a record of the Avro subject sends nothing.
    topic = "/default/schema_refused"
    code, _, err = await run_cli(
        "produce", *url, "--topic", topic, "--client", "danube", "--schema-subject", "s1",
        "--stdin", stdin=b'{"id": 1, "item": "tea", "price": 2.5}\n{"id": "one"}\n',
    )  # fmt: skip
    assert code == 2, err
    assert "message 2: not a JSON record of Avro subject 's1'" in err, err
    code, _, err = await run_cli("topics", "describe", topic, *_etcd(broker))
    assert code == 1 and f"topic {topic} does not exist" in err, err


def test_bad_input_is_refused_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No broker listens at this URL: exit 2 (not 1, unreachable) shows nothing was sent.
    url = ("--service-url", "http://127.0.0.1:1")
    not_avro = tmp_path / "bad.avsc"
    not_avro.write_text('{"type": "record", "name": "X"}')
    cases = [
        (["register", "s", "--type", "avro", "--file", str(tmp_path / "missing.avsc")],
         "missing.avsc: cannot read it"),
        (["register", "s", "--type", "avro", "--file", str(not_avro)],
         "bad.avsc: not a valid avro definition"),
        (["check", "s", "--type", "avro", "--file", str(not_avro)],
         "bad.avsc: not a valid avro definition"),
        (["check", "s", "--file", str(tmp_path / "missing.avsc")], "cannot read it"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["schemas", *argv, *url]) == 2, argv
        assert message in capsys.readouterr().err
    for argv, message in [
        (["register", "s", "--type", "xml", "--file", str(ORDER_AVSC)], "invalid choice: 'xml'"),
        (["show", "s", "--version", "0"], "version '0': expected a whole number >= 1"),
        (["attach", "nope", "s"], "nope"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["schemas", *argv, *url])
        assert exit.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["produce", "--topic", "/ns/t", "--schema-subject", "s", *url]) == 2
    assert "--schema-subject needs --client danube" in capsys.readouterr().err
