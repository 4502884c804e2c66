"""Helpers for tests, benchmarks and local tooling: real servers on free loopback ports.

Shipped with the package (like bytewax's ``testing``) so the test suite, the benchmarks and the
Dagster code location all start the same things the same way.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from danube_ingest.broker.server import Broker
from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.kafka.errors import JavaMissingError, KafkaJarsMissingError, KafkaServerError
from danube_ingest.kafka.server import KafkaServer, KafkaVoter, new_cluster_id, wait_brokers
from danube_ingest.metadata.errors import EtcdServerError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.server import EtcdServer, EtcdServerTls
from danube_ingest.testing_history import (  # the history checker, shipped with the fixtures
    History,
    Report,
    Span,
    assert_history_ok,
    check,
    manifest_spans,
    message_id,
    parse_message_id,
)

__all__ = [
    "BrokerProcess",
    "History",
    "LocalEtcd",
    "LocalKafka",
    "LocalKafkaCluster",
    "MotoServer",
    "Report",
    "Span",
    "assert_history_ok",
    "broker_config",
    "check",
    "fill_filesystem",
    "find_moto_server",
    "free_port",
    "local_etcd",
    "manifest_spans",
    "message_id",
    "parse_message_id",
    "running_broker",
    "small_filesystem",
]

#: Tries with fresh ports when a port handed out by ``free_port`` was taken in between.
_START_ATTEMPTS = 3


#: Ports ``free_port`` picks from: below the kernel's ephemeral range (32768-60999 by default),
#: so no outgoing connection of any process takes a server's port as its source port while
#: the server restarts on it (a broker SIGKILLed and started again on the same port).
_PORT_RANGE = (20_000, 32_000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it),
    outside the ephemeral range (see ``_PORT_RANGE``)."""
    low, high = _PORT_RANGE
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range
        sock.bind((host, 0))
        found: int = sock.getsockname()[1]
        return found


