"""The suite's ``kafka_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs ``danube-ingest kafka`` in the project's image (testcontainers on podman), and the
WAL backends' contract tests pass against it, as they do against the child-process Kafka."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from danube_ingest.containers import SERVICES_ENV

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_suites_kafka_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: built once for the run, so the child's build is the cached one.)"""
    env = {**os.environ, SERVICES_ENV: "containers"}
    run = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/wal/test_backend_contract.py", "-k", "kafka",
            "tests/containers/fixture_probe.py::test_kafka_server_is_a_container",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "9 passed" in run.stdout, run.stdout[-2000:]
