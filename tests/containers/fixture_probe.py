"""Run by ``test_etcd_container.py`` in a pytest of its own with
``DANUBE_INGEST_SERVICES=containers`` (not collected otherwise: the name is not ``test_*``):
the suite's ``etcd_server`` is served by a container, its client port mapped on loopback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from danube_ingest.containers import PODMAN_OPTIONS, SERVICES_ENV


def test_etcd_server_is_a_container(etcd_server: str, tmp_path: Path) -> None:
    assert os.environ[SERVICES_ENV] == "containers"
    port = int(etcd_server.rsplit(":", 1)[1])
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
    ports = [
        mapping.get("host_port")
        for container in json.loads(listed.stdout or "[]")
        for mapping in container.get("Ports") or []
    ]
    assert port in ports, (etcd_server, listed.stdout[-2000:])
