"""The fs object store on a really full disk (a small tmpfs): a PUT never fills it, and a write
that fails for want of space leaves no partial object behind to keep it full."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from danube_ingest.config import load_config
from danube_ingest.errors import ObjectStoreError
from danube_ingest.objects.store import ObjectStore, RetryPolicy
from danube_ingest.testing import small_filesystem

MiB = 1 << 20
NO_RETRY = RetryPolicy(max_retries=0)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_filesystem(tmp_path / "disk", 8 * MiB) as path:
        yield path


def files(root: Path) -> dict[str, int]:
    return {
        str(Path(d, f).relative_to(root)): os.path.getsize(Path(d, f))
        for d, _, names in os.walk(root)
        for f in names
    }


async def test_put_that_would_leave_less_than_the_floor_is_refused_before_writing(
    disk: Path,
) -> None:
    root = disk / "objects"
    store = ObjectStore("fs", options={"root": str(root)}, retry=NO_RETRY, min_free_bytes=2 * MiB)
    assert await store.put_if_absent("segments/b/r0/1.bin", b"a" * (3 * MiB))
    for put in (store.put_if_absent, store.put):
        with pytest.raises(ObjectStoreError) as refused:
            await put("segments/b/r0/2.bin", b"b" * (4 * MiB))
        assert refused.value.retriable
        message = str(refused.value)
        assert "segments/b/r0/2.bin" in message and "min_free_bytes" in message
    assert files(root) == {"segments/b/r0/1.bin": 3 * MiB}
    # Within the floor: written.
    assert await store.put_if_absent("segments/b/r0/2.bin", b"b" * MiB)


async def test_put_large_of_a_known_size_is_refused_like_a_put(disk: Path) -> None:
    root = disk / "objects"
    store = ObjectStore("fs", options={"root": str(root)}, retry=NO_RETRY, min_free_bytes=2 * MiB)
    await store.put("segments/b/r0/1.bin", b"a" * (3 * MiB))
    chunks = [b"b" * MiB] * 4
    with pytest.raises(ObjectStoreError) as refused:
        await store.put_large("segments/b/r0/2.bin", chunks, size=4 * MiB)
    assert refused.value.retriable
    assert "segments/b/r0/2.bin" in str(refused.value)
    assert "min_free_bytes" in str(refused.value)
    assert files(root) == {"segments/b/r0/1.bin": 3 * MiB}  # nothing staged, nothing written
    assert await store.put_large("segments/b/r0/2.bin", [b"b" * MiB], size=MiB) == MiB


async def test_write_failing_with_enospc_leaves_no_partial_object(disk: Path) -> None:
    root = disk / "objects"
    store = ObjectStore("fs", options={"root": str(root)}, retry=NO_RETRY)
    await store.put("segments/b/r0/1.bin", b"a" * (3 * MiB))
    for put in (store.put_if_absent, store.put):
        with pytest.raises(ObjectStoreError) as failed:
            await put("segments/b/r0/2.bin", os.urandom(6 * MiB))
        assert failed.value.retriable  # opendal's "temporary": the uploader retries
        assert files(root) == {"segments/b/r0/1.bin": 3 * MiB}


async def test_fs_store_from_config_keeps_half_the_wal_floor(disk: Path) -> None:
    config = load_config(
        None,
        {
            "broker.data_dir": str(disk),
            "storage.cloud.backend": "fs",
            "storage.wal.retention.min_free_bytes": "8MiB",
            "storage.uploader.max_retries": 0,
        },
    )
    store = ObjectStore.from_config(config)
    with pytest.raises(ObjectStoreError, match="would leave less than 4194304"):
        await store.put("big.bin", b"x" * (5 * MiB))  # 8 MiB free: 3 MiB would be left
    await store.put("small.bin", b"x" * (3 * MiB))
