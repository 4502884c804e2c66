"""The suite's ``kafka_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs ``danube-ingest kafka`` in the project's image (testcontainers on podman), and the
WAL backends' contract tests pass against it, as they do against the child-process Kafka."""

from __future__ import annotations

import pytest

from tests.containers.support import pytest_with_services_in_containers

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_suites_kafka_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: built once for the run, so the child's build is the cached one.)"""
    output = pytest_with_services_in_containers(
        "tests/wal/test_backend_contract.py",
        "-k",
        "kafka",
        "tests/containers/fixture_probe.py::test_kafka_server_is_a_container",
        timeout=600,
    )
    assert "9 passed" in output, output[-2000:]
