"""The run protocol (danube_ingest.analytics.commit) on real etcd and memory/fs/s3 stores:
definite output under reruns, concurrent runs, crashes, lost etcd answers; frontiers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from danube_ingest.analytics.commit import (
    advance_frontier,
    advance_since,
    begin,
    collect_staging,
    commit_partition,
    finish_published,
)
from danube_ingest.analytics.errors import CommitFailedError
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.analytics.renditions import (
    activate,
    create_rendition,
    create_table,
    read_rendition,
    read_table,
)
from danube_ingest.metadata import KV, CommitStateUnknownError, EtcdKV, Keys, MemoryKV
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.kv import Compare, TxnOp, TxnResult
from danube_ingest.objects.store import ObjectStore

from .tables_support import (
    ROOT,
    SCHEMA,
    T0,
    TOPIC,
    publish_input,
    rows,
    run_conversion,
    snapshot,
    warehouse,
)

__all__ = ["warehouse"]

TEN_MIN = 600_000
#: Offsets 0..299, 100 per 10 minutes, in two manifest ranges; the clock 40 minutes past T0:
#: three 10-minute partitions of 100 rows and one empty one are complete.
CLOCK = TopicClock(offset=300, ingest_ms=T0 + 4 * TEN_MIN, broker="b1", epoch=1)
STARTS = [T0 + i * TEN_MIN for i in range(4)]


async def make_table(kv: KV, keys: Keys) -> str:
    await publish_input(kv, keys, [120, 300], CLOCK)
    await create_table(kv, keys, TOPIC, since_ms=T0, width_s=600)
    rendition = await create_rendition(kv, keys, TOPIC, "test-1")
    await activate(kv, keys, TOPIC, rendition)
    return rendition


async def parts(kv: KV, keys: Keys, rendition: str = "r1") -> list[PartitionCommit]:
    prefix = TableKeys(keys, TOPIC).parts_prefix(rendition)
    return [PartitionCommit.decode(e.value, e.key) for e in await kv.get_prefix(prefix)]


async def reference(tmp_path: Path) -> dict[str, bytes]:
    """The files a clean run writes (its own MemoryKV and store): what every scenario must
    end with."""
    kv, keys, store = MemoryKV(), Keys("/ref"), ObjectStore.memory()
    rendition = await make_table(kv, keys)
    await run_conversion(kv, keys, store, rendition)
    files = await snapshot(store, f"{ROOT}r1/")
    assert len(files) == 3 and await store.list(f"{ROOT}_staging/") == []
    await kv.close()
    return files


async def assert_converged(
    kv: KV, keys: Keys, store: ObjectStore, expected: dict[str, bytes]
) -> None:
    assert await snapshot(store, f"{ROOT}r1/") == expected
    records = await parts(kv, keys)
    assert [r.start_ms for r in records] == STARTS
    assert all(r.published for r in records)
    assert [r.rows for r in records] == [100, 100, 100, 0]
    assert [(r.first_offset, r.last_offset) for r in records] == [
        (0, 99),
        (100, 199),
        (200, 299),
        (-1, -1),
    ]
    table = await read_table(kv, keys, TOPIC)
    assert table is not None and table.upper_ms == T0 + 4 * TEN_MIN


async def test_a_run_commits_and_publishes_every_complete_partition(
    etcd_kv: EtcdKV, keys: Keys, warehouse: ObjectStore, tmp_path: Path
) -> None:
    rendition = await make_table(etcd_kv, keys)
    outcomes = await run_conversion(etcd_kv, keys, warehouse, rendition)
    assert [o.status for o in outcomes] == ["committed"] * 4
    await assert_converged(etcd_kv, keys, warehouse, await reference(tmp_path))
    assert sorted(await warehouse.list(ROOT)) == sorted(
        f.path for r in await parts(etcd_kv, keys) for f in r.files
    )
    assert await warehouse.list(f"{ROOT}_staging/") == []
    assert await etcd_kv.get_prefix(TableKeys(keys, TOPIC).intents_prefix()) == []
    # A rerun finds nothing left to convert; converting again from scratch is byte-identical.
    assert await run_conversion(etcd_kv, keys, warehouse, rendition) == []


async def test_a_rendition_reads_as_a_hive_partitioned_dataset(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "wh")})
    rendition = await make_table(etcd_kv, keys)
    await run_conversion(etcd_kv, keys, store, rendition)
    dataset = ds.dataset(tmp_path / "wh" / "warehouse" / "r1", partitioning="hive")
    table = dataset.to_table(filter=(ds.field("topic") == "orders") & (ds.field("minute") == 10))
    assert table.column("offset").to_pylist() == list(range(100, 200))
    assert set(table.column("namespace").to_pylist()) == {"default"}
    assert set(table.column("hour").to_pylist()) == {10}


async def test_rerun_of_committed_partitions_reports_already_and_changes_nothing(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "wh")})
    rendition = await make_table(etcd_kv, keys)
    await run_conversion(etcd_kv, keys, store, rendition)
    before = await snapshot(store)
    records = await parts(etcd_kv, keys)
    async with await begin(etcd_kv, keys, TOPIC, rendition, STARTS[:1], 1) as intent:
        staged = await write_partition(
            store,
            intent.staging_path(ROOT, records[0].files[0].path.rsplit("/", 1)[0] + "/"),
            [rows(range(100))],
            SCHEMA,
        )
        outcome = await commit_partition(intent, store, ROOT, STARTS[0], 600, staged, "test-2")
    assert outcome.status == "already" and outcome.record == records[0]
    assert await snapshot(store) == before
    assert await parts(etcd_kv, keys) == records


async def test_two_concurrent_runs_commit_each_partition_once(
    etcd_kv: EtcdKV, keys: Keys, warehouse: ObjectStore, tmp_path: Path
) -> None:
    rendition = await make_table(etcd_kv, keys)
    one, two = await asyncio.gather(
        run_conversion(etcd_kv, keys, warehouse, rendition),
        run_conversion(etcd_kv, keys, warehouse, rendition),
    )
    for a, b in zip(one, two, strict=True):
        assert sorted([a.status, b.status]) == ["already", "committed"]
        assert a.record == b.record
    await assert_converged(etcd_kv, keys, warehouse, await reference(tmp_path))
    assert await warehouse.list(f"{ROOT}_staging/") == []  # the loser's staging is gone


CHILD = Path(__file__).with_name("tables_crash_child.py")


def run_child(mode: str, etcd: str, prefix: str, root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    result = subprocess.run(
        [sys.executable, str(CHILD), mode, etcd, prefix, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 9, result.stdout + result.stderr  # it died where told


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash", ["after_stage", "after_commit", "mid_publish", "before_cleanup"])
async def test_a_run_killed_at_any_step_converges_on_rerun(
    etcd_server: str, etcd_kv: EtcdKV, keys: Keys, tmp_path: Path, crash: str
) -> None:
    rendition = await make_table(etcd_kv, keys)
    root = tmp_path / "wh"
    run_child(crash, etcd_server, keys.prefix, root)
    store = ObjectStore("fs", options={"root": str(root)})
    crashed = await store.list(f"{ROOT}_staging/")
    assert crashed  # the child died with staged files left
    committed = await parts(etcd_kv, keys)
    assert bool(committed) == (crash != "after_stage")

    await run_conversion(etcd_kv, keys, store, rendition)
    # The rerun finished what the crashed run committed (published from its staging) and
    # converted the rest itself: each partition keeps the record of whoever committed first.
    after = {r.start_ms: r for r in await parts(etcd_kv, keys)}
    for before in committed:
        assert after[before.start_ms].token == before.token
    await assert_converged(etcd_kv, keys, store, await reference(tmp_path))

    # The dead run's staging goes once its intent has expired (the grace period set to 0).
    deadline = time.monotonic() + 20
    while await store.list(f"{ROOT}_staging/"):
        assert time.monotonic() < deadline, await store.list(f"{ROOT}_staging/")
        await collect_staging(etcd_kv, keys, store, ROOT, grace_s=0)
        await asyncio.sleep(0.2)
    await assert_converged(etcd_kv, keys, store, await reference(tmp_path))


async def test_finish_published_completes_a_commit_whose_run_died(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "wh")})
    rendition = await make_table(etcd_kv, keys)
    intent = await begin(etcd_kv, keys, TOPIC, rendition, STARTS[:1], 1)
    final = ROOT + "r1/namespace=default/topic=orders/date=2026-11-24/hour=10/minute=00/"
    staged = await write_partition(
        store, intent.staging_path(ROOT, final), [rows(range(100))], SCHEMA
    )
    # Commit but keep the staging unpublished, as a run killed right after its CAS would.
    record = PartitionCommit(
        T0,
        T0 + TEN_MIN,
        [
            {
                "path": final + staged[0].path.rsplit("/", 1)[1],
                "size": staged[0].size,
                "rows": 100,
                "first_offset": 0,
                "last_offset": 99,
                "crc32c": staged[0].crc32c,
            }
        ],  # type: ignore[list-item]
        100,
        0,
        99,
        1,
        "test-1",
        intent.token,
        T0,
    )
    part_key = TableKeys(keys, TOPIC).part(rendition, T0)
    assert (await etcd_kv.txn([Compare.absent(part_key)], [_put(part_key, record)])).succeeded
    # While the intent lives and the commit is unpublished, collection keeps the staging.
    assert await collect_staging(etcd_kv, keys, store, ROOT, grace_s=0) == []
    await etcd_kv.revoke_lease(intent.lease)
    assert await collect_staging(etcd_kv, keys, store, ROOT, grace_s=0) == []  # unpublished
    published = await finish_published(etcd_kv, keys, TOPIC, store, ROOT)
    assert [p.start_ms for p in published] == [T0] and published[0].published
    assert await store.list(final) == [record.files[0].path]
    assert await store.list(f"{ROOT}_staging/") == []
    rendition_record = await read_rendition(etcd_kv, keys, TOPIC, rendition)
    assert rendition_record is not None and rendition_record.upper_ms == T0 + TEN_MIN
    await intent.close()


def _put(key: str, record: PartitionCommit) -> TxnOp:
    from danube_ingest.metadata.kv import Put

    return Put(key, record.encode())


class LostAnswerKV:
    """The real etcd, except that the first commit transaction's answer is lost: it raises
    ``CommitStateUnknownError`` as ``EtcdKV`` does on a timeout, after (``applied``) or
    without applying it."""

    def __init__(self, kv: EtcdKV, *, applied: bool) -> None:
        self._kv, self._applied, self.lost = kv, applied, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        if not self.lost and any("/parts/" in op.key for op in success):
            self.lost += 1
            if self._applied:
                await self._kv.txn(compares, success, failure)
            raise CommitStateUnknownError("etcd: txn timed out; re-read before retrying")
        return await self._kv.txn(compares, success, failure)


@pytest.mark.parametrize("applied", [True, False])
async def test_a_lost_commit_answer_is_settled_by_re_reading(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path, applied: bool
) -> None:
    store = ObjectStore.memory()
    rendition = await make_table(etcd_kv, keys)
    flaky = LostAnswerKV(etcd_kv, applied=applied)
    outcomes = await run_conversion(flaky, keys, store, rendition)  # type: ignore[arg-type]
    assert flaky.lost == 1
    assert [o.status for o in outcomes] == ["committed"] * 4
    await assert_converged(etcd_kv, keys, store, await reference(tmp_path))


async def test_a_run_whose_intent_expired_cannot_commit(etcd_kv: EtcdKV, keys: Keys) -> None:
    store = ObjectStore.memory()
    rendition = await make_table(etcd_kv, keys)
    intent = await begin(etcd_kv, keys, TOPIC, rendition, STARTS[:1], 1)
    final = ROOT + "r1/namespace=default/topic=orders/date=2026-11-24/hour=10/minute=00/"
    staged = await write_partition(
        store, intent.staging_path(ROOT, final), [rows(range(100))], SCHEMA
    )
    await etcd_kv.revoke_lease(intent.lease)  # as if its keepalive had stopped for a TTL
    with pytest.raises(CommitFailedError, match=r"intent of run .* expired") as caught:
        await commit_partition(intent, store, ROOT, T0, 600, staged, "test-1")
    assert not caught.value.retriable
    assert await parts(etcd_kv, keys) == []
    assert await store.list("") == []  # its staging was deleted
    await intent.close()


async def test_collect_staging_waits_for_the_grace_period(etcd_kv: EtcdKV, keys: Keys) -> None:
    store = ObjectStore.memory()
    rendition = await make_table(etcd_kv, keys)
    intent = await begin(etcd_kv, keys, TOPIC, rendition, STARTS[:1], 1)
    final = ROOT + "r1/namespace=default/topic=orders/date=2026-11-24/hour=10/minute=00/"
    await write_partition(store, intent.staging_path(ROOT, final), [rows(range(3))], SCHEMA)
    await intent.close()
    await store.put(f"{ROOT}_staging/not-a-run-file", b"x")
    assert await collect_staging(etcd_kv, keys, store, ROOT, grace_s=3600) == []
    assert await collect_staging(etcd_kv, keys, store, ROOT, grace_s=0) == [intent.token]
    assert await store.list("") == [f"{ROOT}_staging/not-a-run-file"]  # unknown: left alone


async def test_frontiers_only_move_forward(etcd_kv: EtcdKV, keys: Keys) -> None:
    store = ObjectStore.memory()
    rendition = await make_table(etcd_kv, keys)
    await run_conversion(etcd_kv, keys, store, rendition, limit=2)
    table = await read_table(etcd_kv, keys, TOPIC)
    assert table is not None and (table.since_ms, table.upper_ms) == (T0, T0 + 2 * TEN_MIN)
    assert await advance_frontier(etcd_kv, keys, TOPIC, rendition) == T0 + 2 * TEN_MIN
    moved = await advance_since(etcd_kv, keys, TOPIC, T0 + TEN_MIN)
    assert moved.since_ms == T0 + TEN_MIN
    assert (await advance_since(etcd_kv, keys, TOPIC, T0)).since_ms == T0 + TEN_MIN  # not back
    with pytest.raises(CommitFailedError, match="past its upper"):
        await advance_since(etcd_kv, keys, TOPIC, T0 + 3 * TEN_MIN)
    await run_conversion(etcd_kv, keys, store, rendition)
    table = await read_table(etcd_kv, keys, TOPIC)
    assert table is not None and (table.since_ms, table.upper_ms) == (
        T0 + TEN_MIN,
        T0 + 4 * TEN_MIN,
    )
