"""Tables, renditions, the reader handover, holds and collection, on real etcd."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from danube_ingest.analytics.errors import RenditionError, RenditionHeldError
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.analytics.renditions import (
    activate,
    collect_rendition,
    create_rendition,
    create_table,
    hold,
    read_rendition,
    read_table,
)
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.kv import Compare, TxnOp, TxnResult
from danube_ingest.objects.store import ObjectStore

from .tables_support import ROOT, T0, TOPIC, publish_input, rows, run_conversion

TEN_MIN = 600_000
CLOCK = TopicClock(offset=300, ingest_ms=T0 + 3 * TEN_MIN, broker="b1", epoch=1)


async def converted(kv: EtcdKV, keys: Keys, store: ObjectStore, version: str) -> str:
    rendition = await create_rendition(kv, keys, TOPIC, version, "orders-value:1")
    await run_conversion(kv, keys, store, rendition, converter_version=version)
    return rendition


async def read_all(kv: EtcdKV, keys: Keys, store: ObjectStore, rendition: str) -> pa.Table:
    """Every committed row of ``rendition``, read file by file from its records."""
    prefix = TableKeys(keys, TOPIC).parts_prefix(rendition)
    records = [PartitionCommit.decode(e.value, e.key) for e in await kv.get_prefix(prefix)]
    tables = [pq.read_table(io.BytesIO(await store.get(f.path))) for r in records for f in r.files]
    return pa.concat_tables(tables)


async def test_create_table_and_renditions(etcd_kv: EtcdKV, keys: Keys) -> None:
    table = await create_table(etcd_kv, keys, TOPIC, since_ms=T0 + 123, width_s=600)
    assert (table.width_s, table.active, table.since_ms, table.upper_ms) == (600, None, T0, T0)
    assert await create_table(etcd_kv, keys, TOPIC, since_ms=0, width_s=600) == table
    with pytest.raises(RenditionError, match="exists with partitions of 600 s, not 3600 s"):
        await create_table(etcd_kv, keys, TOPIC, since_ms=T0)
    assert await create_rendition(etcd_kv, keys, TOPIC, "v1") == "r1"
    assert await create_rendition(etcd_kv, keys, TOPIC, "v2", "orders-value:3") == "r2"
    r2 = await read_rendition(etcd_kv, keys, TOPIC, "r2")
    assert r2 is not None and (r2.state, r2.upper_ms, r2.schema_ref) == (
        "building",
        T0,
        "orders-value:3",
    )
    with pytest.raises(RenditionError, match="no table"):
        await create_rendition(etcd_kv, keys, "/default/other", "v1")
    with pytest.raises(RenditionError, match="no active rendition"):
        async with hold(etcd_kv, keys, TOPIC):
            pass


async def test_handover_keeps_a_held_rendition_readable_to_the_end(
    etcd_kv: EtcdKV, keys: Keys
) -> None:
    store = ObjectStore.memory()
    await publish_input(etcd_kv, keys, [120, 300], CLOCK)
    await create_table(etcd_kv, keys, TOPIC, since_ms=T0, width_s=600)
    r1 = await converted(etcd_kv, keys, store, "v1")
    await activate(etcd_kv, keys, TOPIC, r1)
    expected = pa.Table.from_batches([rows(range(300))])

    async with hold(etcd_kv, keys, TOPIC, holder="test reader") as held:
        assert held == r1
        first_half = await read_all(etcd_kv, keys, store, r1)
        r2 = await converted(etcd_kv, keys, store, "v2")
        table = await activate(etcd_kv, keys, TOPIC, r2)  # new readers get r2 from now on
        assert (table.active, table.upper_ms) == (r2, T0 + 3 * TEN_MIN)
        old = await read_rendition(etcd_kv, keys, TOPIC, r1)
        assert old is not None and old.state == "draining"
        with pytest.raises(RenditionHeldError, match="held by 1 reader") as caught:
            await collect_rendition(etcd_kv, keys, TOPIC, r1, store, ROOT)
        assert caught.value.retriable
        # The holder reads r1 to the end, unchanged.
        assert await read_all(etcd_kv, keys, store, r1) == first_half == expected
    async with hold(etcd_kv, keys, TOPIC) as newer:
        assert newer == r2
        assert await read_all(etcd_kv, keys, store, r2) == expected

    with pytest.raises(RenditionError, match="is active"):
        await collect_rendition(etcd_kv, keys, TOPIC, r2, store, ROOT)
    assert await collect_rendition(etcd_kv, keys, TOPIC, r1, store, ROOT) == 3
    assert await store.list(f"{ROOT}{r1}/") == []
    assert await store.list(f"{ROOT}{r2}/") != []
    assert await etcd_kv.get_prefix(TableKeys(keys, TOPIC).parts_prefix(r1)) == []
    collected = await read_rendition(etcd_kv, keys, TOPIC, r1)
    assert collected is not None and collected.state == "collected"
    assert await collect_rendition(etcd_kv, keys, TOPIC, r1, store, ROOT) == 0  # idempotent
    with pytest.raises(RenditionError, match="collected"):
        async with hold(etcd_kv, keys, TOPIC, r1):
            pass
    with pytest.raises(RenditionError, match="collected"):
        await activate(etcd_kv, keys, TOPIC, r1)


async def test_activation_never_moves_the_frontier_back(etcd_kv: EtcdKV, keys: Keys) -> None:
    store = ObjectStore.memory()
    await publish_input(etcd_kv, keys, [120, 300], CLOCK)
    await create_table(etcd_kv, keys, TOPIC, since_ms=T0, width_s=600)
    r1 = await converted(etcd_kv, keys, store, "v1")
    await activate(etcd_kv, keys, TOPIC, r1)
    r2 = await create_rendition(etcd_kv, keys, TOPIC, "v2")
    await run_conversion(etcd_kv, keys, store, r2, limit=1)
    with pytest.raises(RenditionError, match="behind the table's upper"):
        await activate(etcd_kv, keys, TOPIC, r2)
    table = await read_table(etcd_kv, keys, TOPIC)
    assert table is not None and (table.active, table.upper_ms) == (r1, T0 + 3 * TEN_MIN)
    await run_conversion(etcd_kv, keys, store, r2)
    assert (await activate(etcd_kv, keys, TOPIC, r2)).upper_ms == T0 + 3 * TEN_MIN


class HookKV:
    """The real etcd; runs ``before`` once, just before the first transaction ``when`` picks
    (to let another client act between a read and a compare-and-swap)."""

    def __init__(
        self,
        kv: EtcdKV,
        when: Callable[[Sequence[TxnOp]], bool],
        before: Callable[[], Awaitable[None]],
    ) -> None:
        self._kv, self._when, self._before, self.fired = kv, when, before, False

    def __getattr__(self, name: str) -> object:
        return getattr(self._kv, name)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        if not self.fired and compares and self._when(success):
            self.fired = True
            await self._before()
        return await self._kv.txn(compares, success, failure)


async def test_a_hold_taken_during_collection_wins(etcd_kv: EtcdKV, keys: Keys) -> None:
    store = ObjectStore.memory()
    await publish_input(etcd_kv, keys, [120, 300], CLOCK)
    await create_table(etcd_kv, keys, TOPIC, since_ms=T0, width_s=600)
    r1 = await converted(etcd_kv, keys, store, "v1")
    await activate(etcd_kv, keys, TOPIC, r1)
    r2 = await converted(etcd_kv, keys, store, "v2")
    await activate(etcd_kv, keys, TOPIC, r2)
    reader = hold(etcd_kv, keys, TOPIC, r1)

    async def take_hold() -> None:
        await reader.__aenter__()

    # The collector has seen no hold; a reader takes one before its CAS: the reader wins.
    racing = HookKV(etcd_kv, lambda ops: any(op.key.endswith(f"/{r1}") for op in ops), take_hold)
    with pytest.raises(RenditionHeldError):
        await collect_rendition(racing, keys, TOPIC, r1, store, ROOT)  # type: ignore[arg-type]
    assert racing.fired
    assert len(await store.list(f"{ROOT}{r1}/")) == 3
    await reader.__aexit__(None, None, None)
    assert await collect_rendition(etcd_kv, keys, TOPIC, r1, store, ROOT) == 3
