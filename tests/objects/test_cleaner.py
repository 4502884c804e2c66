"""WalCleaner: never deletes what is not uploaded; follows subscription cursors until a prune
mark exists; keeps the retention minimums. Real etcd and object stores."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.records import Records, SubscriptionRecord, encode_cursor
from danube_ingest.objects.store import ObjectStore

from .support import ColdStack, T, payloads, prune_all

pytestmark = pytest.mark.etcd


# -- the cleaner ---------------------------------------------------------------------------


async def test_cleaner_never_deletes_what_is_not_uploaded(stack: ColdStack) -> None:
    await stack.acquire(T)
    await stack.append(T, payloads(T, 300))
    await stack.seal()
    assert not await prune_all(stack, T)  # uploader not started: nothing uploaded
    assert "not uploaded" in (stack.cleaner.stats.blocked_by or "")
    stack.uploader.start()
    await stack.seal_and_upload()
    assert await stack.cleaner.clean_once()


async def test_cleaner_follows_the_slowest_subscription_until_a_mark_exists(
    stack: ColdStack,
) -> None:
    await stack.acquire(T)
    stack.uploader.start()
    sent = payloads(T, 400)
    for i in range(0, 400, 20):  # small commits: segments of about 180 entries
        await stack.append(T, sent[i : i + 20])
    await stack.seal_and_upload()
    region = stack.store.regions[0]
    records = Records(stack.kv, stack.keys)
    await records.put_subscription(SubscriptionRecord(T, "fast", "Exclusive"))
    await records.put_subscription(SubscriptionRecord(T, "slow", "Shared"))
    await stack.kv.put(stack.keys.subscription_cursor(T, "fast"), encode_cursor(400))
    # "slow" has no cursor yet: it holds everything.
    assert not await stack.cleaner.clean_once()
    await stack.kv.put(stack.keys.subscription_cursor(T, "slow"), encode_cursor(250))
    deleted = await stack.cleaner.clean_once()
    assert deleted, stack.cleaner.stats.blocked_by
    info = stack.store.info(T)
    assert info is not None and info.first_offset <= 250  # nothing at or above 250 went
    # Every deleted segment's offsets are below the slow cursor.
    remaining = sorted(region.sealed)
    assert remaining and region.topic(T).spans[0].first_offset <= 250  # type: ignore[union-attr]
    # A prune mark (from the control plane) overrides the cursors.
    await PruneMarks(stack.kv, stack.keys).set_mark("b1", "r0", T, 400)
    await stack.cleaner.clean_once()
    assert not region.sealed


async def test_cleaner_keeps_retention_minimums(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    objects = ObjectStore.memory()
    stack = await ColdStack(
        etcd_kv,
        keys,
        objects,
        tmp_path / "wal",
        retention_values={"min_minutes": 10},
    ).open()
    try:
        await stack.acquire(T)
        stack.uploader.start()
        await stack.append(T, payloads(T, 300))
        await stack.seal_and_upload()
        assert not await prune_all(stack, T)
        assert "min_minutes" in (stack.cleaner.stats.blocked_by or "")
        stack.cleaner._clock = lambda: time.time() + 11 * 60
        assert await stack.cleaner.clean_once()
    finally:
        await stack.close()

    stack = await ColdStack(
        etcd_kv,
        keys,
        objects,
        tmp_path / "wal2",
        broker_id="b2",
        retention_values={"min_bytes": "100KiB", "max_bytes": "10MiB"},
    ).open()
    try:
        await stack.acquire("/default/other")
        stack.uploader.start()
        await stack.append("/default/other", payloads("/default/other", 1000))
        await stack.seal_and_upload()
        await prune_all(stack, "/default/other")
        assert stack.store.wal_bytes() >= 100 * 1024
        assert stack.store.wal_bytes() < 100 * 1024 + 2 * 64 * 1024
    finally:
        await stack.close()
