"""``danube-ingest topics delete`` against a running broker (real etcd, real danube-client, fs
object store): clients get NOT_FOUND, the topic's etcd keys and objects go, its WAL space is
freed, and a topic created again under the name starts clean at offset 0."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.server import Broker
from danube_ingest.cli import main
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.orphans import collect_orphans
from danube_ingest.testing import BrokerProcess

from .conftest import BrokerFactory
from .support import (
    Clients,
    consumer_request,
    eventually,
    offsets,
    payloads,
    raw_stubs,
    rpc_error,
)
from .test_admin_cli import run_cli

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

T = "/default/doomed"
KEEP = "/default/keeper"
HOUR_MS = 3_600_000

COLD: dict[str, Any] = {
    "storage.mode": "wal_cloud",
    "storage.wal.segment_seconds": 0.5,
    "storage.wal.retention.check_seconds": 0.2,
}


def _topic_keys(found: list[str]) -> list[str]:
    return [k for k in found if "doomed" in k]


async def test_delete_fences_clients_removes_keys_objects_and_wal_and_recreates_clean(
    make_broker: BrokerFactory,
    etcd_server: str,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broker: Broker = await make_broker(**COLD)
    assert broker.store is not None and broker.uploader is not None
    assert broker.objects is not None and broker.cleaner is not None
    kv = await EtcdKV.connect([etcd_server], timeout=5.0)
    keys = Keys(etcd_prefix)
    async with asyncio.timeout(90), Clients(broker.url) as clients:
        producer = await clients.producer(T, "p1")
        # A subscription that never acks holds the topic's WAL segments.
        await clients.consumer(T, "holder", "h1")
        sub = await clients.consumer(T, "s1", "c1")
        # Alone first (segment objects holding only the doomed topic), then next to KEEP
        # (segment objects shared with it).
        for i in range(10):
            await producer.send(f"old-{i}".encode())
        await eventually(lambda: broker.uploader.stats.ranges >= 1, "an upload of T alone")  # type: ignore[union-attr]
        keeper = await clients.producer(KEEP, "k1")
        for i in range(10):
            await producer.send(f"old-{10 + i}".encode())
            await keeper.send(f"keep-{i}".encode())
        got = await sub.take(20)
        await sub.ack_all(got)
        assert offsets(got) == list(range(20))
        manifest_before = await kv.get_prefix(keys.storage_objects_prefix(T))
        await eventually(
            lambda: broker.store.uploaded_below(T, 20),  # type: ignore[union-attr]
            "T uploaded",
        )
        doomed_objects = {
            (await kv.get(k.key)).value.decode()  # type: ignore[union-attr]
            for k in await kv.get_prefix(keys.storage_objects_prefix(T))
        }
        assert manifest_before and doomed_objects
        region = broker.store._region(T)
        meta = region.topic(T)
        assert meta is not None
        held = {span.seq for span in meta.spans}
        await broker.cleaner.clean_once()
        assert held & region.sealed, "the holding subscription keeps T's segments"
        bytes_before = region.disk_bytes
        # A retention policy and a retained floor of the topic go with it too.
        await kv.put(keys.policy(T), b'{"max_age_ms":1000}')
        await kv.put(keys.topic_floor(T), b'{"offset":0,"expired_ms":0,"reason":"test"}')

        out = await run_cli(
            capsys, "topics", "delete", T, "--etcd", etcd_server, "--prefix", etcd_prefix
        )
        assert f"topic {T} deleted" in out and "2 subscriptions" in out

        # The owner was fenced and dropped the topic from its WAL.
        await eventually(lambda: broker.store.info(T) is None, "T dropped from the WAL")  # type: ignore[union-attr]
        async with raw_stubs(broker.url) as raw:
            error = await rpc_error(raw.consumers.Subscribe(consumer_request(T, "s1", "c1")))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            lookup = await rpc_error(
                raw.discovery.TopicLookup(pb.TopicLookupRequest(request_id=1, topic=T))
            )
            assert lookup.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(Exception) as failed:
            await producer.send(b"after delete")
        assert "NOT_FOUND" in repr(failed.value) or "not" in str(failed.value).lower()

        # Every etcd key of the topic is gone but its epoch counter.
        left = _topic_keys([k.key for k in await kv.get_prefix(etcd_prefix + "/")])
        assert left == [keys.topic_epoch(T)], left

        # The WAL segments the topic held are freed (uploaded, then no floor holds them).
        region.rotate()
        await keeper.send(b"keep-more")

        async def freed() -> bool:
            await broker.cleaner.clean_once()  # type: ignore[union-attr]
            return not (held & region.sealed)

        deadline = time.monotonic() + 30
        while not await freed():
            assert time.monotonic() < deadline, (sorted(held), sorted(region.sealed))
            await asyncio.sleep(0.3)
        assert not region.dropped or min(region.sealed, default=0) <= max(region.dropped.values())
        print(f"WAL region bytes: {bytes_before} before the deletion, {region.disk_bytes} after")

        # Objects: those only the topic named go after the grace period; shared ones stay.
        report = await collect_orphans(
            kv, keys, broker.objects, now_ms=int(time.time() * 1000) + 2 * HOUR_MS
        )
        stored = set(await broker.objects.list("segments/"))
        keep_objects = {
            (await kv.get(k.key)).value.decode()  # type: ignore[union-attr]
            for k in await kv.get_prefix(keys.storage_objects_prefix(KEEP))
        }
        assert report.deleted, "objects only the deleted topic named are collected"
        for key in report.deleted:
            assert key not in stored
            assert not any(key in value for value in keep_objects)
        for value in keep_objects:
            assert any(obj in value for obj in stored), "an object KEEP needs was deleted"

        # Created again: offset 0, none of the old data.
        again = await clients.producer(T, "p1")
        fresh = await clients.consumer(T, "s1", "c2")
        for i in range(3):
            await again.send(f"new-{i}".encode())
        got = await fresh.take(3)
        assert offsets(got) == [0, 1, 2]
        assert payloads(got) == [b"new-0", b"new-1", b"new-2"]
        info = broker.store.info(T)
        assert info is not None and info.first_offset == 0 and info.high_watermark == 3
    await kv.close()


async def _delete(etcd_server: str, etcd_prefix: str, topic: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "danube_ingest.cli",
        "topics",
        "delete",
        topic,
        "--etcd",
        etcd_server,
        "--prefix",
        etcd_prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def _recreated_reads_clean(url: str, old: int) -> None:
    """A re-created topic (on the broker at ``url``) holds offsets 0.. with only new data."""
    async with Clients(url) as clients:
        producer = await clients.producer(T, "p2")
        sub = await clients.consumer(T, "fresh", "c1")
        for i in range(3):
            await producer.send(f"new-{i}".encode())
        got = await sub.take(3)
        assert offsets(got) == [0, 1, 2]
        assert payloads(got) == [b"new-0", b"new-1", b"new-2"]
        with pytest.raises(AssertionError):
            await sub.take(1, timeout=1.0)  # nothing of the old incarnation's offsets
        assert old > 3


@pytest.mark.parametrize("broker_up", [True, False], ids=["deleted-while-up", "deleted-while-down"])
async def test_recreated_topic_stays_clean_across_a_restart(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, broker_up: bool
) -> None:
    """The WAL still holds the deleted incarnation's frames (``local_only``: nothing prunes
    them): after a SIGKILL restart that recovers it, the re-created topic shows none of them.
    Deleted while the broker serves the topic (its DROP frame is recovered), and while the
    broker is down (it finds the stale data when the topic is created again)."""
    broker = BrokerProcess(tmp_path / "b1", etcd_server, prefix=etcd_prefix)
    await asyncio.to_thread(broker.start)
    try:
        async with asyncio.timeout(120):
            async with Clients(broker.url) as clients:
                producer = await clients.producer(T, "p1")
                for i in range(20):
                    await producer.send(f"old-{i}".encode())
            if broker_up:
                await _delete(etcd_server, etcd_prefix, T)
                await eventually(
                    lambda: (
                        f"topic deleted: fenced and dropped topic={T} wal_dropped=True"
                        in broker.log_text()
                    ),
                    "the owner dropping the topic",
                )
                await _recreated_reads_clean(broker.url, 20)
                broker.kill(signal.SIGKILL)
            else:
                broker.kill(signal.SIGKILL)
                await _delete(etcd_server, etcd_prefix, T)
            await asyncio.to_thread(broker.start)
            if broker_up:
                # The subscription "fresh" (nothing acked) resumes from offset 0: only the new
                # incarnation's entries, and offsets continue after them.
                async with Clients(broker.url) as clients:
                    producer = await clients.producer(T, "p2")
                    sub = await clients.consumer(T, "fresh", "c1")
                    await producer.send(b"after-restart")
                    got = await sub.take(4)
                    assert payloads(got) == [b"new-0", b"new-1", b"new-2", b"after-restart"]
                    assert offsets(got) == [0, 1, 2, 3]
            else:
                await _recreated_reads_clean(broker.url, 20)
                assert f"stale wal data of a deleted topic dropped topic={T}" in broker.log_text()
            text = broker.log_text()
            assert "Traceback" not in text, text[-3000:]
    finally:
        await asyncio.to_thread(broker.stop)


async def test_broker_down_during_deletion_never_serves_the_old_incarnation(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    """Broker A holds the old incarnation's frames in its WAL and is down while the topic is
    deleted and created again on broker B. When A later takes the topic over, it drops its
    stale frames (the topic record's incarnation differs from the one its WAL recorded): a
    consumer reads exactly B's entries, from objects, and A's uploader commits nothing old."""
    storage = {
        "mode": "wal_cloud",
        "cloud": {"backend": "fs", "root": str(tmp_path / "objects")},
        "wal": {"segment_seconds": 1},
    }
    a = BrokerProcess(
        tmp_path / "a", etcd_server, broker_id="a", prefix=etcd_prefix, storage=storage
    )
    b = BrokerProcess(
        tmp_path / "b", etcd_server, broker_id="b", prefix=etcd_prefix, storage=storage
    )
    await asyncio.to_thread(a.start)
    try:
        async with asyncio.timeout(120):
            async with Clients(a.url) as clients:
                producer = await clients.producer(T, "p1")
                for i in range(20):
                    await producer.send(f"old-{i}".encode())
            a.kill(signal.SIGKILL)
            await _delete(etcd_server, etcd_prefix, T)
            await asyncio.to_thread(b.start)
            async with Clients(b.url) as clients:
                producer = await clients.producer(T, "p2")
                sub = await clients.consumer(T, "fresh", "c1")
                for i in range(3):
                    await producer.send(f"new-{i}".encode())
                assert offsets(await sub.take(3)) == [0, 1, 2]
            kv = await EtcdKV.connect([etcd_server], timeout=5.0)
            keys = Keys(etcd_prefix)
            try:
                deadline = time.monotonic() + 30
                while not await kv.get_prefix(keys.storage_objects_prefix(T)):
                    assert time.monotonic() < deadline, "B's entries never reached the manifest"
                    await asyncio.sleep(0.3)
                await asyncio.to_thread(b.stop)  # releases the topic
                await asyncio.to_thread(a.start)
                async with Clients(a.url) as clients:
                    sub = await clients.consumer(T, "fresh", "c1")
                    got = await sub.take(3)
                    assert payloads(got) == [b"new-0", b"new-1", b"new-2"]
                    assert offsets(got) == [0, 1, 2]
                    with pytest.raises(AssertionError):
                        await sub.take(1, timeout=2.0)
                await asyncio.sleep(2)  # A's uploader had its chance at the old segments
                entries = await kv.get_prefix(keys.storage_objects_prefix(T))
                assert all(
                    b'"broker":"b"' in e.value or b'"broker": "b"' in e.value for e in entries
                ), [e.value for e in entries]
            finally:
                await kv.close()
            assert "stale wal data of a deleted topic dropped" in a.log_text()
    finally:
        await asyncio.to_thread(a.stop)
        await asyncio.to_thread(b.stop)


async def test_delete_and_unload_refuse_bad_input_clearly(
    etcd_server: str, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    etcd = ("--etcd", etcd_server, "--prefix", etcd_prefix)
    for argv, expected in [
        (("topics", "delete", "no-slashes", *etcd), "invalid topic name 'no-slashes'"),
        (("topics", "unload", "/default/absent", *etcd), "topic /default/absent does not exist"),
        (("topics", "unload", "/a/b/c", *etcd), "invalid topic name '/a/b/c'"),
    ]:
        capsys.readouterr()
        assert await asyncio.to_thread(main, list(argv)) == 1, argv
        err = capsys.readouterr().err
        assert expected in err, err
    # Deleting what does not exist is no error (it finishes an interrupted deletion).
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["topics", "delete", "/default/absent", *etcd]) == 0
    assert "did not exist" in capsys.readouterr().out