class _ServerProcess:
    """A server in a child process with a temp dir of its own: ``start()``/``stop()``, or use
    it as a context manager. The temp dir goes with ``stop()``."""

    _temp_dir: Path | None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _remove_temp_dir(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalEtcd(_ServerProcess):
    """A throwaway single-node etcd: free loopback ports, a temp data dir, fast raft timings.

    Use as a context manager, sync (``with``) or async (``async with``); the data dir is deleted
    on exit. ``endpoint`` is the client URL; the server's log is ``server.log_path``.
    """

    def __init__(
        self,
        *,
        fast: bool = True,
        tls: EtcdServerTls | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``tls``: serve the client port with TLS; ``extra_args``: more etcd flags."""
        self._fast = fast
        self._tls = tls
        self._extra_args = tuple(extra_args)
        self._temp_dir: Path | None = None
        self._server: EtcdServer | None = None

    @property
    def server(self) -> EtcdServer:
        """The running server (``EtcdServerError`` before ``start``)."""
        if self._server is None:
            raise EtcdServerError("LocalEtcd is not started")
        return self._server

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:40123``."""
        return self.server.endpoint

    def start(self) -> None:
        """Start etcd in a new temp dir and block until it is healthy."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            self._temp_dir = Path(tempfile.mkdtemp(prefix="danube-etcd-"))
            client_port = free_port()
            peer_port = free_port()
            while peer_port == client_port:
                peer_port = free_port()
            server = EtcdServer(
                self._temp_dir,
                client_port,
                peer_port,
                name="danube-test",
                fast=self._fast,
                tls=self._tls,
                extra_args=self._extra_args,
            )
            try:
                server.start()
                server.wait_healthy()
            except EtcdServerError:
                server.stop()
                self._remove_temp_dir()
                if attempt == _START_ATTEMPTS:
                    raise
                continue
            self._server = server
            return

    def stop(self) -> None:
        """Stop etcd and delete the temp data dir. Idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._remove_temp_dir()

    async def connect(
        self, *, timeout: float = 5.0, security: EtcdSecurity | None = None
    ) -> EtcdKV:
        """A new ``EtcdKV`` connected to this server."""
        return await EtcdKV.connect([self.endpoint], timeout=timeout, security=security)

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


@asynccontextmanager
async def local_etcd(*, fast: bool = True, timeout: float = 5.0) -> AsyncIterator[EtcdKV]:
    """A fresh ``LocalEtcd`` and an ``EtcdKV`` connected to it; both are closed on exit."""
    async with LocalEtcd(fast=fast) as etcd:
        kv = await etcd.connect(timeout=timeout)
        try:
            yield kv
        finally:
            await kv.close()


def broker_config(
    data_dir: Path | str,
    etcd_endpoint: str,
    *,
    broker_id: str = "broker-1",
    port: int = 0,
    prefix: str = "/danube",
    overrides: dict[str, Any] | None = None,
) -> BrokerConfig:
    """A broker configuration for tests: loopback, given etcd, short lease, small segments."""
    values: dict[str, Any] = {
        "broker.broker_id": broker_id,
        "broker.listen": f"127.0.0.1:{port}",
        "broker.data_dir": str(data_dir),
        "etcd.endpoints": etcd_endpoint,
        "etcd.prefix": prefix,
        "etcd.lease_ttl_seconds": 2,
        # A free port, as for gRPC: brokers of concurrent tests must not share 9650.
        "metrics.listen": "127.0.0.1:0",
        "storage.mode": "local_only",
        "storage.wal.segment_bytes": "1MiB",
        "storage.wal.segment_seconds": 2,
    }
    values.update(overrides or {})
    return load_config(None, values)


@contextmanager
def small_filesystem(path: Path, size: int) -> Iterator[Path]:
    """A real filesystem of ``size`` bytes (a tmpfs) mounted at ``path`` (created), unmounted on
    exit: a disk that really fills up, for disk-full tests. Needs root (CAP_SYS_ADMIN);
    ``RuntimeError`` with mount's own message when that is refused."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        raise RuntimeError(
            f"cannot mount a {size}-byte tmpfs at {path} (disk-full tests need root or "
            f"CAP_SYS_ADMIN): {mounted.stderr.strip()}"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_filesystem(path: Path, leave: int) -> int:
    """Write a file ``path`` that leaves about ``leave`` bytes free on its filesystem (as
    ``statvfs`` counts them); returns the file's size. Deleting the file gives the space back.

    Space another process takes meanwhile (a broker under test still writing) can fill the
    filesystem before the file is written in full: the file is then cut back by ``leave``
    bytes, so about ``leave`` bytes are still free, as asked."""
    st = os.statvfs(path.parent)
    size = max(st.f_bavail * st.f_frsize - leave, 0)
    block = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            try:
                written += os.write(fd, block[: min(size - written, len(block))])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                written = max(written - leave, 0)
                os.ftruncate(fd, written)
                break
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


@asynccontextmanager
async def running_broker(config: BrokerConfig) -> AsyncIterator[Broker]:
    """A broker served in this process and event loop; stopped cleanly on exit."""
    broker = Broker(config)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop(grace=1.0)


#: A ``BrokerProcess(warm=True)`` spare: the CLI imported, then the arguments awaited.
_WARM_DAEMON = """
import json, sys
from danube_ingest.cli import main
line = sys.stdin.readline()
sys.exit(main(json.loads(line)) if line else 0)
"""


class BrokerProcess:
    """A broker in a child process (``danube-ingest broker``), for kill/restart tests.

    Its config file has ``storage.mode: local_only`` and small segments (1 MiB or 2 s);
    ``storage`` is merged into that section, nested dicts key by key, e.g.
    ``{"mode": "wal_cloud", "cloud": {"backend": "fs", "root": "/shared/objects"}}``.
    ``tls`` is its ``broker.tls`` section (``{"cert_file": ..., "key_file": ...}``: it then
    serves TLS and ``url`` is ``https://``); ``auth`` its ``auth`` section.

    ``warm=True`` keeps a spare interpreter that has already imported the daemon's code
    (about 1.5 s of a start on a busy 2-core machine) waiting for its command line: each
    ``start`` hands the command to the spare, if one is ready and this process's environment is
    unchanged since it was spawned, and spawns the next spare once the daemon serves (or the
    start failed). The daemon is still a fresh process on every start: it opens the data dir,
    recovers the WAL and registers in etcd only after it got its command line; only the
    imports are done beforehand. ``stop`` ends the spare too.
    """

    def __init__(
        self,
        data_dir: Path,
        etcd_endpoint: str,
        *,
        broker_id: str = "broker-1",
        port: int | None = None,
        prefix: str = "/danube",
        extra_args: tuple[str, ...] = (),
        lease_ttl: int = 2,
        storage: dict[str, Any] | None = None,
        tls: dict[str, Any] | None = None,
        auth: dict[str, Any] | None = None,
        warm: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.etcd_endpoint = etcd_endpoint
        self.broker_id = broker_id
        self.port = port or free_port()
        self.prefix = prefix
        self.extra_args = extra_args
        self.lease_ttl = lease_ttl
        self.storage = storage
        self.tls = tls
        self.auth = auth
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / f"{broker_id}.log"
        self.warm = warm
        self._spare: subprocess.Popen[bytes] | None = None
        self._spare_env: dict[str, str] = {}

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the broker and wait until it serves (its ready line is in the log)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / f"{self.broker_id}.yml"
        storage: dict[str, Any] = {
            "mode": "local_only",
            "wal": {"segment_bytes": "1MiB", "segment_seconds": 2},
        }
        values: dict[str, Any] = {
            "etcd": {"prefix": self.prefix, "lease_ttl_seconds": self.lease_ttl},
            "metrics": {"listen": "127.0.0.1:0"},
            "storage": self._merged(storage, self.storage or {}),
        }
        if self.tls:
            values["broker"] = {"tls": self.tls}
        if self.auth:
            values["auth"] = self.auth
        config.write_text(yaml.safe_dump(values, sort_keys=False))
        arguments = [
            "broker",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--data-dir",
            str(self.data_dir),
            "--etcd",
            self.etcd_endpoint,
            "--broker-id",
            self.broker_id,
            *self.extra_args,
        ]
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        spare = self._take_spare()
        if spare is not None:
            assert spare.stdin is not None
            spare.stdin.write(json.dumps(arguments).encode() + b"\n")
            spare.stdin.close()
            self.process = spare
        else:
            command = [sys.executable, "-m", "danube_ingest.cli", *arguments]
            with self.log_path.open("ab") as log_file:
                self.process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
                )
        try:
            self._wait_serving(offset, timeout)
        finally:
            if self.warm:
                self._spawn_spare()

    def _wait_serving(self, offset: int, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if "serving on" in text:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"broker exited ({self.process.returncode}):\n{text[-3000:]}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"broker did not start within {timeout}s; see {self.log_path}")

    def _spawn_spare(self) -> None:
        """Start the next daemon's interpreter: it imports the CLI, then waits for its
        arguments (one JSON line on stdin); an empty stdin makes it exit."""
        if self._spare is not None:
            return
        self._spare_env = dict(os.environ)
        with self.log_path.open("ab") as log_file:
            self._spare = subprocess.Popen(
                [sys.executable, "-c", _WARM_DAEMON],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )

    def _take_spare(self) -> subprocess.Popen[bytes] | None:
        """The waiting spare, if it is alive and was spawned with this environment (a test may
        have changed it since, e.g. LD_PRELOAD for libfaketime); else ``None``."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.poll() is None and self._spare_env == dict(os.environ):
            return spare
        self._end_spare(spare)
        return None

    @staticmethod
    def _end_spare(spare: subprocess.Popen[bytes]) -> None:
        if spare.poll() is None:
            spare.kill()
        spare.wait(timeout=30)
        if spare.stdin is not None:
            spare.stdin.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL: a crash) and, for fatal signals, wait for the process to go."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # A hung shutdown must fail the caller, not leave a broker running for good;
                # SIGUSR1 first, so its log shows where it was stuck (every thread's stack).
                self.process.send_signal(signal.SIGUSR1)
                time.sleep(1)
                self.process.kill()
                self.process.wait(timeout=30)
                raise RuntimeError(
                    f"broker did not exit within 30s of signal {sig}; killed it. "
                    f"Log {self.log_path}:\n{self.log_text()[-3000:]}"
                ) from None

    def stop(self) -> None:
        """Clean shutdown (SIGTERM); a ``warm`` spare is ended."""
        spare, self._spare = self._spare, None
        if spare is not None:
            self._end_spare(spare)
        self.kill(signal.SIGTERM)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @staticmethod
    def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
        """``base`` updated with ``update``, nested dicts merged key by key (neither changes)."""
        merged = dict(base)
        for key, value in update.items():
            current = merged.get(key)
            if isinstance(current, dict) and isinstance(value, dict):
                merged[key] = BrokerProcess._merged(current, value)
            else:
                merged[key] = value
        return merged


#: An opener that ignores HTTP(S)_PROXY: the servers started here are on loopback.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_moto_server() -> Path:
    """The ``moto_server`` script of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).parent / "moto_server"
    if beside.is_file():
        return beside
    on_path = shutil.which("moto_server")
    if on_path is None:
        raise RuntimeError("moto_server not found: pip install 'moto[server]'")
    return Path(on_path)


class MotoServer(_ServerProcess):
    """A moto S3 server (``moto_server``) in a child process on a free loopback port.

    A separate process, not moto's in-process mock: opendal's blocking calls deadlocked against
    a server sharing the interpreter. Use as a context manager or ``start``/``stop``.
    ``create_bucket`` makes buckets on demand; ``options`` are the opendal s3 options that reach
    the server. With ``auth=True`` moto checks signatures against its IAM users, so the test keys
    are rejected (403 ``InvalidAccessKeyId``): a server for permission-error tests. ``port``
    pins the port (e.g. to bring back an endpoint a store already points at); by default a free
    one is picked, and another one if it was taken meanwhile.
    """

    region = "us-east-1"
    access_key_id = "danube-test-key"
    secret_access_key = "danube-test-secret"

    def __init__(
        self, *, port: int | None = None, auth: bool = False, host: str = "127.0.0.1"
    ) -> None:
        self.auth = auth
        self.host = host
        self.port = port or 0
        self._fixed_port = port is not None
        self.process: subprocess.Popen[bytes] | None = None
        self._temp_dir: Path | None = None

    @property
    def endpoint(self) -> str:
        """The server's URL, e.g. ``http://127.0.0.1:40123`` (known before ``start`` only when
        the port was given)."""
        if not self.port:
            raise RuntimeError("MotoServer is not started")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go (deleted by ``stop``)."""
        if self._temp_dir is None:
            raise RuntimeError("MotoServer is not started")
        return self._temp_dir / "moto.log"

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and block until it answers HTTP."""
        if self.process is not None:
            raise RuntimeError(f"MotoServer already running at {self.endpoint}")
        env = dict(os.environ)
        if self.auth:
            # moto enforces IAM once this many requests have been served: here, from the first.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        command = [str(find_moto_server()), "-H", self.host, "-p"]
        self._temp_dir = Path(tempfile.mkdtemp(prefix="danube-moto-"))
        attempts = 1 if self._fixed_port else _START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            if not self._fixed_port:
                self.port = free_port(self.host)
            with self.log_path.open("ab") as log_file:
                self.process = subprocess.Popen(
                    [*command, str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            try:
                self._wait_ready(timeout)
            except RuntimeError:
                self._kill()
                if attempt == attempts:
                    self._remove_temp_dir()
                    raise
                continue
            return

    def stop(self) -> None:
        """Kill the server and delete its log. Idempotent."""
        self._kill()
        self._remove_temp_dir()

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (no error if it exists already) and return the name."""
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with _NO_PROXY.open(request, timeout=10) as response:
            response.read()
        return name

    def options(self, bucket: str, root: str = "") -> dict[str, str]:
        """opendal ``s3`` options for ``bucket`` on this server (root: a path in the bucket)."""
        options = {
            "bucket": bucket,
            "endpoint": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "disable_config_load": "true",
            "disable_ec2_metadata": "true",
        }
        if root:
            options["root"] = root
        return options

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited ({self.process.returncode}):\n{self._log_tail()}"
                )
            try:
                with _NO_PROXY.open(f"{self.endpoint}/moto-api/", timeout=0.5):
                    return
            except urllib.error.HTTPError:
                return  # it answers; the status does not matter
            except OSError:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"moto_server not answering after {timeout}s:\n{self._log_tail()}"
                )
            time.sleep(0.02)

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10)

    def log_text(self) -> str:
        """What the server logged so far: one line per request served."""
        if self._temp_dir is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _log_tail(self) -> str:
        return self.log_text()[-3000:]


