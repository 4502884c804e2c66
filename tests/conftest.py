"""Shared fixtures: one real etcd per test session, and metadata stores on top of it.

* ``etcd_server`` (session): the endpoint URL of a real single-node etcd (fast raft timings)
  in a temp dir; with ``DANUBE_INGEST_SERVICES=containers``, the same etcd in a container
  (``danube_ingest.containers``: testcontainers on podman). Every test that uses it is marked
  ``etcd`` automatically.
* ``etcd_kv``: an ``EtcdKV`` connected to it, closed after the test.
* ``kv``: the same test twice, on ``MemoryKV`` and on ``EtcdKV`` (contract tests).
* ``keys``: ``Keys`` on a fresh random prefix, so tests sharing the server never collide.
* ``s3_server`` (session): a ``MotoServer`` (moto S3 in a child process; with
  ``DANUBE_INGEST_SERVICES=containers`` a ``MotoContainer``). Every test that uses it is marked
  ``s3`` automatically.
* ``kafka_server`` (session): the bootstrap servers of a single-node KRaft Kafka (``LocalKafka``;
  with ``DANUBE_INGEST_SERVICES=containers``, ``danube-ingest kafka`` in a container of the
  project's image). Tests that use it are marked ``kafka``.
* ``postgres_server`` (session): a ``LocalPostgres`` (an Iceberg catalog database). Tests
  that use it are marked ``postgres``.
* ``certs`` (session): a CA, server and client certificates as PEM files (``tests.certs``).
* ``produced`` (session): three topics produced through danube-client into the real daemon
  (``tests.analytics.daemon_support``), made once for every test that needs them (a minute or
  two, in a child process started before the first test of a session that needs it). Its
  ``objects`` directory is shared and read-only by convention: a test that writes (a
  warehouse, damaged objects) writes to its own copy or its own root, and converts on its own
  ``clone`` of the etcd prefix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from danube_ingest.containers import (
    SERVICES_ENV,
    EtcdContainer,
    KafkaContainer,
    MotoContainer,
    PodmanService,
    PostgresContainer,
)
from danube_ingest.metadata import KV, EtcdKV, Keys, MemoryKV
from danube_ingest.testing import LocalEtcd, LocalKafka, LocalPostgres, MotoServer

if TYPE_CHECKING:
    from tests.analytics.daemon_support import Produced
    from tests.certs import Certs


#: Set when a collected test uses ``produced``: its production starts before the first test.
_EARLY_PRODUCTION = pytest.StashKey[bool]()


def _uses_produced(item: pytest.Item) -> bool:
    return "produced" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Container tests collected: build their image in the background from now on
    (``tests.containers.support``), overlapping the tests that run before them. A test using
    ``produced`` collected: ``_production`` starts it before the first test."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("containers") for item in session.items):
        from tests.containers.support import start_background_builds

        start_background_builds()
    if any(_uses_produced(item) for item in session.items):
        session.config.stash[_EARLY_PRODUCTION] = True


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A module with a test using ``produced`` runs after its directory's other modules, so the
    # production's minute boundaries pass while those run.
    directories: dict[Path, int] = {}
    late = {item.path for item in items if _uses_produced(item)}
    items.sort(
        key=lambda i: (directories.setdefault(i.path.parent, len(directories)), i.path in late)
    )
    for item in items:
        if "etcd_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.etcd)
        if "s3_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
        if "kafka_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)
        if "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[str]:
    if os.environ.get(SERVICES_ENV) == "containers":
        # The same server in a container of the locally built etcd image (testcontainers on
        # podman: danube_ingest.containers).
        with PodmanService() as service, EtcdContainer(service) as container:
            yield container.endpoint
        return
    with LocalEtcd() as etcd:
        yield etcd.endpoint


@pytest.fixture
async def etcd_kv(etcd_server: str) -> AsyncIterator[EtcdKV]:
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    yield kv
    await kv.close()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def kv(request: pytest.FixtureRequest) -> AsyncIterator[KV]:
    store: KV
    if request.param == "memory":
        store = MemoryKV()
    else:
        store = await EtcdKV.connect([request.getfixturevalue("etcd_server")], timeout=5.0)
    yield store
    await store.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(prefix=f"/test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def kafka_server() -> Iterator[str]:
    """One single-node KRaft Kafka for the session (its bootstrap servers); tests keep apart
    by topic prefix. With ``DANUBE_INGEST_SERVICES=containers``: ``danube-ingest kafka`` in a
    container of the project's image (built by ``make image``'s script, once per content)."""
    if os.environ.get(SERVICES_ENV) == "containers":
        from tests.containers.support import build

        with PodmanService() as service, KafkaContainer(service, build()) as container:
            yield container.bootstrap_servers
        return
    with LocalKafka() as kafka:
        yield kafka.bootstrap_servers


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    """One PostgreSQL server for the session (an Iceberg catalog database). With
    ``DANUBE_INGEST_SERVICES=containers``: in a container of a Debian image with PostgreSQL
    (built once per package list), the same interface."""
    if os.environ.get(SERVICES_ENV) == "containers":
        from tests.containers.support import fixture_postgres_image

        with (
            PodmanService() as service,
            PostgresContainer(service, fixture_postgres_image(service)) as container,
        ):
            yield container  # type: ignore[misc]
        return
    with LocalPostgres() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    if os.environ.get(SERVICES_ENV) == "containers":
        from tests.containers.support import fixture_moto_image

        with (
            PodmanService() as service,
            MotoContainer(service, fixture_moto_image(service)) as container,
        ):
            yield container
        return
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    from tests.certs import make_certs

    return make_certs(tmp_path_factory.mktemp("certs"))


class _Production:
    """``produce_topics`` in a child process (``python -m tests.analytics.daemon_support``):
    most of its minute or two is waiting for minute boundaries, which then pass while the
    tests before the first user of ``produced`` run."""

    def __init__(self, endpoint: str, base: Path) -> None:
        self._out = base / "produced.json"
        self._log = base / "production.log"
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.analytics.daemon_support", endpoint, str(base),
                 str(self._out)],
                cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def result(self, timeout: float = 400.0) -> Produced:
        from tests.analytics.daemon_support import produced_from_json

        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        log = self._log.read_text(errors="replace")[-4000:]
        assert code == 0 and self._out.exists(), f"production ended with {code}:\n{log}"
        return produced_from_json(self._out.read_text())

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@pytest.fixture(scope="session", autouse=True)
def _production(request: pytest.FixtureRequest) -> Iterator[_Production | None]:
    """The production behind ``produced``, started before the first test of a session that
    uses it (None in one that does not)."""
    if not request.config.stash.get(_EARLY_PRODUCTION, False):
        yield None
        return
    endpoint = request.getfixturevalue("etcd_server")
    base = request.getfixturevalue("tmp_path_factory").mktemp("daemon")
    production = _Production(endpoint, base)
    yield production
    production.stop()


@pytest.fixture(scope="session")
def produced(_production: _Production | None) -> Produced:
    """The real daemon's output for three topics (see the module docstring)."""
    assert _production is not None, "produced is started only for tests that name it"
    return _production.result()
