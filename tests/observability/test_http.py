"""The metrics port's HTTP server on its own: answers, bad requests, HEAD, readiness reasons."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from danube_ingest.observability.http import ObservabilityServer


async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    writer.write_eof()  # a request cut short ends here, not after the server's timeout
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


async def test_answers_and_refusals() -> None:
    registry = CollectorRegistry()
    Counter("probe_things", "Things.", registry=registry).inc(3)
    reason: list[str | None] = ["starting"]
    server = ObservabilityServer("127.0.0.1:0", [registry], lambda: reason[0])
    await server.start()
    try:
        port = server.port
        metrics = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert metrics.startswith(b"HTTP/1.1 200 OK\r\n") and b"probe_things_total 3.0" in metrics
        ready = await exchange(port, b"GET /readyz HTTP/1.1\r\n\r\n")
        assert ready.startswith(b"HTTP/1.1 503 ") and ready.endswith(b"not ready: starting\n")
        reason[0] = None
        assert (await exchange(port, b"GET /readyz?x=1 HTTP/1.1\r\n\r\n")).endswith(b"ready\n")
        head = await exchange(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        post = await exchange(port, b"POST /metrics HTTP/1.1\r\n\r\n")
        assert post.startswith(b"HTTP/1.1 405 ")
        assert (await exchange(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        # A head larger than the limit, or one cut short, is refused.
        huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n"
        assert (await exchange(port, huge)).startswith(b"HTTP/1.1 400 ")
        assert (await exchange(port, b"GET /metrics HTTP/1.1\r\n")).startswith(b"HTTP/1.1 400 ")
    finally:
        await server.stop()