#: A test node's JVM heap: a few topics of small records; three nodes fit a 2-core CI machine.
_TEST_KAFKA_HEAP = "256m"


def _kafka_start_failed_for_good(exc: KafkaServerError) -> bool:
    """Whether trying again with fresh ports cannot help (nothing to run Kafka with)."""
    return isinstance(exc, KafkaJarsMissingError | JavaMissingError)


class LocalKafka(_ServerProcess):
    """A throwaway single-node KRaft Kafka: free loopback ports, a temp data dir, the fast
    timings of ``danube_ingest.kafka.server.FAST_PROPERTIES``, a 256 MiB heap.

    Use as a context manager or ``start``/``stop``; ``stop`` kills the JVM (the data is thrown
    away, so a controlled shutdown would only cost time) and deletes the temp dir.
    ``bootstrap_servers`` is what Kafka clients connect to; ``properties`` are added to the
    node's ``server.properties``.
    """

    def __init__(self, *, properties: dict[str, str] | None = None) -> None:
        self._properties = dict(properties or {})
        self._temp_dir: Path | None = None
        self._server: KafkaServer | None = None

    @property
    def server(self) -> KafkaServer:
        """The running node (``KafkaServerError`` before ``start``)."""
        if self._server is None:
            raise KafkaServerError("LocalKafka is not started")
        return self._server

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:PORT``, the node's client listener."""
        return self.server.bootstrap_servers

    def start(self, timeout: float = 90.0) -> None:
        """Format a new temp dir, start the node and block until it answers as a live broker;
        tries again with fresh ports if a port was taken meanwhile."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            self._temp_dir = Path(tempfile.mkdtemp(prefix="danube-kafka-"))
            port, controller_port = _distinct_free_ports(2)
            server = KafkaServer(
                self._temp_dir,
                port,
                controller_port,
                heap=_TEST_KAFKA_HEAP,
                fast=True,
                properties=self._properties,
            )
            try:
                server.start()
                server.wait_ready(timeout)
            except KafkaServerError as exc:
                server.kill()
                self._remove_temp_dir()
                if attempt == _START_ATTEMPTS or _kafka_start_failed_for_good(exc):
                    raise
                continue
            self._server = server
            return

    def stop(self) -> None:
        """Kill the node and delete the temp data dir. Idempotent."""
        if self._server is not None:
            self._server.kill()
            self._server = None
        self._remove_temp_dir()


class LocalKafkaCluster(_ServerProcess):
    """A throwaway KRaft cluster of ``size`` nodes (3 by default) on loopback, each broker and
    controller in one JVM, the controller quorum made of all of them; free ports, a temp dir
    (one sub-directory per node), fast timings, 256 MiB heap per node.

    Node ids are 1..size. ``kill(node_id)`` SIGKILLs one node (a crash) and ``restart(node_id)``
    brings it back on the same ports and storage. Kafka's internal topics get
    ``min(3, size)`` replicas and ``min(2, size)`` in-sync replicas. ``stop`` kills every node
    and deletes the temp dir.
    """

    def __init__(self, size: int = 3, *, properties: dict[str, str] | None = None) -> None:
        if size < 1:
            raise ValueError(f"a Kafka cluster needs at least one node, not {size}")
        self.size = size
        self._properties = dict(properties or {})
        self._temp_dir: Path | None = None
        self._nodes: dict[int, KafkaServer] = {}
        self._cluster_id = ""

    @property
    def nodes(self) -> dict[int, KafkaServer]:
        """The nodes by node id (``KafkaServerError`` before ``start``)."""
        if not self._nodes:
            raise KafkaServerError("LocalKafkaCluster is not started")
        return dict(self._nodes)

    @property
    def bootstrap_servers(self) -> str:
        """Every node's client listener, comma-separated."""
        return ",".join(node.bootstrap_servers for node in self.nodes.values())

    def start(self, timeout: float = 120.0) -> None:
        """Format every node's storage (in parallel), start every JVM, and block until a
        metadata request lists all ``size`` brokers as live; tries again with fresh ports if a
        port was taken meanwhile."""
        for attempt in range(1, _START_ATTEMPTS + 1):
            self._temp_dir = Path(tempfile.mkdtemp(prefix="danube-kafka-cluster-"))
            ports = _distinct_free_ports(2 * self.size)
            voters = [
                KafkaVoter(node_id, "127.0.0.1", ports[2 * node_id - 1])
                for node_id in range(1, self.size + 1)
            ]
            self._nodes = {
                voter.node_id: KafkaServer(
                    self._temp_dir / f"node-{voter.node_id}",
                    ports[2 * voter.node_id - 2],
                    voter.controller_port,
                    node_id=voter.node_id,
                    voters=voters,
                    heap=_TEST_KAFKA_HEAP,
                    fast=True,
                    properties=self._properties,
                )
                for voter in voters
            }
            self._cluster_id = new_cluster_id()
            try:
                self._start_all(timeout)
            except KafkaServerError as exc:
                self.stop()
                if attempt == _START_ATTEMPTS or _kafka_start_failed_for_good(exc):
                    raise
                continue
            return

    def _start_all(self, timeout: float) -> None:
        nodes = list(self._nodes.values())
        # Each format is a JVM start of its own (~2 s): side by side, not one after another.
        with ThreadPoolExecutor(len(nodes)) as pool:
            list(pool.map(lambda node: node.format_storage(self._cluster_id), nodes))
        for node in nodes:
            node.start(self._cluster_id)
        missing = wait_brokers(
            self.bootstrap_servers, set(self._nodes), timeout, alive=self._check_alive
        )
        if missing:
            raise KafkaServerError(
                f"kafka cluster {self.bootstrap_servers} not ready after {timeout}s: nodes "
                f"{sorted(missing)} not live; logs under {self._temp_dir}"
            )

    def _check_alive(self) -> None:
        for node_id, node in self._nodes.items():
            if not node.running:
                raise KafkaServerError(
                    f"kafka node {node_id} ({node.bootstrap_servers}) exited while the cluster "
                    f"started; log {node.log_path}:\n{node.log_tail()}"
                )

    def kill(self, node_id: int) -> None:
        """SIGKILL node ``node_id`` (a crash) and wait until its process is gone."""
        self.nodes[node_id].kill()

    def restart(self, node_id: int, timeout: float = 60.0) -> None:
        """Start node ``node_id`` again on its ports and storage, and block until it is a live
        broker again."""
        node = self.nodes[node_id]
        node.start(self._cluster_id)
        node.wait_ready(timeout)

    def stop(self) -> None:
        """Kill every node and delete the temp dir. Idempotent."""
        for node in self._nodes.values():
            node.kill()
        self._nodes = {}
        self._remove_temp_dir()


