"""One round of keeping tables fresh: each topic's tail extended, and published when it moved.

What the Dagster sensor ``iceberg_tail_sensor`` does on each tick, and ``danube-ingest tables
follow`` in a loop (``tail.py`` says what a tail is). A failure of one topic (``TailError``,
``IcebergPublishError``) is reported and does not stop the others; the next round tries again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from danube_ingest.analytics.checks import topics_with_manifest
from danube_ingest.analytics.iceberg import IcebergPublishError, IcebergTarget, publish
from danube_ingest.analytics.tail import TailError, TailStep, extend_tail
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.objects.store import ObjectStore

__all__ = ["TailRound", "tail_round"]


@dataclass
class TailRound:
    """What one round did."""

    steps: list[TailStep] = field(default_factory=list)
    """One per topic with a table, in topic order."""
    problems: list[str] = field(default_factory=list)
    """``topic: error`` of each topic whose step or publish failed."""

    @property
    def moved(self) -> list[TailStep]:
        """The steps that added or dropped pieces (their tables were published)."""
        return [s for s in self.steps if s.added or s.dropped]


async def tail_round(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    target: IcebergTarget,
    *,
    root: str,
    step_s: float,
    topics: list[str] | None = None,
) -> TailRound:
    """Extend the tail of each of ``topics`` (None: every topic with a manifest), creating
    tables that do not exist yet, and publish each table whose tail moved."""
    done = TailRound()
    for topic in topics if topics is not None else await topics_with_manifest(kv, keys):
        try:
            step = await extend_tail(
                kv,
                keys,
                topic,
                store,
                store,
                root=root,
                step_s=step_s,
                create=True,
                dead_letters=target.dead_letters,
            )
            if step is not None and step.recorded and (step.added or step.dropped):
                await publish(kv, keys, topic, target)
        except (TailError, IcebergPublishError) as exc:
            done.problems.append(f"{topic}: {exc}")
            continue
        if step is not None:
            done.steps.append(step)
    return done
