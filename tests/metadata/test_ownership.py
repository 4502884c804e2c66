"""Ownership: acquisition with epochs, takeover, loss reporting, and fencing (split brain)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from danube_ingest.metadata import (
    KV,
    Compare,
    EtcdKV,
    FencedError,
    Get,
    Keys,
    LeaseExpiredError,
    Owner,
    Put,
)

from .conftest import Broker, eventually

T = TypeVar("T")
TOPIC = "/default/orders"


async def test_first_acquirer_owns_the_other_is_redirected(
    brokers: tuple[Broker, Broker], kv: KV, keys: Keys
) -> None:
    a, b = brokers
    owner = await a.ownership.acquire(TOPIC)
    assert owner == Owner("a", "http://a:6650", 1)
    assert a.ownership.is_owner(TOPIC) and a.ownership.owned(TOPIC) == owner
    assert await a.ownership.acquire(TOPIC) == owner  # idempotent for the owner
    assert await b.ownership.acquire(TOPIC) == owner  # b is told who owns it
    assert not b.ownership.is_owner(TOPIC)
    assert await b.ownership.owner_of(TOPIC) == owner
    stored = await kv.get(keys.topic_owner(TOPIC))
    assert stored is not None and stored.lease == a.session.lease_id
    epoch = await kv.get(keys.topic_epoch(TOPIC))
    assert epoch is not None and epoch.value == b"1" and epoch.lease is None


async def test_concurrent_acquisitions_elect_exactly_one_owner(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    results = await asyncio.gather(
        *(broker.ownership.acquire(f"/default/t{i}") for i in range(5) for broker in (a, b))
    )
    for i in range(5):
        pair = results[2 * i : 2 * i + 2]
        assert pair[0] == pair[1] and pair[0].epoch == 1
        owners = [x.ownership.is_owner(f"/default/t{i}") for x in (a, b)]
        assert owners.count(True) == 1


async def test_release_lets_another_broker_take_over_with_the_next_epoch(
    brokers: tuple[Broker, Broker],
) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    await a.ownership.release(TOPIC)
    await a.ownership.release(TOPIC)
    assert not a.ownership.is_owner(TOPIC)
    assert await b.ownership.acquire(TOPIC) == Owner("b", "http://b:6650", 2)
    assert a.lost == []  # a gave it up; it did not lose it


async def test_revoked_lease_hands_the_topic_over_and_reports_the_loss(
    brokers: tuple[Broker, Broker], kv: KV
) -> None:
    a, b = brokers
    assert (await a.ownership.acquire(TOPIC)).epoch == 1
    lease = a.session.lease_id
    assert lease is not None
    await kv.revoke_lease(lease)
    taken = await b.ownership.acquire(TOPIC)
    assert taken == Owner("b", "http://b:6650", 2)
    await eventually(lambda: a.lost == [TOPIC])  # seen by a's watch
    assert not a.ownership.is_owner(TOPIC)
    with pytest.raises(FencedError):
        await a.ownership.fenced(TOPIC, [Put("/anything", b"x")])


async def test_fenced_writes_and_user_compares(brokers: tuple[Broker, Broker], keys: Keys) -> None:
    a, b = brokers
    await a.ownership.acquire(TOPIC)
    key = keys.storage_object(TOPIC, 0)
    done = await a.ownership.fenced(TOPIC, [Put(key, b"v1"), Get(key)])
    assert done.succeeded and done.kv(1) is not None
    # A user compare that fails is a plain CAS failure, not a loss of ownership.
    conflict = await a.ownership.fenced(
        TOPIC, [Put(key, b"v2")], compares=[Compare.absent(key)], failure=[Get(key)]
    )
    assert not conflict.succeeded
    current = conflict.kv(0)
    assert current is not None and current.value == b"v1"
    assert a.ownership.is_owner(TOPIC) and a.lost == []
    with pytest.raises(FencedError, match="does not own"):
        await b.ownership.fenced(TOPIC, [Put(key, b"from-b")])


async def test_session_loss_loses_every_topic(brokers: tuple[Broker, Broker], kv: KV) -> None:
    a, _ = brokers
    await a.ownership.acquire("/default/x")
    await a.ownership.acquire("/default/y")
    assert a.ownership.owned_topics() == ["/default/x", "/default/y"]
    lease = a.session.lease_id
    assert lease is not None
    await kv.revoke_lease(lease)
    await eventually(lambda: sorted(a.lost) == ["/default/x", "/default/y"])
    assert a.ownership.owned_topics() == []


async def test_acquire_needs_a_live_session(kv: KV, keys: Keys) -> None:
    broker = Broker(kv, keys, "idle")
    with pytest.raises(LeaseExpiredError):
        await broker.ownership.acquire(TOPIC)


class OtherProcess:
    """Another broker process: its own event loop on a thread.

    ``run`` blocks the calling (test) event loop until the coroutine is done, so the test's
    broker is frozen meanwhile, like a process in a long GC pause: it sees nothing happen.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.mark.etcd
