"""WAL prune marks: the "mark" half of mark + clean (the daemon's cleaner is the other half).

For every topic that has an owner, the mark in the owner's WAL region is the highest offset
below which the topic's WAL data may go::

    mark = min(manifest end, lowest subscription cursor)

* **manifest end**: one past the last offset committed to the object manifest, so everything
  below the mark is readable from objects;
* **lowest cursor**: every subscription has acknowledged everything below it; a subscription
  with no cursor yet holds the mark where it is; a topic with no subscription is bounded by the
  manifest alone.

The run reads all of it from etcd when it runs (never from what a sensor or an earlier run saw)
and writes each mark with ``PruneMarks.set_mark``, a compare-and-swap that only moves a mark
forward, so a stale or concurrent run cannot lower one. The region of a topic comes from the
owner's registration (``brokers/{id}`` carries its region count) and the store's topic → region
rule. Retention maximums are not the control plane's business: the cleaner applies them itself.

What a mark does not cover: the cleaner still deletes a segment only once it is uploaded and its
ranges committed (it checks that itself), and only above the retention minimums.
"""

import asyncio
import json
import logging
from dataclasses import dataclass, replace

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from danube_ingest.metadata import KV, Keys, Manifest, MetadataError
from danube_ingest.metadata.marks import PruneMarks, subscription_cursors
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.records import Records
from danube_ingest.store.topic_store import region_index
from pipelines.resources import EtcdResource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarkDecision:
    """What one run decided for one topic."""

    topic: str
    broker: str | None
    """The owning broker, ``None`` for a topic without a live owner (no mark then)."""
    region: str | None
    mark: int | None
    """The mark computed, ``None`` when nothing may be pruned (see ``reason``)."""
    manifest_end: int
    lowest_cursor: int | None
    reason: str
    """Why the mark is what it is (``cursor``, ``manifest``, ``no owner`` ...)."""
    moved: bool = False
    """Whether the stored mark moved forward in this run."""


async def _broker_regions(kv: KV, keys: Keys) -> dict[str, int]:
    head = keys.brokers_prefix()
    found: dict[str, int] = {}
    for stored in await kv.get_prefix(head):
        broker = stored.key[len(head) :]
        try:
            regions = int(json.loads(stored.value).get("regions", 1))
        except (ValueError, TypeError, AttributeError) as exc:
            raise MetadataError(f"malformed broker registration at {stored.key}") from exc
        if regions < 1:
            raise MetadataError(f"broker registration at {stored.key} has {regions} regions")
        found[broker] = regions
    return found


async def decide(kv: KV, keys: Keys, topic: str, regions: dict[str, int]) -> MarkDecision:
    """The mark of ``topic`` in its owner's region, read from etcd now."""
    owner_key = keys.topic_owner(topic)
    stored = await kv.get(owner_key)
    manifest_end = await Manifest(kv, keys).end_offset(topic)
    cursors = await subscription_cursors(kv, keys, topic)
    known = [c for c in cursors.values() if c is not None]
    lowest = min(known) if known else None
    if stored is None:
        return MarkDecision(topic, None, None, None, manifest_end, lowest, "no owner")
    owner = Owner.decode(stored.value, owner_key)
    count = regions.get(owner.broker_id)
    if count is None:
        return MarkDecision(
            topic, owner.broker_id, None, None, manifest_end, lowest, "owner not registered"
        )
    region = f"r{region_index(topic, count)}"
    if any(c is None for c in cursors.values()):
        return MarkDecision(
            topic,
            owner.broker_id,
            region,
            None,
            manifest_end,
            lowest,
            "subscription without cursor",
        )
    if lowest is not None and lowest < manifest_end:
        mark, reason = lowest, "cursor"
    else:
        mark, reason = manifest_end, "manifest"
    return MarkDecision(topic, owner.broker_id, region, mark, manifest_end, lowest, reason)


async def update_prune_marks(kv: KV, keys: Keys) -> list[MarkDecision]:
    """Compute every owned topic's mark and raise the stored marks to it. One pass."""
    regions = await _broker_regions(kv, keys)
    marks = PruneMarks(kv, keys)
    decisions = []
    for record in await Records(kv, keys).list_topics():
        decision = await decide(kv, keys, record.name, regions)
        if decision.mark is not None and decision.mark > 0:
            assert decision.broker is not None and decision.region is not None
            moved = await marks.set_mark(
                decision.broker, decision.region, decision.topic, decision.mark
            )
            decision = replace(decision, moved=moved)
        decisions.append(decision)
    return decisions


@asset(
    group_name="wal",
    description="Per-topic WAL prune marks in etcd: min(manifest end, lowest cursor).",
)
def wal_prune_marks(context: AssetExecutionContext, etcd: EtcdResource) -> MaterializeResult[None]:
    """Recompute every owned topic's prune mark from etcd and move the stored marks forward."""

    async def run() -> list[MarkDecision]:
        async with etcd.connect() as (kv, keys):
            return await update_prune_marks(kv, keys)

    decisions = asyncio.run(run())
    moved = [d for d in decisions if d.moved]
    for d in decisions:
        context.log.info(
            f"{d.topic}: owner={d.broker} region={d.region} mark={d.mark} ({d.reason}), "
            f"manifest end {d.manifest_end}, lowest cursor {d.lowest_cursor}"
            + (" - moved" if d.moved else "")
        )
    rows = "\n".join(
        f"| {d.topic} | {d.broker or '-'} | {d.region or '-'} | {d.mark} | {d.reason} "
        f"| {d.manifest_end} | {d.lowest_cursor} | {'yes' if d.moved else 'no'} |"
        for d in decisions
    )
    table = (
        "| topic | owner | region | mark | why | manifest end | lowest cursor | moved |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + rows
    )
    return MaterializeResult(
        metadata={
            "topics": len(decisions),
            "marks_moved": len(moved),
            "held_back": sum(1 for d in decisions if d.mark is None),
            "marks": MetadataValue.md(table),
        }
    )


__all__ = ["MarkDecision", "decide", "update_prune_marks", "wal_prune_marks"]
