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
import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from dagster import (
    AssetExecutionContext,
    Config,
    DefaultSensorStatus,
    MaterializeResult,
    MetadataValue,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    asset,
    define_asset_job,
    sensor,
)

from assets.objects import object_manifest
from assets.topics import TOPICS_KEY, topics_observation, topics_version
from danube_ingest.metadata import KV, Keys, split_topic
from danube_ingest.metadata.marks import PruneMarks
from danube_ingest.metadata.overview import Overview, TopicProgress, read_overview
from danube_ingest.metadata.records import now_ms
from danube_ingest.store.topic_store import region_index
from pipelines.resources import EtcdResource

log = logging.getLogger(__name__)

#: A requested mark the stored one has not reached this long after (the run failed or was
#: cancelled) is requested again; until then the sensor does not ask twice for the same mark.
RETRY_AFTER_S = 600


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
    stored: int = 0
    """The mark stored for the owner's region when etcd was read (0: none)."""

    @property
    def would_move(self) -> bool:
        """Whether writing ``mark`` would move the stored mark forward."""
        return self.mark is not None and self.mark > self.stored


def decide(progress: TopicProgress, regions: dict[str, int]) -> MarkDecision:
    """The mark of one topic in its owner's region, from what etcd stated (``read_overview``):
    min(manifest end, lowest cursor); none without a live, registered owner or while a
    subscription has no cursor."""
    topic, manifest_end = progress.name, progress.manifest_end
    known = [c for c in progress.cursors.values() if c is not None]
    lowest = min(known) if known else None
    if progress.owner is None:
        return MarkDecision(topic, None, None, None, manifest_end, lowest, "no owner")
    broker = progress.owner.broker_id
    count = regions.get(broker)
    if count is None:
        return MarkDecision(topic, broker, None, None, manifest_end, lowest, "owner not registered")
    region = f"r{region_index(topic, count)}"
    stored = progress.marks.get((broker, region), 0)
    if any(c is None for c in progress.cursors.values()):
        return MarkDecision(
            topic,
            broker,
            region,
            None,
            manifest_end,
            lowest,
            "subscription without cursor",
            stored=stored,
        )
    if lowest is not None and lowest < manifest_end:
        mark, reason = lowest, "cursor"
    else:
        mark, reason = manifest_end, "manifest"
    return MarkDecision(topic, broker, region, mark, manifest_end, lowest, reason, stored=stored)


def plan_marks(overview: Overview, topics: Iterable[str] | None = None) -> list[MarkDecision]:
    """Every topic's decision (only ``topics`` when given), in name order. Reads nothing."""
    wanted = None if topics is None else set(topics)
    return [
        decide(progress, overview.brokers)
        for name, progress in overview.topics.items()
        if wanted is None or name in wanted
    ]


async def update_prune_marks(
    kv: KV, keys: Keys, topics: Iterable[str] | None = None
) -> list[MarkDecision]:
    """Compute every owned topic's mark (only ``topics`` when given) from etcd as it is now and
    raise the stored marks to it with compare-and-swap: a mark never moves back. One pass."""
    marks = PruneMarks(kv, keys)
    decisions = []
    for decision in plan_marks(await read_overview(kv, keys), topics):
        if decision.mark is not None and decision.mark > 0:
            assert decision.broker is not None and decision.region is not None
            moved = await marks.set_mark(
                decision.broker, decision.region, decision.topic, decision.mark
            )
            decision = replace(decision, moved=moved)
        decisions.append(decision)
    return decisions


class PruneMarksConfig(Config):
    """Which topics a ``prune_marks`` run marks."""

    topics: list[str] = []
    """Topic names (``/ns/topic``); empty: every topic."""


@asset(
    group_name="wal",
    deps=[object_manifest, TOPICS_KEY],
    kinds={"etcd"},
    description="Per-topic WAL prune marks in etcd: min(manifest end, lowest subscription "
    "cursor), moved forward only; run by prune_marks_sensor when a mark would move.",
)
def wal_prune_marks(
    context: AssetExecutionContext, config: PruneMarksConfig, etcd: EtcdResource
) -> MaterializeResult[None]:
    """Recompute the prune marks of ``config.topics`` (empty: every topic) from etcd as it is
    now and move the stored marks forward. A requested topic etcd no longer has is listed in
    the metadata (``not_found``), not an error: it may have been deleted since the request."""
    for topic in config.topics:
        split_topic(topic)  # InvalidNameError naming it: '/namespace/topic' expected

    async def run() -> list[MarkDecision]:
        async with etcd.connect() as (kv, keys):
            return await update_prune_marks(kv, keys, config.topics or None)

    decisions = asyncio.run(run())
    moved = [d for d in decisions if d.moved]
    not_found = sorted(set(config.topics) - {d.topic for d in decisions})
    for d in decisions:
        context.log.info(
            f"prune mark topic={d.topic} owner={d.broker} region={d.region} mark={d.mark} "
            f"reason={d.reason!r} manifest_end={d.manifest_end} lowest_cursor={d.lowest_cursor} "
            f"moved={d.moved}"
        )
    for topic in not_found:
        context.log.warning(f"prune mark topic={topic} not found in etcd (deleted?)")
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
            "not_found": MetadataValue.md("\n".join(f"- {t}" for t in not_found) or "-"),
            "marks": MetadataValue.md(table),
        }
    )


