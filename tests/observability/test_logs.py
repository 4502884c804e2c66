"""``--log-format json``: one JSON object per line, each ``key=value`` of the message a field."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from danube_ingest.observability.logs import JsonFormatter, fields
from danube_ingest.testing import free_port


def test_fields_of_a_message() -> None:
    message = "segment uploaded key=segments/b1/r0/0001.bin bytes=123 topic=/default/t epoch=4"
    assert fields(message) == {
        "key": "segments/b1/r0/0001.bin",
        "bytes": "123",
        "topic": "/default/t",
        "epoch": "4",
    }
    # Quoted values lose their quotes; the fixed fields are never overwritten; a word with
    # '=' inside a value is not a pair of its own.
    assert fields("x msg=hi level=9 error='disk full' url=http://h/a?b=c") == {
        "error": "disk full",
        "url": "http://h/a?b=c",
    }


def test_json_formatter_writes_one_object_per_record() -> None:
    record = logging.LogRecord(
        "danube_ingest.metadata.ownership",
        logging.INFO,
        __file__,
        1,
        "topic acquired topic=%s broker=%s epoch=%s",
        ("/default/t", "broker-1", 3),
        None,
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "INFO" and line["logger"] == "danube_ingest.metadata.ownership"
    assert line["msg"] == "topic acquired topic=/default/t broker=broker-1 epoch=3"
    assert (line["topic"], line["broker"], line["epoch"]) == ("/default/t", "broker-1", "3")
    assert line["ts"].endswith("Z")


def test_broker_logs_json_lines(tmp_path: Path) -> None:
    """A real daemon with ``--log-format json``: every line it logs is a JSON object."""
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as out:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "danube_ingest.cli", "--log-format", "json", "broker"),
                *("--etcd", "memory", "--data-dir", str(tmp_path / "data")),
                *("--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", "127.0.0.1:0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    lines = [
        line for line in log_path.read_text().splitlines() if not line.startswith("danube-ingest")
    ]
    records = [json.loads(line) for line in lines]
    started = next(r for r in records if r["msg"].startswith("broker started"))
    assert started["broker_id"] == "broker-1"
    assert started["metrics"].startswith("http://127.0.0.1:")
