"""The SchemaStore contract. Every implementation is added to ``STORES``."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, MemoryKV
from danube_ingest.schema import MemorySchemaStore, SchemaStore
from danube_ingest.schema.kvstore import KVSchemaStore

STORES: dict[str, Callable[[], SchemaStore]] = {"memory": MemorySchemaStore}


@pytest.fixture(
    params=[*sorted(STORES), "kv-memory", pytest.param("kv-etcd", marks=pytest.mark.etcd)]
)
def any_store(request: pytest.FixtureRequest) -> SchemaStore:
    # "kv-*": the production store, on the metadata KV (in memory, and a real etcd).
    if request.param == "kv-memory":
        return KVSchemaStore(MemoryKV(), Keys(f"/t{uuid.uuid4().hex}"))
    if request.param == "kv-etcd":
        kv: KV = request.getfixturevalue("etcd_kv")
        return KVSchemaStore(kv, Keys(f"/t{uuid.uuid4().hex}"))
    return STORES[request.param]()


async def test_get_put_delete(any_store: SchemaStore) -> None:
    assert await any_store.get("a") is None
    await any_store.put("a", b"1")
    assert await any_store.get("a") == b"1"
    await any_store.put("a", b"2")
    assert await any_store.get("a") == b"2"
    await any_store.delete("a")
    assert await any_store.get("a") is None
    await any_store.delete("a")  # deleting a missing key is not an error


async def test_list_prefix_is_sorted_and_exact(any_store: SchemaStore) -> None:
    for key in ("topics/b", "topics/a", "topicsx", "subjects/a"):
        await any_store.put(key, key.encode())
    assert await any_store.list_prefix("topics/") == [
        ("topics/a", b"topics/a"),
        ("topics/b", b"topics/b"),
    ]
    assert await any_store.list_prefix("none/") == []


async def test_create_if_absent_only_creates(any_store: SchemaStore) -> None:
    assert await any_store.create_if_absent("k", b"first")
    assert not await any_store.create_if_absent("k", b"second")
    assert await any_store.get("k") == b"first"


async def test_compare_and_set(any_store: SchemaStore) -> None:
    assert not await any_store.compare_and_set("k", b"x", b"1")  # absent, expected a value
    assert await any_store.compare_and_set("k", None, b"1")  # absent, expected absent
    assert not await any_store.compare_and_set("k", None, b"2")
    assert not await any_store.compare_and_set("k", b"0", b"2")
    assert await any_store.compare_and_set("k", b"1", b"2")
    assert await any_store.get("k") == b"2"
