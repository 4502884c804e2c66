"""Ownership.fenced_many: one transaction fenced by the ownership of several topics."""

from __future__ import annotations

import pytest

from danube_ingest.metadata import KV, Compare, FencedError, Get, Keys, Put

from .conftest import Broker

X, Y, Z = "/default/x", "/default/y", "/other/z"


def puts(keys: Keys, *topics: str, value: bytes = b"v") -> list[Put]:
    return [Put(keys.storage_object(t, 0), value) for t in topics]


async def stored(kv: KV, keys: Keys, *topics: str) -> list[bytes | None]:
    found = [await kv.get(keys.storage_object(t, 0)) for t in topics]
    return [None if f is None else f.value for f in found]


async def test_writes_in_one_transaction_while_every_topic_is_owned(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    for topic in (X, Y, Z):
        await a.ownership.acquire(topic)
    result = await a.ownership.fenced_many([X, Y, Z, X], puts(keys, X, Y, Z))
    assert result.succeeded and result.fenced == ()
    written = [await kv.get(keys.storage_object(t, 0)) for t in (X, Y, Z)]
    assert len({w.mod_revision for w in written if w is not None}) == 1  # one transaction


async def test_a_topic_not_held_fences_the_call_without_a_transaction(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    await a.ownership.acquire(X)
    await b.ownership.acquire(Y)
    result = await a.ownership.fenced_many([X, Y, Z], puts(keys, X, Y, Z))
    assert (result.succeeded, result.fenced, result.responses) == (False, (Y, Z), ())
    assert await stored(kv, keys, X, Y, Z) == [None, None, None]
    assert a.lost == [] and a.ownership.is_owner(X)


async def test_a_lost_topic_fails_the_transaction_and_is_reported_once(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    await a.ownership.acquire(X)
    await a.ownership.acquire(Y)
    # X is handed over behind a's back: its owner key deleted, b takes it with epoch 2.
    await kv.delete(keys.topic_owner(X))
    assert (await b.ownership.acquire(X)).epoch == 2
    key = keys.storage_object(Y, 0)
    result = await a.ownership.fenced_many(
        [X, Y], puts(keys, X, Y), failure=[Get(key), Get(keys.topic_owner(X))]
    )
    assert not result.succeeded and result.fenced == (X,)
    assert await stored(kv, keys, X, Y) == [None, None]
    assert a.lost == [X] and a.ownership.is_owner(Y)
    # Whether or not the watch saw the handover first, X is fenced and reported once.
    if result.responses:
        assert result.kv(0) is None
        owner = result.kv(1)
        assert owner is not None and b'epoch": 2' in owner.value
    with pytest.raises(FencedError):
        await a.ownership.fenced(X, puts(keys, X))
    assert a.lost == [X]


async def test_a_failing_user_compare_is_not_a_loss(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await a.ownership.acquire(X)
    await a.ownership.acquire(Y)
    taken = keys.storage_object(Y, 0)
    await kv.put(taken, b"already")
    result = await a.ownership.fenced_many(
        [X, Y], puts(keys, X, Y), compares=[Compare.absent(taken)], failure=[Get(taken)]
    )
    assert not result.succeeded and result.fenced == ()
    found = result.kv(0)
    assert found is not None and found.value == b"already"
    assert len(result.responses) == 1  # the owner Gets are not handed back
    assert await stored(kv, keys, X, Y) == [None, b"already"]
    assert a.lost == []


async def test_everything_is_fenced_once_the_session_is_gone(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, _ = brokers
    await a.ownership.acquire(X)
    lease = a.session.lease_id
    assert lease is not None
    await kv.revoke_lease(lease)
    result = await a.ownership.fenced_many([X], puts(keys, X))
    assert not result.succeeded and result.fenced == (X,)
    assert await stored(kv, keys, X) == [None]
