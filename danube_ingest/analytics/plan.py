"""Planning: which partitions of a topic are complete, and which manifest ranges hold them.

A partition ``[start, end)`` is complete once the topic clock's ``ingest_ms`` has reached
``end`` (``TopicClock.complete``): its entries are then exactly the entries with an ingest
time in ``[start, end)``, all below the clock's offset, all in objects listed by the manifest,
and nothing can be added to it any more. Because ingest times never decrease along offsets,
those entries form one contiguous offset range; the manifest's per-range ingest times bound it.

Guarantees of ``complete_partitions``:

* It returns consecutive partitions, starting at ``upper_ms`` (a rendition's frontier: the
  first partition not committed yet) or, without one, at the partition of the topic's first
  ingest time, and ending at the last complete one (at most ``limit`` of them).
* Partitions without entries are returned too (they commit with no rows), so a quiet topic's
  frontier moves forward with its clock.
* Each partition lists every manifest range that may hold its entries, and offset bounds that
  contain them all; the reader filters the entries by ingest time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from danube_ingest.analytics.errors import CommitFailedError
from danube_ingest.analytics.layout import partition_end, partition_start
from danube_ingest.analytics.records import RenditionRecord, TableKeys, TableRecord
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Get
from danube_ingest.metadata.manifest import ObjectRange

__all__ = [
    "Partition",
    "PlanInput",
    "RunPlan",
    "complete_partitions",
    "plan_run",
    "read_plan_input",
]

#: Partitions planned per call unless said otherwise: a day of minute partitions. A table
#: starting long ago catches up over several runs instead of one enormous plan.
DEFAULT_LIMIT = 1440


@dataclass(frozen=True, slots=True)
class Partition:
    """One complete partition to convert."""

    start_ms: int
    end_ms: int
    """Exclusive."""
    min_offset: int
    """Every entry of the partition has an offset at or above this."""
    end_offset: int
    """Every entry of the partition has an offset below this (``min_offset == end_offset``:
    no entry)."""
    ranges: tuple[ObjectRange, ...]
    """The manifest ranges that may hold its entries, in offset order."""

    @property
    def empty(self) -> bool:
        """Whether the manifest proves the partition has no entry."""
        return not self.ranges


@dataclass(frozen=True, slots=True)
class PlanInput:
    """A topic's clock and manifest, read at one etcd revision."""

    clock: TopicClock | None
    ranges: list[ObjectRange]
    revision: int
    """The highest ``mod_revision`` among the keys read: the input's version."""


async def read_plan_input(kv: KV, keys: Keys, topic: str) -> PlanInput:
    """The topic's clock and manifest from one consistent read (one transaction)."""
    clock_key = keys.topic_clock(topic)
    result = await kv.txn([], [Get(clock_key), Get(keys.storage_objects_prefix(topic), True)])
    clock_kv = result.kv(0)
    entries = result.responses[1].kvs
    ranges = [ObjectRange.decode(e.value, e.key) for e in entries]
    revisions = [e.mod_revision for e in entries]
    clock = None
    if clock_kv is not None:
        clock = TopicClock.decode(clock_kv.value, clock_key)
        revisions.append(clock_kv.mod_revision)
    return PlanInput(clock, ranges, max(revisions, default=0))


def complete_partitions(
    clock: TopicClock | None,
    ranges: Sequence[ObjectRange],
    *,
    width_s: int,
    upper_ms: int | None = None,
    limit: int = DEFAULT_LIMIT,
) -> list[Partition]:
    """The complete partitions from ``upper_ms`` on (see the module docstring)."""
    if clock is None or limit < 1:
        return []
    ordered = sorted(ranges, key=lambda r: r.start_offset)
    if upper_ms is None:
        if not ordered:
            return []
        upper_ms = partition_start(min(r.first_ingest_ms for r in ordered), width_s)
    start = upper_ms
    partitions: list[Partition] = []
    while len(partitions) < limit:
        end = partition_end(start, width_s)
        if not clock.complete(end):
            break
        needed = tuple(r for r in ordered if r.first_ingest_ms < end and r.last_ingest_ms >= start)
        if needed:
            low, high = needed[0].start_offset, needed[-1].end_offset
        else:
            # No entry: the bounds are where the partition's entries would be.
            low = high = next(
                (r.start_offset for r in ordered if r.first_ingest_ms >= end), clock.offset
            )
        partitions.append(Partition(start, end, low, high, needed))
        start = end
    return partitions


@dataclass(frozen=True, slots=True)
class RunPlan:
    """What a run of one rendition converts."""

    width_s: int
    partitions: list[Partition]
    input_revision: int
    """``PlanInput.revision``: recorded in the intent and in every commit."""


async def plan_run(
    kv: KV, keys: Keys, topic: str, rendition: str, *, limit: int = DEFAULT_LIMIT
) -> RunPlan:
    """The complete partitions ``rendition`` has not committed yet, from its frontier (or the
    table's ``since``, whichever is later). ``CommitFailedError`` if the table or the
    rendition does not exist or the rendition is collected."""
    tables = TableKeys(keys, topic)
    read = await kv.txn([], [Get(tables.table()), Get(tables.rendition(rendition))])
    table_kv, rendition_kv = read.kv(0), read.kv(1)
    if table_kv is None or rendition_kv is None:
        raise CommitFailedError(f"{topic} has no table or no rendition {rendition}: create them")
    table = TableRecord.decode(table_kv.value, table_kv.key)
    record = RenditionRecord.decode(rendition_kv.value, rendition_kv.key)
    if record.state == "collected":
        raise CommitFailedError(f"rendition {rendition} of {topic} is collected")
    plan_input = await read_plan_input(kv, keys, topic)
    partitions = complete_partitions(
        plan_input.clock,
        plan_input.ranges,
        width_s=table.width_s,
        upper_ms=max(record.upper_ms, table.since_ms),
        limit=limit,
    )
    return RunPlan(table.width_s, partitions, plan_input.revision)
