"""Helpers for tests, benchmarks and local tooling: real servers on free loopback ports.

Shipped with the package (like bytewax's ``testing``) so the test suite, the benchmarks and the
Dagster code location all start the same things the same way.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from danube_ingest.broker.server import Broker
from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.metadata.errors import EtcdServerError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.server import EtcdServer

#: Tries with fresh ports when a port handed out by ``free_port`` was taken in between.
_START_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class LocalEtcd:
    """A throwaway single-node etcd: free loopback ports, a temp data dir, fast raft timings.

    Use as a context manager, sync (``with``) or async (``async with``); the data dir is deleted
    on exit. ``endpoint`` is the client URL; the server's log is ``server.log_path``.
    """

    def __init__(self, *, fast: bool = True) -> None:
        self._fast = fast
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
                self._temp_dir, client_port, peer_port, name="danube-test", fast=self._fast
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

    async def connect(self, *, timeout: float = 5.0) -> EtcdKV:
        """A new ``EtcdKV`` connected to this server."""
        return await EtcdKV.connect([self.endpoint], timeout=timeout)

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
        "storage.mode": "local_only",
        "storage.wal.segment_bytes": "1MiB",
        "storage.wal.segment_seconds": 2,
    }
    values.update(overrides or {})
    return load_config(None, values)


@asynccontextmanager
async def running_broker(config: BrokerConfig) -> AsyncIterator[Broker]:
    """A broker served in this process and event loop; stopped cleanly on exit."""
    broker = Broker(config)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop(grace=1.0)


class BrokerProcess:
    """A broker in a child process (``danube-ingest broker``), for kill/restart tests."""

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
    ) -> None:
        self.data_dir = Path(data_dir)
        self.etcd_endpoint = etcd_endpoint
        self.broker_id = broker_id
        self.port = port or free_port()
        self.prefix = prefix
        self.extra_args = extra_args
        self.lease_ttl = lease_ttl
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / f"{broker_id}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        """Start the broker and wait until it serves (its ready line is in the log)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / f"{self.broker_id}.yml"
        config.write_text(
            "etcd:\n"
            f"  prefix: {self.prefix}\n"
            f"  lease_ttl_seconds: {self.lease_ttl}\n"
            "storage:\n"
            "  mode: local_only\n"
            "  wal:\n"
            "    segment_bytes: 1MiB\n"
            "    segment_seconds: 2\n"
        )
        command = [
            sys.executable,
            "-m",
            "danube_ingest.cli",
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
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
            )
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

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL: a crash) and, for fatal signals, wait for the process to go."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                # A hung shutdown must fail the caller, not leave a broker running for good.
                self.process.kill()
                self.process.wait(timeout=30)
                raise RuntimeError(
                    f"broker did not exit within 30s of signal {sig}; killed it. "
                    f"Log {self.log_path}:\n{self.log_text()[-3000:]}"
                ) from None

    def stop(self) -> None:
        """Clean shutdown (SIGTERM)."""
        self.kill(signal.SIGTERM)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
