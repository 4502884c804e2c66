"""``KafkaServer``: one KRaft Kafka node (broker and controller in one JVM) run as a child process.

Used by ``danube-ingest kafka`` and ``danube_ingest.testing`` (one node, or a three-node
cluster). The JVM runs ``kafka.Kafka`` from the project's own jars, which ``make setup`` fetches
with Maven from ``tools/kafka/pom.xml`` into ``.deps/kafka/``; ``java`` is the one on ``PATH``,
else ``$JAVA_HOME/bin/java`` (Java 17 or newer).

Layout under ``data_dir``: ``server.properties`` and ``log4j2.properties`` (written on every
start from the constructor's arguments), ``kafka-data/`` (Kafka's log directory, formatted with a
cluster id on first use: ``kafka.tools.StorageTool format``), and ``kafka.log`` (everything the
JVM prints). Every listener is on ``host`` (loopback by default): the client listener on
``port``, the controller listener on ``controller_port``.

``start``/``wait_ready``/``stop`` are blocking; call them through ``asyncio.to_thread`` from
async code, or use the object as a context manager.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from danube_ingest.kafka.errors import (
    JavaMissingError,
    KafkaJarsMissingError,
    KafkaPortInUseError,
    KafkaServerError,
)
from danube_ingest.metadata.server import log_tail, port_in_use

log = logging.getLogger(__name__)

#: Where ``make kafka-jars`` puts the jars: ``.deps/kafka`` in the project's checkout (the
#: package is installed editable from it); ``DANUBE_INGEST_KAFKA_JARS`` names another directory
#: (the image's ``/opt/danube-ingest/jars/kafka``).
JARS_ENV = "DANUBE_INGEST_KAFKA_JARS"
DEFAULT_JARS_DIR = Path(
    os.environ.get(JARS_ENV) or Path(__file__).resolve().parents[2] / ".deps" / "kafka"
)

#: The JVM's heap: Kafka's scripts default to 1 GiB; half of it holds a development node's
#: WAL topics, and three of them (the test cluster) fit a 2-core, few-GiB machine.
DEFAULT_HEAP = "512m"

#: Broker settings for throwaway nodes (tests, ``fast=True``): a dead node is fenced after 2 s
#: instead of 9 s, so its partitions get a new leader while a test still waits; a consumer
#: group starts at once instead of after 3 s; the internal topics get one partition, not 50
#: (their creation dominates a test's first consume otherwise).
FAST_PROPERTIES: Mapping[str, str] = {
    "broker.session.timeout.ms": "2000",
    "broker.heartbeat.interval.ms": "500",
    "controller.quorum.election.timeout.ms": "500",
    "controller.quorum.fetch.timeout.ms": "1000",
    "group.initial.rebalance.delay.ms": "0",
    "offsets.topic.num.partitions": "1",
    "transaction.state.log.num.partitions": "1",
    "share.coordinator.state.topic.num.partitions": "1",
    "num.network.threads": "2",
    "num.io.threads": "2",
}

#: The JVM's flags besides the heap: Kafka's own G1 settings (``kafka-run-class.sh``), and exit
#: on OutOfMemoryError rather than limp on with threads dead.
_JVM_FLAGS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

#: The flags of throwaway nodes (``fast=True``) and of the storage formatter: the serial
#: collector and the C1 compiler only. Measured on the shared 2-core machine, a node needs about
#: half the CPU to get ready (3.5 s instead of 7 s) and 30 MB less RSS; the price is peak
#: throughput (no C2 compiler), so benchmarks run nodes without ``fast``.
_FAST_JVM_FLAGS = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)

#: log4j2 configuration: everything to stdout (hence ``kafka.log``), at the level named by the
#: ``danube.kafka.log.level`` system property (INFO for the node, WARN for the formatter, whose
#: INFO lines are a dump of every setting).
_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = ${sys:danube.kafka.log.level:-INFO}
rootLogger.appenderRef.out.ref = OUT
"""

_JAVA_HINT = (
    "install Java 17 or newer (apt-get install -y openjdk-17-jre-headless) or set JAVA_HOME"
)


