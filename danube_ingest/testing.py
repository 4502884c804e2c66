"""Helpers for tests, benchmarks and local tooling: real servers on free loopback ports.

Shipped with the package (like bytewax's ``testing``) so the test suite, the benchmarks and the
Dagster code location all start the same things the same way.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Self

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