#: Job ``prune_marks``: ``wal_prune_marks`` for the topics its run config names.
prune_marks_job = define_asset_job(
    "prune_marks", selection=[wal_prune_marks.key], tags={"kind": "wal"}
)


def _read_cursor(cursor: str) -> tuple[dict[str, tuple[int, int]], str | None]:
    """The sensor cursor: topic -> (mark requested, when in ms), and the data version of the
    last ``topics`` observation. ``ValueError`` if it is not one the sensor wrote."""
    try:
        state = json.loads(cursor)
        requested = {
            str(topic): (int(mark), int(at_ms))
            for topic, (mark, at_ms) in state.get("requested", {}).items()
        }
        observed = state.get("observed")
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"unreadable prune_marks_sensor cursor {cursor!r}: {exc}") from exc
    return requested, observed if isinstance(observed, str) else None


def marks_to_request(
    overview: Overview, requested: dict[str, tuple[int, int]], now: int
) -> tuple[list[MarkDecision], dict[str, tuple[int, int]]]:
    """The decisions whose mark would move forward and was not requested already (or was, more
    than ``RETRY_AFTER_S`` ago without the stored mark reaching it), and the requests still
    outstanding afterwards (those the stored marks have not reached, the new ones included).
    Reads nothing."""
    due: list[MarkDecision] = []
    outstanding: dict[str, tuple[int, int]] = {}
    for d in plan_marks(overview):
        if d.mark is None:
            continue
        earlier = requested.get(d.topic)
        if (
            earlier is not None
            and d.stored < earlier[0]  # the requested run has not stored it yet
            and d.mark <= earlier[0]
            and now - earlier[1] < RETRY_AFTER_S * 1000
        ):
            outstanding[d.topic] = earlier
            continue
        if d.would_move:
            due.append(d)
            outstanding[d.topic] = (d.mark, now)
    return due, outstanding


@sensor(
    job=prune_marks_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Reads etcd once a minute (one transaction) and requests a prune_marks run "
    "for the topics whose WAL prune mark would move forward; records an observation of "
    "`topics` when a topic's figures changed.",
)
def prune_marks_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult:
    """One etcd transaction per evaluation; a run only when a mark would move. The cursor keeps
    the marks requested and not yet stored (so a queued run is not requested again) and the
    digest of the last ``topics`` observation (so an unchanged system records none); a cursor
    it cannot read is logged (naming it) and replaced."""
    requested: dict[str, tuple[int, int]] = {}
    observed: str | None = None
    if context.cursor:
        try:
            requested, observed = _read_cursor(context.cursor)
        except ValueError as exc:
            # The cursor only saves asking twice and observing twice: starting afresh is safe
            # (a run moves marks forward only), so an edited cursor costs one extra run.
            context.log.warning(f"{exc}; starting from an empty cursor")

    async def read() -> Overview:
        async with etcd.connect() as (kv, keys):
            return await read_overview(kv, keys)

    overview = asyncio.run(read())
    due, outstanding = marks_to_request(overview, requested, now_ms())
    digest = topics_version(overview)
    events = [] if digest == observed else [topics_observation(overview)]
    runs = []
    if due:
        topics = [d.topic for d in due]
        runs.append(
            RunRequest(
                # The same marks asked for again (a cursor lost) do not start a second run.
                run_key=hashlib.sha256(
                    "|".join(f"{d.topic}@{d.mark}" for d in due).encode()
                ).hexdigest()[:32],
                run_config={"ops": {"wal_prune_marks": {"config": {"topics": topics}}}},
                tags={"danube/topics": ",".join(topics)[:200]},
            )
        )
    context.log.info(
        f"prune marks topics={len(overview.topics)} due={len(due)} "
        f"outstanding={len(outstanding)} observed={bool(events)}"
    )
    return SensorResult(
        run_requests=runs,
        asset_events=events,
        cursor=json.dumps(
            {
                "requested": {t: list(v) for t, v in sorted(outstanding.items())},
                "observed": digest,
            }
        ),
        skip_reason=None if runs else SkipReason("no topic's prune mark would move forward"),
    )


__all__ = [
    "MarkDecision",
    "PruneMarksConfig",
    "decide",
    "marks_to_request",
    "plan_marks",
    "prune_marks_job",
    "prune_marks_sensor",
    "update_prune_marks",
    "wal_prune_marks",
]
