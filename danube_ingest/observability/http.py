"""The daemon's HTTP port (``metrics.listen``): ``/metrics``, ``/healthz`` and ``/readyz``.

Served by the broker's own event loop (a minimal HTTP/1.1 server: one GET per connection),
which is what makes ``/healthz`` meaningful: it answers only while the loop runs callbacks, so
a blocked or dead loop shows as a probe that times out. It also means the scrape-time
collector reads the broker's state from the thread that owns it.

* ``GET /metrics``: Prometheus text format, the process-wide ``metrics.REGISTRY`` followed by
  the broker's own registry (``collector.BrokerCollector``).
* ``GET /healthz``: ``200 ok`` (the process is alive and its event loop responsive).
* ``GET /readyz``: ``200 ready`` while the broker serves, else ``503 not ready: REASON``
  (starting, stopping, etcd session lost, WAL failed...).

Anything else: 404 (unknown path) or 405 (a method other than GET/HEAD). A request must arrive
within ``REQUEST_TIMEOUT`` seconds and its head fit in ``MAX_REQUEST_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

#: Seconds a client has to send its request head.
REQUEST_TIMEOUT = 5.0
#: Largest request head accepted (a probe or a scrape sends a few hundred bytes).
MAX_REQUEST_BYTES = 8192

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``) as (host, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class ObservabilityServer:
    """The HTTP endpoint of one broker. ``await start()``, then ``await stop()``."""

    def __init__(
        self,
        listen: str,
        registries: Sequence[CollectorRegistry],
        readiness: Callable[[], str | None],
    ) -> None:
        """``readiness()`` returns None when ready, else why not (the 503 body)."""
        self._listen = listen
        self._registries = list(registries)
        self._readiness = readiness
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound server (the port is known after ``start``)."""
        host, _ = split_listen(self._listen)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve. Raises ``OSError`` when the address cannot be bound."""
        host, port = split_listen(self._listen)
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and drop open connections. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for writer in list(self._writers):
            writer.close()
        await server.wait_closed()

    def render_metrics(self) -> bytes:
        """The ``/metrics`` body."""
        return b"".join(generate_latest(registry) for registry in self._registries)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._exchange(reader, writer)
        finally:
            self._writers.discard(writer)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = b""
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, content_type, body = self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, content_type, body = 400, "text/plain", b"bad request\n"
        except ConnectionError:
            writer.close()
            return
        method = head.split(b" ", 1)[0]
        writer.write(
            (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
        )
        if method != b"HEAD":
            writer.write(body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3:
            return 400, "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"only GET and HEAD are served\n"
        if target == b"/metrics":
            return 200, CONTENT_TYPE_LATEST, self.render_metrics()
        if target == b"/healthz":
            return 200, "text/plain", b"ok\n"
        if target == b"/readyz":
            reason = self._readiness()
            if reason is None:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", f"not ready: {reason}\n".encode()
        return 404, "text/plain", b"not found: try /metrics, /healthz or /readyz\n"