async def test_split_brain_stale_owner_cannot_write(etcd_server: str, keys: Keys) -> None:
    """The split-brain guard: an owner that missed its takeover is rejected by etcd itself.

    Broker a owns the topic and then freezes. Meanwhile its lease is revoked (as etcd would
    expire it) and broker b takes the topic over with epoch 2 and writes a manifest entry.
    When a resumes it still believes it is the owner (it saw nothing), so only the fenced
    transaction's compare stands between its stale write and b's data.
    """
    manifest_key = keys.storage_object(TOPIC, 0)
    kv_a = await EtcdKV.connect([etcd_server], timeout=5)
    a = await Broker(kv_a, keys, "a", ttl=10).start()
    assert (await a.ownership.acquire(TOPIC)).epoch == 1
    await a.ownership.fenced(TOPIC, [Put(manifest_key, b"a@1")])
    a_lease = a.session.lease_id
    assert a_lease is not None

    other = OtherProcess()

    async def b_takes_over() -> tuple[Broker, Owner]:
        kv_b = await EtcdKV.connect([etcd_server], timeout=5)
        await kv_b.revoke_lease(a_lease)
        b = await Broker(kv_b, keys, "b").start()
        owner = await b.ownership.acquire(TOPIC)
        await b.ownership.fenced(TOPIC, [Put(manifest_key, b"b@2")])
        return b, owner

    async def b_closes(b: Broker) -> None:
        await b.close()
        await b.session.kv.close()

    try:
        b, b_owner = other.run(b_takes_over())  # a is frozen during this call
        assert b_owner == Owner("b", "http://b:6650", 2)

        # a resumes with a stale view: it still thinks it owns the topic at epoch 1.
        assert a.ownership.is_owner(TOPIC)
        with pytest.raises(FencedError, match="lost ownership") as rejected:
            await a.ownership.fenced(TOPIC, [Put(manifest_key, b"a@1 stale")])
        assert rejected.value.topic == TOPIC
        assert a.lost == [TOPIC]
        assert not a.ownership.is_owner(TOPIC)
        stored = await kv_a.get(manifest_key)
        assert stored is not None and stored.value == b"b@2"
        other.run(b_closes(b))
    finally:
        other.stop()
        await a.close()
        await kv_a.close()


@pytest.mark.etcd
async def test_partitioned_owner_expires_and_steps_down(etcd_server: str, keys: Keys) -> None:
    """An owner cut off from etcd loses its lease after the TTL; another broker takes over."""
    kv_a = await EtcdKV.connect([etcd_server], timeout=0.5)
    kv_b = await EtcdKV.connect([etcd_server], timeout=5)
    a = await Broker(kv_a, keys, "a", ttl=1).start()
    b = await Broker(kv_b, keys, "b").start()
    try:
        assert (await a.ownership.acquire(TOPIC)).epoch == 1
        await kv_a.close()  # a's connection is gone: no keepalive, no watch
        started = time.monotonic()
        while (owner := await b.ownership.acquire(TOPIC)).broker_id != "b":
            assert time.monotonic() - started < 5, "a's lease never expired"
            await asyncio.sleep(0.05)
        assert owner.epoch == 2
        await eventually(lambda: a.lost == [TOPIC])  # a noticed on its own, without etcd
        assert not a.ownership.is_owner(TOPIC)
        assert not a.session.alive
    finally:
        await a.close()
        await b.close()
        await kv_b.close()
