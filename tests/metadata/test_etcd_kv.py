"""EtcdKV specifics: connecting, and how etcd failures surface."""

from __future__ import annotations

import asyncio
import time

import pytest

from danube_ingest.metadata import (
    CommitStateUnknownError,
    EtcdKV,
    MetadataUnavailableError,
    Put,
)
from danube_ingest.metadata.etcd import parse_endpoint
from danube_ingest.testing import LocalEtcd, free_port

from .conftest import frozen

pytestmark = pytest.mark.etcd


def test_parse_endpoint() -> None:
    assert parse_endpoint("http://127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_endpoint("10.0.0.1:23790") == ("10.0.0.1", 23790)
    assert parse_endpoint("http://etcd") == ("etcd", 2379)


async def test_unreachable_endpoint_raises_unavailable_naming_it() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(MetadataUnavailableError, match=endpoint) as caught:
        await EtcdKV.connect([endpoint], timeout=0.5)
    assert time.monotonic() - started < 2
    assert caught.value.retriable


async def test_connect_uses_the_first_endpoint_that_answers(etcd_server: str) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    kv = await EtcdKV.connect([closed, etcd_server], timeout=1.0)
    try:
        assert kv.endpoint == etcd_server
    finally:
        await kv.close()


async def test_timeouts_against_a_frozen_server() -> None:
    """A write that times out has an unknown outcome; a read that times out is just unavailable."""
    async with LocalEtcd() as etcd:
        kv = await etcd.connect(timeout=0.3)
        pid = etcd.server.pid
        assert pid is not None
        with frozen(pid):
            with pytest.raises(CommitStateUnknownError, match="re-read before retrying") as caught:
                await kv.txn([], [Put("/frozen/a", b"1")])
            assert not caught.value.retriable
            with pytest.raises(MetadataUnavailableError):
                await kv.get("/frozen/a")
        # Once the server runs again the same client works again. Whether the timed-out write
        # landed depends on whether etcd saw it before its deadline: it sometimes does, which is
        # why such a write must be re-read, never assumed to have failed.
        stored = await kv.get("/frozen/a")
        assert stored is None or stored.value == b"1"
        await kv.close()


async def test_stopped_server_makes_watch_raise_unavailable() -> None:
    etcd = LocalEtcd()
    await asyncio.to_thread(etcd.start)
    try:
        kv = await etcd.connect(timeout=1.0)
        stream = await kv.watch_prefix("/w/")
        await asyncio.to_thread(etcd.server.stop)
        with pytest.raises(MetadataUnavailableError):
            await asyncio.wait_for(anext(stream), 5)
        with pytest.raises(MetadataUnavailableError):
            await kv.get("/w/a")
        await kv.close()
    finally:
        await asyncio.to_thread(etcd.stop)


async def test_a_watch_broken_mid_write_lets_its_request_writer_end(etcd_server: str) -> None:
    """grpc runs a watch stream's request generator in a task of its own. When aetcd ends a
    broken stream (``_terminate_stream``: ``None`` into the stream's queue, a new queue for the
    next stream) while that task is writing a request, the generator must end, not go on to
    wait on the next stream's queue: that task was left pending for ever and destroyed with the
    call ("Task was destroyed but it is pending!" in a broker resumed after a pause)."""
    kv = await EtcdKV.connect([etcd_server], timeout=2.0)
    try:
        watcher = kv._client._watcher
        requests = watcher._iter_request()
        await watcher._request_queue.put("create")
        assert await anext(requests) == "create"  # grpc is writing it when the stream breaks
        await watcher._terminate_stream(RuntimeError("the stream broke"))
        async with asyncio.timeout(2):
            with pytest.raises(StopAsyncIteration):
                await anext(requests)
    finally:
        await kv.close()
