"""The danube-ingest image (``make image``, ``tools/image/build.sh``): built from Debian's
packages and the project's wheel, run through testcontainers on podman as a non-root user with
its data on a volume; the real danube-client produces to and consumes from the broker in it,
a second build of the same tree reuses it, and a rebuild from scratch gives the same bytes
(the same tag)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from danube_ingest.containers import PodmanService
from danube_ingest.testing import free_port
from tests.broker.support import Clients, payloads
from tests.containers.support import build

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def podman() -> Iterator[PodmanService]:
    with PodmanService() as service:
        yield service


def test_the_image_is_reproducible_and_runs_as_a_user(
    image: str, rebuilt_image: str, podman: PodmanService
) -> None:
    assert image.startswith("localhost/danube-ingest:")
    # Built again from scratch (base kept; in the background, after the first build), the same
    # tree gives the same bytes, so the same tag.
    assert rebuilt_image == image
    started = time.monotonic()
    assert build() == image  # the same inputs: the tar is reused, not imported again
    assert time.monotonic() - started < 60
    inspected = json.loads(podman.podman("image", "inspect", image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "10001" and "/data" in config["Volumes"]
    assert config["Entrypoint"][-1] == "/opt/danube-ingest/bin/danube-ingest"
    helped = podman.podman("run", "--rm", image)  # (CMD: --help)
    assert helped.returncode == 0 and "Danube-compatible" in helped.stdout, helped.stderr
    assert "kafka" in helped.stdout and "broker" in helped.stdout
    whoami = podman.podman("run", "--rm", "--entrypoint", "id", image, "-u")
    assert whoami.stdout.strip() == "10001"
    # A fresh volume at /data (no bind mount, no chown by hand) is the user's: podman copies
    # the image's /data up, owner included.
    fresh = podman.podman(
        "run", "--rm", "--entrypoint", "sh", image, "-c", "touch /data/x && stat -c %u /data"
    )
    assert fresh.returncode == 0 and fresh.stdout.strip() == "10001", fresh.stderr


async def test_danube_client_produces_and_consumes_through_the_image(
    image: str, podman: PodmanService, etcd_server: str, tmp_path: Path
) -> None:
    from testcontainers.core.container import DockerContainer

    os.environ.update(podman.environment())
    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, 10001, 10001)
    port, metrics = free_port(), free_port()
    command = (
        f"broker --listen 127.0.0.1:{port} --etcd {etcd_server} --data-dir /data "
        f"--broker-id image-1 --metrics-listen 127.0.0.1:{metrics}"
    )
    container = (
        DockerContainer(image, command=command)
        .with_kwargs(network_mode="host")
        .with_volume_mapping(str(data), "/data", "rw")
    )
    with container:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/readyz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    logs = b"".join(container.get_logs()).decode(errors="replace")[-3000:]
                    raise AssertionError(f"the broker in the image is not ready: {logs}") from None
                time.sleep(0.5)
        async with Clients(f"http://127.0.0.1:{port}") as clients:
            producer = await clients.producer("/default/image")
            consumer = await clients.consumer("/default/image", "s", "c1")
            sent = [f"m{i}".encode() for i in range(20)]
            for payload in sent:
                await producer.send(payload)
            received = await consumer.take(len(sent))
            assert payloads(received) == sent
            await consumer.ack_all(received)
    # The WAL is on the volume, written by the image's user.
    wal = [p for p in data.rglob("*") if p.is_file()]
    assert wal and all(p.stat().st_uid == 10001 for p in wal)
