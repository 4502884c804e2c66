"""The suite's ``s3_server`` in a container: with ``DANUBE_INGEST_SERVICES=containers`` the
fixture runs moto's S3 server from an image built here (``moto_image``: the tests' moto version
installed offline from wheels on a Debian ``python3`` base), and the object store's tests on
s3 pass against it, multipart uploads and moto's request log included."""

from __future__ import annotations

import pytest

from tests.containers.support import pytest_with_services_in_containers

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_suites_s3_fixture_runs_in_a_container_when_asked(image: str) -> None:
    """(``image``: waits for the run's background builds, which make this image too.)"""
    pytest_with_services_in_containers(
        "tests/objects/test_store.py",
        "-k",
        "s3",
        "tests/containers/fixture_probe.py::test_s3_server_is_a_container",
        timeout=800,
    )