def _distinct_free_ports(count: int) -> list[int]:
    """``count`` different ports, each free a moment ago (see ``free_port``)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def find_postgres_bin() -> Path:
    """The directory of PostgreSQL's server programs (``initdb``, ``postgres``): Debian's
    newest ``/usr/lib/postgresql/N/bin``, else where ``initdb`` is on ``PATH``.
    ``FileNotFoundError`` naming the package when there is none."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if versions and (versions[-1] / "initdb").exists():
        return versions[-1]
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise FileNotFoundError(
        "PostgreSQL's initdb is not installed: apt-get install postgresql (make setup does)"
    )


class LocalPostgres(_ServerProcess):
    """A throwaway PostgreSQL server: ``initdb`` into a temp dir, ``postgres`` on a free
    loopback port (trust authentication, fsync off), one database ``iceberg``. PostgreSQL
    refuses to run as root, so when this process is root the server runs as the ``postgres``
    user (Debian's package creates it) through ``runuser``. ``url`` is the SQLAlchemy URL."""

    user = "danube"
    database = "iceberg"

    def __init__(self) -> None:
        self._temp_dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._bin = Path()
        """PostgreSQL's programs (``find_postgres_bin``), found by ``start``."""

    @property
    def url(self) -> str:
        """``postgresql+psycopg2://danube@127.0.0.1:PORT/iceberg``."""
        return self.url_of(self.database)

    def url_of(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server."""
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        """A new database (a catalog of its own for one test)."""
        made = self._createdb(name)
        if made.returncode != 0:
            raise RuntimeError(f"createdb {name} failed: {made.stderr}")

    def _createdb(self, name: str) -> subprocess.CompletedProcess[str]:
        createdb = self._bin / "createdb"
        argv = [str(createdb) if createdb.exists() else "createdb"]
        argv += ["-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    @property
    def log_path(self) -> Path:
        assert self._temp_dir is not None
        return self._temp_dir / "postgres.log"

    def _as_owner(self, argv: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return argv
        return ["runuser", "-u", "postgres", "--", *argv]

    def start(self, timeout: float = 30.0) -> None:
        """initdb, start the server, create the database; blocks until it answers."""
        binaries = self._bin = find_postgres_bin()
        self._temp_dir = Path(tempfile.mkdtemp(prefix="danube-pg-"))
        if os.geteuid() == 0:
            import pwd

            owner = pwd.getpwnam("postgres")
            os.chown(self._temp_dir, owner.pw_uid, owner.pw_gid)
        data = self._temp_dir / "data"
        initdb = self._as_owner(
            [str(binaries / "initdb"), "-D", str(data), "-U", self.user, "--auth=trust",
             "-E", "UTF8", "--no-sync"]
        )  # fmt: skip
        done = subprocess.run(initdb, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            self._remove_temp_dir()
            raise RuntimeError(f"initdb failed: {done.stderr[-2000:]}")
        self.port = free_port()
        server = self._as_owner(
            [str(binaries / "postgres"), "-D", str(data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-k", str(self._temp_dir),
             "-c", "fsync=off", "-c", "full_page_writes=off"]
        )  # fmt: skip
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(server, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            made = self._createdb(self.database)
            if made.returncode == 0:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start: {made.stderr} {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its directory. Idempotent."""
        if self.process is not None:
            if self.process.poll() is None:
                # The postmaster itself: ``runuser`` (when root) neither passes SIGINT on nor
                # takes its child along when killed.
                self._signal_server(signal.SIGINT)
                try:
                    self.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self._signal_server(signal.SIGKILL)
                    self.process.kill()
                    self.process.wait()
            self.process = None
        self._remove_temp_dir()

    def _signal_server(self, sig: signal.Signals) -> None:
        """``sig`` to the postmaster (its pid is the first line of ``postmaster.pid``), or to
        the child process when the file is not there (yet)."""
        assert self.process is not None and self._temp_dir is not None
        try:
            pid = int((self._temp_dir / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = self.process.pid
        with suppress(ProcessLookupError):
            os.kill(pid, sig)
