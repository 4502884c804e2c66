"""How loud ``danube-ingest`` is: one-shot commands print what they were asked for and no INFO
log lines unless ``-v``; servers keep logging INFO (their log is their output)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

pytestmark = pytest.mark.etcd


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_admin_commands_log_info_only_when_asked(etcd_server: str) -> None:
    for command in (["status"], ["topics"], ["subscriptions", "--topic", "/default/t"]):
        quiet = _run(*command, "--etcd", etcd_server)
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stderr == "", quiet.stderr
        loud = _run("-v", *command, "--etcd", etcd_server)
        assert loud.returncode == 0, loud.stderr
        assert " INFO " in loud.stderr and "endpoint=" in loud.stderr, loud.stderr


def test_log_level_choice() -> None:
    from danube_ingest.cli import log_level

    assert log_level("status", None, 0) == logging.WARNING
    assert log_level("consume", None, 0) == logging.WARNING
    assert log_level("status", None, 1) == logging.INFO
    assert log_level("status", None, 2) == logging.DEBUG
    assert log_level("status", "error", 2) == logging.ERROR
    for server in ("broker", "dev", "etcd"):
        assert log_level(server, None, 0) == logging.INFO
