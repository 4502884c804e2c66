"""The cluster id: created once in the object store and etcd, and a broker whose store is not
the cluster's refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from danube_ingest.metadata import KV, Keys
from danube_ingest.objects.cluster import MARKER_KEY, ClusterIdMismatchError, check_cluster_id
from danube_ingest.objects.store import ObjectStore


def _fs(root: Path) -> ObjectStore:
    return ObjectStore("fs", options={"root": str(root)})


async def test_the_first_broker_creates_the_id_and_the_others_agree(
    kv: KV, keys: Keys, tmp_path: Path
) -> None:
    store = _fs(tmp_path / "objects")
    cluster = await check_cluster_id(kv, keys, store)
    assert cluster
    stored = await kv.get(keys.cluster_id())
    assert stored is not None and stored.value.decode() == cluster
    assert (await store.get(MARKER_KEY)).decode() == cluster
    assert await check_cluster_id(kv, keys, _fs(tmp_path / "objects")) == cluster


async def test_a_broker_on_another_store_is_refused_naming_both_ids(
    kv: KV, keys: Keys, tmp_path: Path
) -> None:
    cluster = await check_cluster_id(kv, keys, _fs(tmp_path / "objects"))
    empty = _fs(tmp_path / "other")
    with pytest.raises(ClusterIdMismatchError, match=f"cluster {cluster}.*says \\(none\\)"):
        await check_cluster_id(kv, keys, empty)
    assert await empty.size(MARKER_KEY) is None  # nothing written
    foreign = _fs(tmp_path / "foreign")
    await foreign.put(MARKER_KEY, b"0123abcd")
    with pytest.raises(ClusterIdMismatchError, match=f"cluster {cluster}.*says 0123abcd"):
        await check_cluster_id(kv, keys, foreign)
    assert not ClusterIdMismatchError.retriable


async def test_a_crash_between_the_marker_and_etcd_is_finished_by_the_next_start(
    kv: KV, keys: Keys, tmp_path: Path
) -> None:
    store = _fs(tmp_path / "objects")
    await store.put(MARKER_KEY, b"feedface")  # the marker came first, then the crash
    assert await kv.get(keys.cluster_id()) is None
    assert await check_cluster_id(kv, keys, store) == "feedface"
    stored = await kv.get(keys.cluster_id())
    assert stored is not None and stored.value == b"feedface"


async def test_the_memory_backend_is_not_checked(kv: KV, keys: Keys) -> None:
    assert await check_cluster_id(kv, keys, ObjectStore.memory()) is None
    assert await kv.get(keys.cluster_id()) is None
