"""The suite's ``postgres_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs PostgreSQL from a Debian image built here (``debian_image``: PostgreSQL installed
on ``make image``'s Debian base, once per package list and base), and the Iceberg catalog test
on PostgreSQL passes against it (pyiceberg's SqlCatalog publishes, Spark SQL reads the table by
name through the same database)."""

from __future__ import annotations

import pytest

from tests.containers.support import pytest_with_services_in_containers

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_the_suites_postgres_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: waits for the run's background builds, which make this image too.)"""
    output = pytest_with_services_in_containers(
        "tests/analytics/test_iceberg_lifecycle.py::"
        "test_a_postgresql_catalog_is_published_once_and_read_by_spark",
        "tests/containers/fixture_probe.py::test_postgres_server_is_a_container",
        timeout=1100,
    )
    assert "2 passed" in output, output[-2000:]
