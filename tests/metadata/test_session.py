"""BrokerSession: registration under a lease, keepalive, loss and re-registration."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from danube_ingest.metadata import KV, BrokerIdConflictError, BrokerSession, Keys
from danube_ingest.testing import LocalEtcd

from .conftest import eventually, frozen


async def test_registers_under_a_lease_and_close_revokes_it(kv: KV, keys: Keys) -> None:
    session = BrokerSession(kv, keys, "b1", "http://10.0.0.1:6650", ttl=5, regions=3)
    lost: list[str] = []
    session.on_lost(lambda: lost.append("lost"))
    await session.start()
    assert session.alive
    stored = await kv.get(keys.broker("b1"))
    assert stored is not None and stored.lease == session.lease_id
    value = json.loads(stored.value)
    assert value["url"] == "http://10.0.0.1:6650"
    assert value["regions"] == 3  # for the control plane's topic -> region rule
    assert abs(value["started_ms"] - time.time() * 1000) < 60_000
    await session.close()
    await session.close()
    assert not session.alive
    assert await kv.get(keys.broker("b1")) is None
    assert lost == []


async def test_duplicate_broker_id_is_refused(kv: KV, keys: Keys) -> None:
    async with BrokerSession(kv, keys, "b1", "http://first:6650", ttl=5):
        second = BrokerSession(kv, keys, "b1", "http://second:6650", ttl=5)
        with pytest.raises(BrokerIdConflictError, match="http://first:6650"):
            await second.start()
        stored = await kv.get(keys.broker("b1"))
        assert stored is not None and b"first" in stored.value
    # Once the first broker is gone, the id is free again.
    async with BrokerSession(kv, keys, "b1", "http://third:6650", ttl=5) as third:
        assert third.alive


async def test_keepalive_outlives_the_ttl(kv: KV, keys: Keys) -> None:
    async with BrokerSession(kv, keys, "b1", "http://b1:6650", ttl=1) as session:
        await asyncio.sleep(1.6)
        assert session.alive
        assert await kv.get(keys.broker("b1")) is not None


async def test_lost_lease_is_reported_and_the_session_registers_again(kv: KV, keys: Keys) -> None:
    async with BrokerSession(kv, keys, "b1", "http://b1:6650", ttl=1) as session:
        lost: list[int | None] = []
        session.on_lost(lambda: lost.append(session.lease_id))
        first_lease = session.lease_id
        assert first_lease is not None
        await kv.revoke_lease(first_lease)  # e.g. an operator, or etcd expiring it
        await eventually(lambda: bool(lost))
        assert lost == [first_lease]
        await eventually(lambda: session.alive)
        assert session.lease_id != first_lease
        stored = await kv.get(keys.broker("b1"))
        assert stored is not None and stored.lease == session.lease_id


@pytest.mark.etcd
async def test_unreachable_etcd_ends_the_session_within_its_ttl(keys: Keys) -> None:
    """Without etcd to confirm, the session still stops claiming liveness after the TTL."""
    async with LocalEtcd() as etcd:
        kv = await etcd.connect(timeout=0.5)
        session = BrokerSession(kv, keys, "b1", "http://b1:6650", ttl=1)
        lost: list[float] = []
        session.on_lost(lambda: lost.append(time.monotonic()))
        await session.start()
        pid = etcd.server.pid
        assert pid is not None
        frozen_at = time.monotonic()
        with frozen(pid):
            await eventually(lambda: bool(lost), timeout=3)
            assert lost[0] - frozen_at <= 1.5
            assert not session.alive
        await eventually(lambda: session.alive, timeout=5)
        await session.close()
        await kv.close()