def find_java() -> Path:
    """The ``java`` to run Kafka with: the one on ``PATH``, else ``$JAVA_HOME/bin/java``.

    Raises ``JavaMissingError`` saying how to install one when there is none.
    """
    on_path = shutil.which("java")
    if on_path is not None:
        return Path(on_path)
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = Path(home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise JavaMissingError(f"no java found on PATH nor under $JAVA_HOME: {_JAVA_HINT}")


def check_jars(jars_dir: Path) -> Path:
    """``jars_dir`` if it holds the Kafka broker's jar (``kafka_2.13-*.jar``).

    Raises ``KafkaJarsMissingError`` naming the folder and how to fill it otherwise.
    """
    if not any(jars_dir.glob("kafka_2.13-*.jar")):
        raise KafkaJarsMissingError(
            f"no Kafka jars in {jars_dir} (kafka_2.13-*.jar missing): run `make setup` in the "
            "project's checkout, which fetches them with Maven (tools/kafka/pom.xml)"
        )
    return jars_dir


def new_cluster_id() -> str:
    """A random cluster id in Kafka's form (a UUID as 22 characters of URL-safe base64),
    what ``kafka-storage random-uuid`` prints: like Kafka's, never one starting with ``-``,
    which a command line would take for an option."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


class _Cancelled(Exception):
    """``wait_ready``'s ``cancel`` was set."""


@dataclass(frozen=True)
class KafkaVoter:
    """One member of a KRaft controller quorum: its node id and controller listener."""

    node_id: int
    host: str
    controller_port: int

    def __str__(self) -> str:
        """Kafka's ``controller.quorum.voters`` form, ``ID@HOST:PORT``."""
        return f"{self.node_id}@{self.host}:{self.controller_port}"


class KafkaServer:
    """One KRaft node (``process.roles=broker,controller``) listening on ``host`` only.

    ``voters`` is the controller quorum (static, ``controller.quorum.voters``); by default the
    node alone, a single-node cluster. ``data_dir`` keeps the node's state across restarts (same
    ``node_id`` and voters required; the ports may change for a single node). ``fast=True`` adds
    :data:`FAST_PROPERTIES` and runs the JVM with :data:`_FAST_JVM_FLAGS`, meant for tests.
    ``properties`` are added to (and override) ``server.properties``. ``heap`` is the JVM's
    ``-Xmx``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int = 9092,
        controller_port: int | None = None,
        *,
        node_id: int = 1,
        voters: Sequence[KafkaVoter] | None = None,
        host: str = "127.0.0.1",
        heap: str = DEFAULT_HEAP,
        jars_dir: str | os.PathLike[str] | None = None,
        fast: bool = False,
        properties: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.controller_port = controller_port if controller_port is not None else port + 1
        self.node_id = node_id
        self.host = host
        self.voters = tuple(voters or (KafkaVoter(node_id, host, self.controller_port),))
        self.heap = heap
        self.jars_dir = Path(jars_dir) if jars_dir is not None else DEFAULT_JARS_DIR
        self.fast = fast
        self.properties = dict(properties or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        """The client listener, ``HOST:PORT`` (Kafka clients' ``bootstrap.servers``)."""
        return f"{self.host}:{self.port}"

    @property
    def storage_dir(self) -> Path:
        """Kafka's log directory (topics and the KRaft metadata log)."""
        return self.data_dir / "kafka-data"

    @property
    def log_path(self) -> Path:
        """Where the JVM's stdout and stderr go."""
        return self.data_dir / "kafka.log"

    @property
    def pid(self) -> int | None:
        """The JVM's process id while it runs."""
        return self._process.pid if self.running and self._process else None

    @property
    def running(self) -> bool:
        """Whether the node was started and its process has not exited."""
        return self._process is not None and self._process.poll() is None

    def server_properties(self) -> dict[str, str]:
        """The node's ``server.properties``, as ``start`` writes it."""
        replicas = str(min(3, len(self.voters)))
        in_sync = str(min(2, len(self.voters)))
        values = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": ",".join(str(voter) for voter in self.voters),
            "listeners": (
                f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:"
                f"{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{self.bootstrap_servers}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.storage_dir),
            # Kafka's internal topics default to 3 replicas, which a one-node cluster refuses.
            "offsets.topic.replication.factor": replicas,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": in_sync,
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": in_sync,
        }
        if self.fast:
            values.update(FAST_PROPERTIES)
        values.update(self.properties)
        return values

    def command(self) -> list[str]:
        """The command line that runs the node (``kafka.Kafka server.properties``)."""
        flags = _FAST_JVM_FLAGS if self.fast else _JVM_FLAGS
        properties = str(self.data_dir / "server.properties")
        return self._java_command("kafka.Kafka", "INFO", properties, flags=flags)

    def cluster_id(self) -> str | None:
        """The cluster id the storage directory was formatted with, ``None`` before that."""
        meta = self.storage_dir / "meta.properties"
        if not meta.is_file():
            return None
        for line in meta.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "cluster.id":
                return value.strip()
        return None

    def format_storage(self, cluster_id: str | None = None) -> str:
        """Format the storage directory for ``cluster_id`` (a new one by default) unless it is
        formatted already; returns the directory's cluster id. Writes the config files first.

        Raises ``KafkaServerError`` if it was formatted for another cluster than ``cluster_id``
        or the formatter fails (with the tail of its output).
        """
        self._write_config()
        existing = self.cluster_id()
        if existing is not None:
            if cluster_id is not None and cluster_id != existing:
                raise KafkaServerError(
                    f"kafka storage {self.storage_dir} belongs to cluster {existing}, not "
                    f"{cluster_id}: give this node another data directory"
                )
            return existing
        cluster_id = cluster_id or new_cluster_id()
        properties = str(self.data_dir / "server.properties")
        command = self._java_command(
            "kafka.tools.StorageTool",
            "WARN",
            "format",
            # (One word: an id given to us may start with "-", which "-t ID" takes for an option.)
            f"--cluster-id={cluster_id}",
            "-c",
            properties,
            flags=_FAST_JVM_FLAGS,
        )
        started = time.monotonic()
        with self.log_path.open("ab") as log_file:
            try:
                result = subprocess.run(
                    command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
                )
            except OSError as exc:
                raise JavaMissingError(f"cannot run {command[0]}: {exc}; {_JAVA_HINT}") from exc
        if result.returncode != 0:
            raise KafkaServerError(
                f"formatting kafka storage {self.storage_dir} failed (exit code "
                f"{result.returncode}); log {self.log_path}:\n{self.log_tail()}"
            )
        log.info(
            "kafka storage formatted node=%s cluster_id=%s dir=%s seconds=%.1f",
            self.node_id,
            cluster_id,
            self.storage_dir,
            time.monotonic() - started,
        )
        return cluster_id

    def start(self, cluster_id: str | None = None) -> None:
        """Format the storage directory if needed (see :meth:`format_storage`), then start the
        JVM (returns at once; see :meth:`wait_ready`).

        Raises ``KafkaServerError`` if the node is already running, or its ports are one port or
        not TCP ports; ``JavaMissingError`` or ``KafkaJarsMissingError`` if there is nothing to
        run it with; ``KafkaPortInUseError`` if its client or controller port is taken by another
        process (Kafka would fail to bind it, and a readiness probe could reach that other
        process). Nothing is written to ``data_dir`` before these checks pass.
        """
        if self.running:
            raise KafkaServerError(
                f"kafka {self.bootstrap_servers} is already running (pid {self.pid})"
            )
        for what, port in (("client", self.port), ("controller", self.controller_port)):
            if not 1 <= port <= 65535:
                raise KafkaServerError(
                    f"kafka cannot start: its {what} port {port} is not a TCP port (1-65535); "
                    "choose another (`--port`, `--controller-port`)"
                )
        if self.port == self.controller_port:
            raise KafkaServerError(
                f"kafka cannot start: its client and controller ports are both {self.port}; "
                "choose two ports (`--port`, `--controller-port`)"
            )
        check_jars(self.jars_dir)
        find_java()
        for what, port in (("client", self.port), ("controller", self.controller_port)):
            if port_in_use(self.host, port):
                raise KafkaPortInUseError(
                    f"kafka cannot start: its {what} port {self.host}:{port} is in use by another "
                    "process (another Kafka?); stop it or choose another port (`--port`, "
                    "`--controller-port`)"
                )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.format_storage(cluster_id)
        command = self.command()
        self._log_file = self.log_path.open("ab")
        try:
            # Its own session: a Ctrl-C in the terminal reaches only our process, which then
            # stops the node with SIGTERM (a controlled shutdown).
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise JavaMissingError(f"cannot run {command[0]}: {exc}; {_JAVA_HINT}") from exc
        log.info(
            "kafka launched pid=%s node=%s bootstrap=%s controller=%s:%s data_dir=%s",
            self._process.pid,
            self.node_id,
            self.bootstrap_servers,
            self.host,
            self.controller_port,
            self.data_dir,
        )

    def wait_ready(self, timeout: float = 60.0, *, cancel: threading.Event | None = None) -> bool:
        """Block until the node answers a metadata request listing itself as a live broker (its
        controller quorum has a leader and it registered), and its process still runs; then logs
        "kafka started" and returns ``True``. Returns ``False`` as soon as ``cancel`` is set
        before that (the node is left running).

        Raises ``KafkaServerError`` (with the tail of the log) if the process exits or is not
        ready within ``timeout`` seconds.
        """
        started = time.monotonic()

        def check() -> None:
            self._check_alive()
            if cancel is not None and cancel.is_set():
                raise _Cancelled

        try:
            missing = wait_brokers(self.bootstrap_servers, {self.node_id}, timeout, alive=check)
        except _Cancelled:
            return False
        if missing:
            raise KafkaServerError(
                f"kafka {self.bootstrap_servers} not ready after {timeout}s; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        log.info(
            "kafka started pid=%s node=%s bootstrap=%s data_dir=%s seconds=%.1f",
            self.pid,
            self.node_id,
            self.bootstrap_servers,
            self.data_dir,
            time.monotonic() - started,
        )
        return True

    def _check_alive(self) -> None:
        if self._process is None or self._process.poll() is not None:
            code = None if self._process is None else self._process.returncode
            raise KafkaServerError(
                f"kafka {self.bootstrap_servers} is not running (exit code {code}); "
                f"log {self.log_path}:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node: SIGTERM (Kafka's controlled shutdown), then SIGKILL after ``timeout``
        seconds. Idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("kafka did not stop on SIGTERM pid=%s; killing it", process.pid)
                process.kill()
                process.wait()
            log.info(
                "kafka stopped pid=%s bootstrap=%s exit_code=%s",
                process.pid,
                self.bootstrap_servers,
                process.returncode,
            )
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the node (a crash: no controlled shutdown, nothing flushed) and wait until
        its process is gone. Idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
            log.info("kafka killed pid=%s bootstrap=%s", process.pid, self.bootstrap_servers)
        self._close_log()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the node's log."""
        return log_tail(self.log_path, lines)

    def _java_command(
        self, main_class: str, log_level: str, *args: str, flags: Sequence[str]
    ) -> list[str]:
        return [
            str(find_java()),
            f"-Xmx{self.heap}",
            *flags,
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            f"-Ddanube.kafka.log.level={log_level}",
            "-cp",
            str(check_jars(self.jars_dir) / "*"),
            main_class,
            *args,
        ]

    def _write_config(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"{key}={value}" for key, value in self.server_properties().items()]
        (self.data_dir / "server.properties").write_text("\n".join(lines) + "\n")
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        """Start and wait until ready; stops again if it does not get ready."""
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_brokers(
    bootstrap_servers: str,
    node_ids: set[int],
    timeout: float,
    *,
    alive: Callable[[], None] | None = None,
) -> set[int]:
    """Block until a metadata request to ``bootstrap_servers`` lists every broker in
    ``node_ids`` as live, or ``timeout`` seconds passed; returns the ids still missing then
    (empty: all live). ``alive``, if given, is called between tries and raises to give up (a
    node's process exited)."""
    # log_level 0: while the node is not listening yet, librdkafka would print every refused
    # connection to stderr.
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        try:
            seen = set(admin.list_topics(timeout=1).brokers)
        except KafkaException:  # no broker answered within the second
            seen = set()
        missing = node_ids - seen
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)
