"""Run by ``tests/containers/test_*_container.py`` in a pytest of their own
with ``DANUBE_INGEST_SERVICES=containers`` (not collected otherwise: the name is not
``test_*``): the suite's ``etcd_server`` is served by a container, its client port mapped on
loopback; its ``kafka_server`` by a container of the project's image on the host's network;
its ``postgres_server`` and ``s3_server`` by containers of Debian images with PostgreSQL and
moto."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from danube_ingest.containers import PODMAN_OPTIONS, SERVICES_ENV


def _running(tmp_path: Path) -> list[dict[str, Any]]:
    podman = shutil.which("podman")
    assert podman is not None
    conf = tmp_path / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    listed = subprocess.run(
        [podman, *PODMAN_OPTIONS, "ps", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "CONTAINERS_CONF": str(conf)},
    )
    containers: list[dict[str, Any]] = json.loads(listed.stdout or "[]")
    return containers


def _mapped_ports(tmp_path: Path, image_prefix: str = "") -> list[int]:
    """The host ports that running containers of images named ``image_prefix...`` map."""
    return [
        mapping.get("host_port")
        for container in _running(tmp_path)
        if container["Image"].startswith(image_prefix)
        for mapping in container.get("Ports") or []
    ]


def test_etcd_server_is_a_container(etcd_server: str, tmp_path: Path) -> None:
    assert os.environ[SERVICES_ENV] == "containers"
    port = int(etcd_server.rsplit(":", 1)[1])
    assert port in _mapped_ports(tmp_path, "localhost/danube-ingest-etcd:"), etcd_server


def test_kafka_server_is_a_container(kafka_server: str, tmp_path: Path) -> None:
    assert os.environ[SERVICES_ENV] == "containers"
    port = kafka_server.rsplit(":", 1)[1]
    running = _running(tmp_path)
    kafkas = [
        c for c in running
        if c["Image"].startswith("localhost/danube-ingest:") and "kafka" in c["Command"]
        and port in c["Command"]
    ]  # fmt: skip
    assert len(kafkas) == 1, (kafka_server, running)


def test_postgres_server_is_a_container(postgres_server: Any, tmp_path: Path) -> None:
    assert os.environ[SERVICES_ENV] == "containers"
    ports = _mapped_ports(tmp_path, "localhost/danube-ingest-postgres:")
    assert postgres_server.port in ports, (postgres_server.url, ports)


def test_s3_server_is_a_container(s3_server: Any, tmp_path: Path) -> None:
    assert os.environ[SERVICES_ENV] == "containers"
    ports = _mapped_ports(tmp_path, "localhost/danube-ingest-moto:")
    assert s3_server.port in ports, (s3_server.endpoint, ports)
