"""Services in containers (``danube_ingest.containers``): podman's Docker-compatible API on a
private socket, the etcd image built locally ``FROM scratch`` once per content, an etcd in a
container through testcontainers serving the metadata store, and the suite's own ``etcd_server``
fixture on containers when ``DANUBE_INGEST_SERVICES=containers``. Needs ``podman`` and ``runc``
(``make test`` installs them)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from danube_ingest.containers import (
    ContainerError,
    EtcdContainer,
    PodmanService,
    etcd_image,
)
from danube_ingest.metadata import EtcdKV
from danube_ingest.metadata.kv import Compare, Put
from tests.containers.support import pytest_with_services_in_containers

pytestmark = [pytest.mark.containers, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def podman() -> Iterator[PodmanService]:
    with PodmanService() as service:
        yield service


def _running(service: PodmanService) -> list[dict[str, object]]:
    listed = service.podman("ps", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    return list(json.loads(listed.stdout or "[]"))


async def test_an_etcd_container_serves_the_metadata_store(podman: PodmanService) -> None:
    with EtcdContainer(podman) as etcd:
        assert etcd.endpoint.startswith("http://127.0.0.1:")
        assert any(c["Id"] == etcd.container_id for c in _running(podman))
        kv = await EtcdKV.connect([etcd.endpoint], timeout=5.0)
        try:
            await kv.put("/c/a", b"1")
            swapped = await kv.txn([Compare.value_is("/c/a", b"1")], [Put("/c/a", b"2")])
            assert swapped.succeeded
            stored = await kv.get("/c/a")
            assert stored is not None and stored.value == b"2"
            lease = await kv.grant_lease(1)
            await kv.put("/c/leased", b"x", lease=lease)
            deadline = time.monotonic() + 10
            while await kv.get("/c/leased") is not None:
                assert time.monotonic() < deadline, "the lease did not expire in the container"
                await asyncio.sleep(0.2)
        finally:
            await kv.close()
        container = etcd.container_id
    assert all(c["Id"] != container for c in _running(podman)), "stopped and removed"


def test_the_etcd_image_is_built_once_per_content(podman: PodmanService) -> None:
    tag = etcd_image(podman)
    assert tag.startswith("localhost/danube-ingest-etcd:") and len(tag.rsplit(":", 1)[1]) == 16
    started = time.monotonic()
    assert etcd_image(podman) == tag  # in podman's store already: not built again
    assert time.monotonic() - started < 5
    listed = podman.podman("images", "--format", "json", tag)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 1
    inspected = json.loads(podman.podman("image", "inspect", tag).stdout)[0]
    assert inspected["Config"]["Entrypoint"] == ["/usr/local/bin/etcd"]
    assert len(inspected["RootFS"]["Layers"]) == 1  # FROM scratch: the binary alone


def test_podman_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ContainerError, match="podman is not installed"):
        PodmanService().start()


def test_the_suites_etcd_fixture_runs_in_a_container_when_asked() -> None:
    """The metadata store's contract tests, with ``etcd_server`` in a container: they pass, and
    the probe sees the server's port mapped by a container."""
    pytest_with_services_in_containers(
        "tests/metadata/test_kv_contract.py",
        "tests/containers/fixture_probe.py::test_etcd_server_is_a_container",
        timeout=240,
    )
