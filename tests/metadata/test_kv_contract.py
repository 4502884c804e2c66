"""The KV contract: every test runs on MemoryKV and on a real etcd (EtcdKV)."""

from __future__ import annotations

import asyncio
import re

import pytest

from danube_ingest.metadata import (
    KV,
    Compare,
    Delete,
    Get,
    Keys,
    LeaseExpiredError,
    MemoryKV,
    MetadataError,
    Put,
    RevisionCompactedError,
    WatchEvent,
    WatchStream,
)
from danube_ingest.metadata.etcd import EtcdKV


@pytest.fixture
def p(keys: Keys) -> str:
    """A fresh key prefix for this test."""
    return f"{keys.prefix}/"


async def next_event(stream: WatchStream) -> WatchEvent:
    return await asyncio.wait_for(anext(stream), 5)


async def wait_gone(kv: KV, key: str, timeout: float = 5.0) -> float:
    """Seconds until ``key`` disappears."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while await kv.get(key) is not None:
        assert loop.time() - start < timeout, f"{key} still there after {timeout}s"
        await asyncio.sleep(0.05)
    return loop.time() - start


async def test_put_get_revisions_and_versions(kv: KV, p: str) -> None:
    assert await kv.get(f"{p}a") is None
    rev1 = await kv.put(f"{p}a", b"one")
    first = await kv.get(f"{p}a")
    assert first is not None
    assert (first.key, first.value, first.version, first.lease) == (f"{p}a", b"one", 1, None)
    assert first.create_revision == first.mod_revision == rev1
    rev2 = await kv.put(f"{p}a", b"two")
    second = await kv.get(f"{p}a")
    assert second is not None
    assert rev2 > rev1
    assert (second.value, second.version) == (b"two", 2)
    assert (second.create_revision, second.mod_revision) == (rev1, rev2)


async def test_get_prefix_is_sorted_and_scoped(kv: KV, p: str) -> None:
    for key in ("x/2", "x/1", "xy", "y"):
        await kv.put(f"{p}{key}", key.encode())
    found = await kv.get_prefix(f"{p}x/")
    assert [k.key for k in found] == [f"{p}x/1", f"{p}x/2"]
    assert [k.key for k in await kv.get_prefix(f"{p}x")] == [f"{p}x/1", f"{p}x/2", f"{p}xy"]
    assert await kv.get_prefix(f"{p}nothing/") == []


async def test_delete_single_and_prefix(kv: KV, p: str) -> None:
    for key in ("d/1", "d/2", "d/3", "e"):
        await kv.put(f"{p}{key}", b"v")
    assert await kv.delete(f"{p}missing") == 0
    assert await kv.delete(f"{p}e") == 1
    assert await kv.get(f"{p}e") is None
    assert await kv.delete(f"{p}d/", prefix=True) == 3
    assert await kv.get_prefix(p) == []
    await kv.put(f"{p}e", b"again")
    recreated = await kv.get(f"{p}e")
    assert recreated is not None and recreated.version == 1


async def test_txn_success_and_failure_branches(kv: KV, p: str) -> None:
    key = f"{p}k"
    ops = ([Compare.absent(key)], [Put(key, b"first")], [Get(key)])
    created = await kv.txn(*ops)
    assert created.succeeded
    assert created.responses[0].kvs == ()
    conflict = await kv.txn([Compare.absent(key)], [Put(key, b"second")], [Get(key)])
    assert not conflict.succeeded
    existing = conflict.kv(0)
    assert existing is not None and existing.value == b"first"
    stored = await kv.get(key)
    assert stored is not None and stored.value == b"first"


async def test_txn_is_atomic_one_revision_and_reads_its_own_writes(kv: KV, p: str) -> None:
    await kv.put(f"{p}gone", b"x")
    result = await kv.txn(
        [],
        [Put(f"{p}a", b"1"), Put(f"{p}b", b"2"), Delete(f"{p}gone"), Get(f"{p}", prefix=True)],
    )
    assert result.succeeded
    assert result.responses[2].deleted == 1
    seen = result.responses[3].kvs
    assert [k.key for k in seen] == [f"{p}a", f"{p}b"]
    assert seen[0].mod_revision == seen[1].mod_revision


async def test_compare_targets_and_operators(kv: KV, p: str) -> None:
    key = f"{p}c"
    await kv.put(key, b"m")
    await kv.put(key, b"m")  # version 2
    current = await kv.get(key)
    assert current is not None

    async def holds(compare: Compare) -> bool:
        return (await kv.txn([compare], [])).succeeded

    assert await holds(Compare(key, "value", "==", b"m"))
    assert await holds(Compare(key, "value", "!=", b"z"))
    assert await holds(Compare(key, "value", "<", b"n"))
    assert await holds(Compare(key, "value", ">", b"a"))
    assert not await holds(Compare(key, "value", ">", b"z"))
    assert await holds(Compare(key, "version", "==", 2))
    assert await holds(Compare(key, "version", ">", 1))
    assert await holds(Compare(key, "create", "==", current.create_revision))
    assert await holds(Compare(key, "create", "<", current.mod_revision))
    assert await holds(Compare(key, "mod", "==", current.mod_revision))
    assert await holds(Compare.unchanged(key, current))
    assert not await holds(Compare.absent(key))
    assert not await holds(Compare(key, "mod", "!=", current.mod_revision))
    # Absent keys: revisions and version are 0, and a value compare never holds.
    missing = f"{p}missing"
    assert await holds(Compare.absent(missing))
    assert await holds(Compare.unchanged(missing, None))
    assert await holds(Compare(missing, "version", "==", 0))
    assert not await holds(Compare(missing, "value", "!=", b"anything"))
    assert not await holds(Compare(missing, "value", "==", b""))
    # All compares must hold.
    assert not await holds_all(kv, [Compare.absent(missing), Compare.absent(key)])


async def holds_all(kv: KV, compares: list[Compare]) -> bool:
    return (await kv.txn(compares, [])).succeeded


async def test_txn_rejects_writing_a_key_twice(kv: KV, p: str) -> None:
    with pytest.raises(MetadataError):
        await kv.txn([], [Put(f"{p}a", b"1"), Put(f"{p}a", b"2")])
    assert await kv.get(f"{p}a") is None


async def test_lease_expiry_removes_keys_and_refresh_keeps_them(kv: KV, p: str) -> None:
    kept = await kv.grant_lease(1)
    dying = await kv.grant_lease(1)
    await kv.put(f"{p}kept", b"v", lease=kept)
    await kv.put(f"{p}dying", b"v", lease=dying)
    await kv.put(f"{p}plain", b"v")
    stored = await kv.get(f"{p}kept")
    assert stored is not None and stored.lease == kept
    assert await kv.refresh_lease(kept) >= 1

    async def keep_refreshing() -> None:
        while True:
            await asyncio.sleep(0.25)
            await kv.refresh_lease(kept)

    refresher = asyncio.create_task(keep_refreshing())
    try:
        waited = await wait_gone(kv, f"{p}dying")
    finally:
        refresher.cancel()
    assert 0.8 <= waited <= 3.0
    assert await kv.get(f"{p}kept") is not None
    assert await kv.get(f"{p}plain") is not None
    with pytest.raises(LeaseExpiredError):
        await kv.refresh_lease(dying)
    with pytest.raises(LeaseExpiredError):
        await kv.put(f"{p}late", b"v", lease=dying)
    with pytest.raises(LeaseExpiredError):
        await kv.txn([], [Put(f"{p}late", b"v", dying)])
    assert await kv.get(f"{p}late") is None
    await kv.revoke_lease(kept)


async def test_revoke_deletes_keys_at_once_and_is_idempotent(kv: KV, p: str) -> None:
    lease = await kv.grant_lease(30)
    await kv.put(f"{p}a", b"1", lease=lease)
    await kv.put(f"{p}b", b"2", lease=lease)
    await kv.revoke_lease(lease)
    assert await kv.get_prefix(p) == []
    await kv.revoke_lease(lease)
    with pytest.raises(LeaseExpiredError):
        await kv.refresh_lease(lease)


async def test_put_without_lease_detaches_key_from_its_lease(kv: KV, p: str) -> None:
    lease = await kv.grant_lease(30)
    await kv.put(f"{p}a", b"1", lease=lease)
    await kv.put(f"{p}a", b"2")
    await kv.revoke_lease(lease)
    stored = await kv.get(f"{p}a")
    assert stored is not None and stored.value == b"2" and stored.lease is None


async def test_watch_sees_puts_and_deletes_in_order(kv: KV, p: str) -> None:
    async with await kv.watch_prefix(f"{p}w/") as stream:
        await kv.put(f"{p}w/a", b"1")
        await kv.put(f"{p}other", b"not watched")
        await kv.put(f"{p}w/a", b"2")
        await kv.txn([], [Put(f"{p}w/b", b"3"), Put(f"{p}w/c", b"4")])
        await kv.delete(f"{p}w/a")
        lease = await kv.grant_lease(30)
        await kv.put(f"{p}w/leased", b"5", lease=lease)
        await kv.revoke_lease(lease)
        events = [await next_event(stream) for _ in range(7)]
    summary = [(e.kind, e.kv.key.removeprefix(f"{p}w/"), e.kv.value) for e in events]
    assert summary == [
        ("put", "a", b"1"),
        ("put", "a", b"2"),
        ("put", "b", b"3"),
        ("put", "c", b"4"),
        ("delete", "a", b""),
        ("put", "leased", b"5"),
        ("delete", "leased", b""),
    ]
    revisions = [e.kv.mod_revision for e in events]
    assert revisions == sorted(revisions)
    assert revisions[2] == revisions[3]  # one transaction, one revision
    assert events[1].kv.version == 2


async def test_watch_from_a_revision_replays_history(kv: KV, p: str) -> None:
    first = await kv.put(f"{p}h/a", b"1")
    await kv.put(f"{p}h/a", b"2")
    await kv.delete(f"{p}h/a")
    stream = await kv.watch_prefix(f"{p}h/", start_revision=first)
    events = [await next_event(stream) for _ in range(3)]
    assert [(e.kind, e.kv.value) for e in events] == [("put", b"1"), ("put", b"2"), ("delete", b"")]
    await stream.cancel()


async def test_compact_drops_history_before_the_revision_only(kv: KV, p: str) -> None:
    first = await kv.put(f"{p}k/a", b"1")
    second = await kv.put(f"{p}k/a", b"2")
    await kv.compact(second)
    with pytest.raises(RevisionCompactedError):  # etcd says so on the first event
        await next_event(await kv.watch_prefix(f"{p}k/", start_revision=first))
    stream = await kv.watch_prefix(f"{p}k/", start_revision=second)
    assert (await next_event(stream)).kv.value == b"2"
    await stream.cancel()
    found = await kv.get(f"{p}k/a")
    assert found is not None and found.value == b"2"
    with pytest.raises(RevisionCompactedError):
        await kv.compact(second)  # already compacted there
    with pytest.raises(MetadataError) as future:
        await kv.compact(second + 1000)
    assert not isinstance(future.value, RevisionCompactedError)


async def test_db_size_is_known_for_etcd_only(kv: KV) -> None:
    size = await kv.db_size()
    assert size is None if isinstance(kv, MemoryKV) else size is not None and size > 0


async def test_identity_is_the_store_not_the_connection(kv: KV, p: str) -> None:
    identity = await kv.identity(f"{p}absent")
    if isinstance(kv, MemoryKV):
        assert identity == "memory"
        return
    assert re.fullmatch(r"etcd cluster [0-9a-f]{16}", identity), identity
    await kv.put(f"{p}present", b"x")
    assert await kv.identity(f"{p}present") == identity
    assert isinstance(kv, EtcdKV)
    other = await EtcdKV.connect([kv.endpoint], timeout=5.0)  # a second connection: same store
    try:
        assert await other.identity(f"{p}absent") == identity
    finally:
        await other.close()


async def test_cancelled_watch_ends_iteration(kv: KV, p: str) -> None:
    stream = await kv.watch_prefix(f"{p}c/")
    await stream.cancel()
    await stream.cancel()
    assert [e async for e in stream] == []


async def test_memory_watch_history_is_bounded() -> None:
    kv = MemoryKV(history=2)
    first = await kv.put("/a", b"1")
    await kv.put("/a", b"2")
    await kv.put("/a", b"3")
    with pytest.raises(RevisionCompactedError):
        await kv.watch_prefix("/", start_revision=first)
    stream = await kv.watch_prefix("/", start_revision=first + 1)
    assert (await next_event(stream)).kv.value == b"2"
    await kv.close()
    with pytest.raises(MetadataError):
        await kv.get("/a")
