"""Child process of the table crash tests: runs one conversion of ``/default/orders`` (table
and rendition r1 already created by the parent) on an fs warehouse, and dies (exit code 9, no
cleanup, its intent left to expire) at the step it is told:

* ``after_stage``: every partition is staged, nothing is committed.
* ``after_commit``: the first partition is committed, nothing is published (dies on the first
  copy to a final path).
* ``mid_publish``: the first partition is published, the second committed but not published.
* ``before_cleanup``: the first partition is published and marked so, its staging not deleted.

Usage: tables_crash_child.py MODE ETCD_ENDPOINT PREFIX OBJECTS_ROOT
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterable, Iterable
from pathlib import Path

from danube_ingest.analytics import layout
from danube_ingest.analytics.commit import begin
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.plan import complete_partitions, read_plan_input
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.objects.store import ObjectStore

sys.path.insert(0, str(Path(__file__).parents[2]))

from tests.analytics.tables_support import (
    ROOT,
    SCHEMA,
    TOPIC,
    partition_rows,
    run_conversion,
)

#: Intent lease of the child: short, so the parent sees it expire within seconds; not shorter,
#: or a loaded machine can miss a keep-alive, expire the intent before the commit, and the
#: run then takes its loser path (deleting its staging) instead of dying where it is told.
INTENT_TTL = 6


class DyingStore(ObjectStore):
    """An fs store that kills the process at the n-th call of one operation."""

    def __init__(self, root: str, operation: str, at: int) -> None:
        super().__init__("fs", options={"root": root})
        self.operation, self.at, self.calls = operation, at, 0

    def _step(self, operation: str, key: str) -> None:
        if operation != self.operation or (operation == "delete" and "_staging/" not in key):
            return
        self.calls += 1
        if self.calls == self.at:
            os._exit(9)

    async def put_large(
        self,
        key: str,
        chunks: Iterable[bytes] | AsyncIterable[bytes],
        *,
        part_bytes: int = 8 << 20,
    ) -> int:
        self._step("put_large", key)
        return await super().put_large(key, chunks, part_bytes=part_bytes)

    async def delete(self, key: str) -> None:
        self._step("delete", key)
        await super().delete(key)


async def main(mode: str, etcd: str, prefix: str, root: str) -> None:
    kv = await EtcdKV.connect([etcd], timeout=5.0)
    keys = Keys(prefix)
    if mode == "after_stage":
        store = ObjectStore("fs", options={"root": root})
        plan = await read_plan_input(kv, keys, TOPIC)
        parts = complete_partitions(plan.clock, plan.ranges, width_s=600, upper_ms=None)
        starts = [p.start_ms for p in parts]
        intent = await begin(kv, keys, TOPIC, "r1", starts, plan.revision, ttl=INTENT_TTL)
        for part in parts:
            final = ROOT + layout.partition_dir("r1", TOPIC, part.start_ms, 600)
            await write_partition(
                store, intent.staging_path(ROOT, final), partition_rows(part), SCHEMA
            )
        os._exit(9)
    operation, at = {
        "after_commit": ("put_large", 1),
        "mid_publish": ("put_large", 2),
        "before_cleanup": ("delete", 1),
    }[mode]
    await run_conversion(kv, keys, DyingStore(root, operation, at), "r1", intent_ttl=INTENT_TTL)
    raise SystemExit(f"{mode}: the run ended without reaching its crash point")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
