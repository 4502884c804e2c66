"""The suite's ``s3_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs moto's S3 server from an image built here (``moto_image``: the tests' moto version
installed offline from wheels on a Debian ``python3`` base), and the object store's tests on
s3 pass against it, multipart uploads and moto's request log included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from danube_ingest.containers import SERVICES_ENV

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_suites_s3_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: waits for the run's background builds, which make this image too.)"""
    env = {**os.environ, SERVICES_ENV: "containers"}
    run = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/objects/test_store.py", "-k", "s3",
            "tests/containers/fixture_probe.py::test_s3_server_is_a_container",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=800, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
