"""The suite's ``postgres_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs PostgreSQL from a Debian image built here (``debian_image``: PostgreSQL installed
on ``make image``'s Debian base, once per package list and base), and the Iceberg catalog test
on PostgreSQL passes against it (pyiceberg's SqlCatalog publishes, Spark SQL reads the table by
name through the same database)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from danube_ingest.containers import SERVICES_ENV

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_suites_postgres_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: waits for the run's background builds, which make this image too.)"""
    env = {**os.environ, SERVICES_ENV: "containers"}
    run = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "tests/analytics/test_iceberg_lifecycle.py::"
            "test_a_postgresql_catalog_is_published_once_and_read_by_spark",
            "tests/containers/fixture_probe.py::test_postgres_server_is_a_container",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]
