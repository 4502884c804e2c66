"""BrokerSession: registration under a lease, keepalive, loss and re-registration."""

from __future__ import annotations

import asyncio
import json
import socket
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


async def _leftover(kv: KV, keys: Keys, registration: dict[str, object]) -> int:
    """What a SIGKILLed broker leaves: its registration (and an owner key) under a lease that
    nobody refreshes any more, good for another 30 s."""
    lease = await kv.grant_lease(30)
    await kv.put(keys.broker("b1"), json.dumps(registration).encode(), lease=lease)
    await kv.put(keys.topic_owner("/default/t"), b"b1", lease=lease)
    return lease


async def test_restart_on_the_same_data_dir_takes_the_registration_back_at_once(
    kv: KV, keys: Keys
) -> None:
    """The data directory's lock proves the previous process is dead: no waiting for its TTL."""
    old = await _leftover(
        kv, keys, {"url": "http://b1:6650", "data_dir_id": "d1", "host": socket.gethostname()}
    )
    started = time.monotonic()
    async with BrokerSession(kv, keys, "b1", "http://b1:6650", ttl=30, data_dir_id="d1") as new:
        assert time.monotonic() - started < 2.0
        assert new.alive and new.lease_id != old
        stored = await kv.get(keys.broker("b1"))
        assert stored is not None and stored.lease == new.lease_id
        value = json.loads(stored.value)
        assert value["data_dir_id"] == "d1" and value["host"] == socket.gethostname()
        # The old lease was revoked, so the topics it owned are free for the new process.
        assert await kv.get(keys.topic_owner("/default/t")) is None


@pytest.mark.parametrize(
    "registration",
    [
        pytest.param({"data_dir_id": "d2", "host": socket.gethostname()}, id="other-data-dir"),
        pytest.param({"data_dir_id": "d1", "host": "another-machine"}, id="other-host"),
        pytest.param({}, id="no-data-dir-id"),
    ],
)
async def test_another_holder_of_the_id_is_still_refused(
    kv: KV, keys: Keys, registration: dict[str, object]
) -> None:
    old = await _leftover(kv, keys, {"url": "http://b1:6650", **registration})
    session = BrokerSession(kv, keys, "b1", "http://b1:6650", ttl=30, data_dir_id="d1")
    with pytest.raises(BrokerIdConflictError, match="already registered"):
        await session.start()
    stored = await kv.get(keys.broker("b1"))
    assert stored is not None and stored.lease == old
    assert await kv.get(keys.topic_owner("/default/t")) is not None
    await kv.revoke_lease(old)
