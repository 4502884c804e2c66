"""ObjectStore: one contract suite on memory, fs and s3 (moto), then retries, error
classification and configuration."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opendal import exceptions as od

from danube_ingest.config import UploaderConfig, load_config
from danube_ingest.errors import ConfigError, ObjectNotFoundError, ObjectStoreError
from danube_ingest.objects.store import (
    STAGING_PREFIX,
    ObjectStore,
    RetryPolicy,
    StoreStats,
    _is_retriable,
)
from danube_ingest.testing import MotoServer, free_port

MiB = 1 << 20
SECRET = "s3cr3t-Never-Print-Me"


class Boom(Exception):
    """The source of a put_large failing halfway."""


def failing_chunks(good: int, size: int = 1024) -> Iterator[bytes]:
    for index in range(good):
        yield bytes([index]) * size
    raise Boom("source failed")


async def async_chunks(chunks: list[bytes], *, fail: bool = False) -> AsyncIterator[bytes]:
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk
    if fail:
        raise Boom("source failed")


# --- contract: every backend -------------------------------------------------------------


async def test_put_get_overwrite_and_empty(object_store: ObjectStore) -> None:
    await object_store.put("segments/b1/0/1.bin", b"first")
    assert await object_store.get("segments/b1/0/1.bin") == b"first"
    await object_store.put("segments/b1/0/1.bin", b"second, longer")
    assert await object_store.get("segments/b1/0/1.bin") == b"second, longer"
    await object_store.put("empty", b"")
    assert await object_store.get("empty") == b""
    assert await object_store.size("empty") == 0


async def test_get_range(object_store: ObjectStore) -> None:
    await object_store.put("obj", b"0123456789")
    assert await object_store.get_range("obj", 2, 3) == b"234"
    assert await object_store.get_range("obj", 0, 10) == b"0123456789"
    assert await object_store.get_range("obj", 7, 3) == b"789"
    assert await object_store.get_range("obj", 4, 0) == b""


@pytest.mark.parametrize(("offset", "size"), [(8, 5), (10, 1), (20, 4)])
async def test_get_range_outside_object_is_fatal(
    object_store: ObjectStore, offset: int, size: int
) -> None:
    await object_store.put("obj", b"0123456789")
    with pytest.raises(ObjectStoreError) as info:
        await object_store.get_range("obj", offset, size)
    assert not info.value.retriable
    assert not isinstance(info.value, ObjectNotFoundError)
    assert "get_range obj" in str(info.value)
    assert object_store.stats.retries == 0


async def test_size(object_store: ObjectStore) -> None:
    await object_store.put("a/b", b"12345")
    assert await object_store.size("a/b") == 5
    assert await object_store.size("a/missing") is None
    assert await object_store.size("a") is None  # a "directory" on fs, nothing on s3


async def test_delete_is_idempotent(object_store: ObjectStore) -> None:
    await object_store.put("k", b"x")
    await object_store.delete("k")
    await object_store.delete("k")
    await object_store.delete("never/existed")
    assert await object_store.size("k") is None
    with pytest.raises(ObjectNotFoundError):
        await object_store.get("k")


async def test_concurrent_deletes_of_one_key_all_succeed(object_store: ObjectStore) -> None:
    # fs deletes by stat + unlink: a racing delete used to surface as ObjectNotFoundError.
    for round_ in range(20):
        key = f"race/{round_}"
        await object_store.put(key, b"x" * 1024)
        await asyncio.gather(*(object_store.delete(key) for _ in range(8)))
        assert await object_store.size(key) is None


async def test_list_is_recursive_sorted_and_files_only(object_store: ObjectStore) -> None:
    keys = ["z", "a/bb", "a/b/d/e", "a/b/c", "topics/ns/t/data-1.bin"]
    for key in keys:
        await object_store.put(key, key.encode())
    assert await object_store.list("") == sorted(keys)
    assert await object_store.list("a/") == ["a/b/c", "a/b/d/e", "a/bb"]
    assert await object_store.list("a/b/") == ["a/b/c", "a/b/d/e"]
    assert await object_store.list("a/b") == ["a/b/c", "a/b/d/e", "a/bb"]  # a string prefix
    assert await object_store.list("topics/ns/t/data-") == ["topics/ns/t/data-1.bin"]
    assert await object_store.list("missing/") == []
    assert await object_store.list("a/b/c/") == []


async def test_put_if_absent(object_store: ObjectStore) -> None:
    assert await object_store.put_if_absent("seg", b"one") is True
    assert await object_store.put_if_absent("seg", b"two") is False
    assert await object_store.get("seg") == b"one"
    assert object_store.stats.bytes_written == 3
    assert object_store.stats.failures == 0


async def test_put_if_absent_has_one_winner(object_store: ObjectStore) -> None:
    results = await asyncio.gather(
        *(object_store.put_if_absent("race", bytes([n]) * 100) for n in range(16))
    )
    assert sorted(results) == [False] * 15 + [True]
    winner = results.index(True)
    assert await object_store.get("race") == bytes([winner]) * 100


async def test_not_found(object_store: ObjectStore) -> None:
    for call in (object_store.get("nope/x"), object_store.get_range("nope/x", 0, 1)):
        with pytest.raises(ObjectNotFoundError) as info:
            await call
        assert info.value.key == "nope/x"
        assert not info.value.retriable
        assert object_store.description in str(info.value)
    assert object_store.stats.retries == 0
    assert object_store.stats.failures == 0


async def test_invalid_keys_rejected(object_store: ObjectStore) -> None:
    for key in ("", "/abs", "dir/"):
        with pytest.raises(ValueError):
            await object_store.put(key, b"x")


async def test_put_large_round_trip(object_store: ObjectStore) -> None:
    chunks = [bytes([n]) * 1000 for n in range(10)]
    assert await object_store.put_large("big/sync", iter(chunks)) == 10_000
    assert await object_store.put_large("big/async", async_chunks(chunks)) == 10_000
    assert await object_store.get("big/sync") == b"".join(chunks)
    assert await object_store.get("big/async") == b"".join(chunks)
    assert await object_store.put_large("big/empty", []) == 0
    assert await object_store.size("big/empty") == 0
    assert await object_store.list(STAGING_PREFIX) == []
    assert await object_store.list("") == ["big/async", "big/empty", "big/sync"]


async def test_put_large_over_5_mib(object_store: ObjectStore) -> None:
    chunks = [bytes([n]) * MiB for n in range(6)] + [b"tail"]
    size = await object_store.put_large("big/6mib", chunks, part_bytes=5 * MiB)
    assert size == 6 * MiB + 4
    assert await object_store.size("big/6mib") == size
    # Both sides of the part boundary, and the tail.
    assert await object_store.get_range("big/6mib", 5 * MiB - 2, 4) == b"\x04\x04\x05\x05"
    assert await object_store.get_range("big/6mib", 6 * MiB, 4) == b"tail"
    assert await object_store.list(STAGING_PREFIX) == []


@pytest.mark.parametrize("source", ["sync", "async"])
async def test_put_large_abort_leaves_nothing(object_store: ObjectStore, source: str) -> None:
    await object_store.put("kept", b"earlier version")
    for key in ("fresh", "kept"):
        chunks = (
            failing_chunks(good=3)
            if source == "sync"
            else async_chunks([b"x" * 1024] * 3, fail=True)
        )
        with pytest.raises(Boom):
            await object_store.put_large(key, chunks)
    assert await object_store.size("fresh") is None
    assert await object_store.get("kept") == b"earlier version"
    assert await object_store.list(STAGING_PREFIX) == []
    assert await object_store.list("") == ["kept"]


async def test_stats(object_store: ObjectStore) -> None:
    await object_store.put("a", b"12345")
    await object_store.put_if_absent("a", b"zz")
    await object_store.put_large("b", [b"123", b"4"])
    await object_store.get("a")
    await object_store.get_range("b", 1, 2)
    await object_store.size("a")
    await object_store.list("")
    await object_store.delete("a")
    with pytest.raises(ObjectNotFoundError):
        await object_store.get("a")
    with pytest.raises(ObjectStoreError):
        await object_store.get_range("b", 3, 10)
    assert object_store.stats == StoreStats(
        puts=3,
        gets=4,
        deletes=1,
        lists=1,
        stats=1,
        retries=0,
        bytes_written=9,
        bytes_read=7,
        failures=1,
    )


async def test_closed_store_refuses(object_store: ObjectStore) -> None:
    await object_store.close()
    await object_store.close()
    with pytest.raises(ObjectStoreError, match="closed"):
        await object_store.get("a")


# --- s3 specifics -----------------------------------------------------------------------


async def test_s3_put_large_is_a_multipart_upload(s3_server: MotoServer, s3_bucket: str) -> None:
    root = f"mp-{uuid.uuid4().hex[:8]}"
    store = ObjectStore("s3", options=s3_server.options(s3_bucket, root))
    await store.put_large("big", (bytes([n]) * MiB for n in range(11)), part_bytes=5 * MiB)
    assert await store.get("big") == b"".join(bytes([n]) * MiB for n in range(11))
    # moto logs every request; the staging object went up in 3 parts (5 + 5 + 1 MiB).
    staging = f"/{s3_bucket}/{root}/{STAGING_PREFIX}"
    requests = [line for line in s3_server.log_text().splitlines() if staging in line]
    assert sum("?uploads " in line for line in requests) == 1
    assert sum("partNumber=" in line for line in requests) == 3


# --- retries and classification ---------------------------------------------------------

TINY_RETRY = RetryPolicy(max_retries=3, base_delay=0.001, max_delay=0.004)


def unreachable_s3(retry: RetryPolicy = TINY_RETRY, **extra: str) -> ObjectStore:
    options = {
        "bucket": "nowhere",
        "endpoint": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "region": "us-east-1",
        "access_key_id": "AKIDTEST",
        "secret_access_key": SECRET,
        "disable_config_load": "true",
        "disable_ec2_metadata": "true",
        **extra,
    }
    return ObjectStore("s3", options=options, retry=retry)


async def test_unreachable_endpoint_is_retriable_after_retries() -> None:
    store = unreachable_s3()
    calls = [
        ("put", store.put("seg/1.bin", b"x")),
        ("put_if_absent", store.put_if_absent("seg/1.bin", b"x")),
        ("get", store.get("seg/1.bin")),
        ("size", store.size("seg/1.bin")),
        ("delete", store.delete("seg/1.bin")),
        ("list", store.list("seg/")),
    ]
    for number, (name, call) in enumerate(calls, start=1):
        with pytest.raises(ObjectStoreError) as info:
            await call
        error = info.value
        assert error.retriable
        assert not isinstance(error, ObjectNotFoundError)
        message = str(error)
        assert message.startswith(f"{name} seg/")
        assert store.description in message
        assert "after 4 attempts" in message
        assert "Connection refused" in message
        assert SECRET not in message
        assert "Backtrace" not in message
        assert store.stats.retries == 3 * number
        assert store.stats.failures == number


async def test_unreachable_put_large_fails_without_waiting_for_cleanup() -> None:
    store = unreachable_s3(RetryPolicy(max_retries=2, base_delay=0.2, max_delay=0.2))
    started = time.monotonic()
    with pytest.raises(ObjectStoreError) as info:
        await store.put_large("big", [b"x" * 100])
    assert info.value.retriable
    assert "put_large big" in str(info.value)
    # Writes are buffered until close, so the first request happens there and is not retried;
    # cleaning up the staging key is a single attempt, not another round of backoff.
    assert time.monotonic() - started < 0.3
    assert store.stats.failures == 1


async def test_stalled_endpoint_times_out_and_is_retriable() -> None:
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        store = ObjectStore(
            "s3",
            options={
                "bucket": "stalled",
                "endpoint": f"http://127.0.0.1:{port}",
                "region": "us-east-1",
                "access_key_id": "AKIDTEST",
                "secret_access_key": SECRET,
                "disable_config_load": "true",
                "disable_ec2_metadata": "true",
            },
            retry=RetryPolicy(max_retries=1, base_delay=0.001, max_delay=0.001),
            timeout=0.2,
        )
        with pytest.raises(ObjectStoreError, match="timeout") as info:
            await store.get("k")
    assert info.value.retriable
    assert store.stats.retries == 1


async def test_missing_bucket_is_fatal(s3_server: MotoServer) -> None:
    store = ObjectStore("s3", options=s3_server.options("no-such-bucket"), retry=TINY_RETRY)
    for call in (store.put("k", b"x"), store.get("k"), store.list("")):
        with pytest.raises(ObjectStoreError, match="NoSuchBucket") as info:
            await call
        assert not info.value.retriable
        assert not isinstance(info.value, ObjectNotFoundError)
    # HEAD answers a bare 404, indistinguishable from a missing key.
    assert await store.size("k") is None
    assert store.stats.retries == 0


@pytest.mark.s3
async def test_permission_denied_is_fatal() -> None:
    with MotoServer(auth=True) as server:
        store = ObjectStore("s3", options=server.options("any"), retry=TINY_RETRY)
        for call in (store.put("k", b"x"), store.get("k"), store.size("k")):
            with pytest.raises(ObjectStoreError, match="PermissionDenied") as info:
                await call
            assert not info.value.retriable
    assert store.stats.retries == 0


@pytest.mark.parametrize(
    ("error", "retriable"),
    [
        (od.Unexpected("Unexpected (temporary) at write => send http request"), True),
        (od.Unexpected("Unexpected (persistent) at write => retries exhausted"), True),
        (od.Unexpected("Unexpected (permanent) at  => reader got too little data"), False),
        (od.Error("Error (temporary) at read"), True),
        (od.RateLimited("RateLimited (temporary) at write => SlowDown"), True),
        (od.Conflict("Conflict (permanent) at write => OperationAborted"), True),
        (od.PermissionDenied("PermissionDenied (permanent) at write"), False),
        (od.ConfigInvalid("ConfigInvalid (permanent) at write => NoSuchBucket"), False),
        (od.Unsupported("Unsupported (permanent) at rename"), False),
        (od.IsADirectory("IsADirectory (permanent) at read"), False),
        (od.NotADirectory("NotADirectory (permanent) at list"), False),
        (od.AlreadyExists("AlreadyExists (permanent) at write"), False),
        (od.IsSameFile("IsSameFile (permanent) at copy"), False),
        (od.RangeNotSatisfied("RangeNotSatisfied (permanent) at read"), False),
        (od.ConditionNotMatch("ConditionNotMatch (permanent) at write"), False),
    ],
)
def test_classification(error: Exception, retriable: bool) -> None:
    assert _is_retriable(error) is retriable


def test_retry_delays_are_capped_equal_jitter() -> None:
    policy = RetryPolicy(max_retries=10, base_delay=0.1, max_delay=1.0)
    for retry, nominal in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (500, 1.0)]:
        delays = [policy.delay(retry) for _ in range(200)]
        assert all(nominal / 2 <= delay <= nominal for delay in delays)
        assert max(delays) - min(delays) > nominal / 10  # jittered


def test_retry_policy_from_config_and_validation() -> None:
    uploader = UploaderConfig(max_retries=3, retry_base_ms=50, retry_max_ms=2000)
    assert RetryPolicy.from_config(uploader) == RetryPolicy(3, 0.05, 2.0)
    for bad in (
        {"max_retries": -1},
        {"base_delay": 0.0},
        {"base_delay": 2.0, "max_delay": 1.0},
    ):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)  # type: ignore[arg-type]


# --- configuration ----------------------------------------------------------------------


async def test_from_config_fs_defaults_to_data_dir_objects(tmp_path: Path) -> None:
    config = load_config(None, {"broker.data_dir": str(tmp_path)})
    store = ObjectStore.from_config(config)
    assert store.scheme == "fs"
    assert store.description == f"fs://{tmp_path / 'objects'}"
    await store.put("segments/b1/0/1.bin", b"data")
    assert (tmp_path / "objects" / "segments" / "b1" / "0" / "1.bin").read_bytes() == b"data"


async def test_from_config_memory(tmp_path: Path) -> None:
    config = load_config(None, {"storage.cloud.backend": "memory"})
    store = ObjectStore.from_config(config)
    assert store.description == "memory://"
    await store.put("k", b"v")
    assert await store.list("") == ["k"]
    assert not list(tmp_path.iterdir())


async def test_from_config_s3(s3_server: MotoServer, s3_bucket: str) -> None:
    config = load_config(
        None,
        {
            "storage.cloud.backend": "s3",
            "storage.cloud.bucket": s3_bucket,
            "storage.cloud.root": "configured",
            "storage.cloud.endpoint": s3_server.endpoint,
            "storage.cloud.region": s3_server.region,
            "storage.cloud.access_key_id": s3_server.access_key_id,
            "storage.cloud.secret_access_key": SECRET,
        },
    )
    store = ObjectStore.from_config(config)
    description = f"s3://{s3_bucket}/configured (endpoint {s3_server.endpoint})"
    assert store.description == description
    assert repr(store) == f"ObjectStore({description})"
    await store.put("from-config", b"ok")
    direct = ObjectStore("s3", options=s3_server.options(s3_bucket, "configured"))
    assert await direct.get("from-config") == b"ok"


async def test_from_config_s3_secret_never_shown_and_retries_from_uploader() -> None:
    config = load_config(
        None,
        {
            "storage.cloud.backend": "s3",
            "storage.cloud.bucket": "b",
            "storage.cloud.endpoint": f"http://127.0.0.1:{free_port()}",
            "storage.cloud.region": "us-east-1",
            "storage.cloud.access_key_id": "AKIDTEST",
            "storage.cloud.secret_access_key": SECRET,
            "storage.uploader.max_retries": 0,
        },
    )
    store = ObjectStore.from_config(config)
    with pytest.raises(ObjectStoreError) as info:
        await store.put("k", b"x")
    assert info.value.retriable
    assert store.stats.retries == 0
    for text in (store.description, repr(store), str(info.value)):
        assert SECRET not in text


def test_from_config_s3_needs_both_keys() -> None:
    config = load_config(
        None,
        {
            "storage.cloud.backend": "s3",
            "storage.cloud.bucket": "b",
            "storage.cloud.region": "us-east-1",
            "storage.cloud.access_key_id": "AKIDTEST",
        },
    )
    with pytest.raises(ConfigError, match="secret_access_key"):
        ObjectStore.from_config(config)


def test_description_drops_endpoint_credentials() -> None:
    store = ObjectStore(
        "s3",
        options={
            "bucket": "b",
            "root": "/r/",
            "region": "us-east-1",
            "endpoint": f"http://user:{SECRET}@127.0.0.1:9000",
        },
    )
    assert store.description == "s3://b/r (endpoint http://127.0.0.1:9000)"


def test_invalid_options_are_a_fatal_error() -> None:
    with pytest.raises(ObjectStoreError, match="region is missing") as info:
        ObjectStore("s3", options={"bucket": "b", "secret_access_key": SECRET})
    assert not info.value.retriable
    assert "s3://b" in str(info.value)


async def test_gcs_from_config_reaches_its_endpoint() -> None:
    # No GCS server runs here (gcp-storage-emulator ignores if_not_exists and answers 501 to
    # multipart uploads): this shows the configuration reaches opendal's gcs backend (bucket,
    # root, endpoint, options) and that an unreachable endpoint is a retriable error.
    port = free_port()
    config = load_config(
        None,
        {
            "storage.cloud.backend": "gcs",
            "storage.cloud.bucket": "b1",
            "storage.cloud.root": "danube",
            "storage.cloud.endpoint": f"http://127.0.0.1:{port}",
            "storage.cloud.options": {
                "allow_anonymous": "true",
                "disable_vm_metadata": "true",
                "disable_config_load": "true",
            },
            "storage.uploader.max_retries": 1,
            "storage.uploader.retry_base_ms": 10,
        },
    )
    store = ObjectStore.from_config(config)
    try:
        assert store.scheme == "gcs"
        assert store.description == f"gcs://b1/danube (endpoint http://127.0.0.1:{port})"
        with pytest.raises(ObjectStoreError) as info:
            await store.put("x/y.bin", b"1")
        assert info.value.retriable
        assert "Connection refused" in str(info.value)
        assert store.stats.retries == 1
    finally:
        await store.close()
