"""The operator's rendition lifecycle: build a new rendition beside the active one, hand readers
over to it, and collect what no reader needs any more.

1. ``new_rendition`` creates the next rendition (``r{N+1}``, state ``building``) recording the
   current converter and the topic's current decode schema.
2. ``convert(..., rendition=...)`` fills it; ``renditions.activate`` hands readers over in one
   etcd transaction (refused while it is behind the table's frontier); the old active
   rendition becomes ``draining``.
3. ``collect`` removes, per table, the staging of dead runs older than a grace period
   (``commit.collect_staging``) and every ``draining`` rendition no reader holds
   (``renditions.collect_rendition``). A held rendition is skipped and reported, not an error:
   the next ``collect`` takes it. ``building`` renditions are never collected (a build may be
   under way; a rendition that was never activated is the operator's to activate or leave).

Everything here is safe to run at any time, concurrently with conversions and readers: the
functions it calls decide under compare-and-swaps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from danube_ingest.analytics.commit import collect_staging
from danube_ingest.analytics.convert import current_conversion
from danube_ingest.analytics.errors import RenditionHeldError
from danube_ingest.analytics.layout import DEFAULT_ROOT
from danube_ingest.analytics.records import RenditionRecord, TableKeys
from danube_ingest.analytics.renditions import collect_rendition, create_rendition, read_table
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.records import Records
from danube_ingest.objects.store import ObjectStore

__all__ = ["COLLECT_GRACE_S", "CollectResult", "collect", "new_rendition"]

log = logging.getLogger(__name__)

#: How old a dead run's staging must be before ``collect`` removes it. An hour (longer than
#: ``commit.STAGING_GRACE_S``) because the scheduled collection runs hourly and a Spark run
#: may wait that long in a cluster queue between its intent and its first staged file.
COLLECT_GRACE_S = 3600


@dataclass(frozen=True)
class CollectResult:
    """What one ``collect`` removed and what it left for later."""

    staging_runs: list[str] = field(default_factory=list)
    """Tokens of the dead runs whose staging was deleted."""
    collected: list[tuple[str, str]] = field(default_factory=list)
    """``(topic, rendition)`` of the renditions collected (files and partition records)."""
    files_deleted: int = 0
    """Files deleted from the collected renditions."""
    held: list[tuple[str, str]] = field(default_factory=list)
    """``(topic, rendition)`` of the draining renditions skipped because a reader holds them."""

    def counts(self) -> dict[str, int]:
        """The counts, as plain values (CLI output, Dagster metadata)."""
        return {
            "staging_runs_collected": len(self.staging_runs),
            "renditions_collected": len(self.collected),
            "rendition_files_deleted": self.files_deleted,
            "renditions_held": len(self.held),
        }


async def new_rendition(kv: KV, keys: Keys, topic: str) -> str:
    """Create the next rendition of ``topic``'s table (state ``building``, its frontier at the
    table's ``since``) for this converter and the topic's current decode schema; returns its
    name. ``RenditionError`` if the topic has no table yet (convert it once first)."""
    converter_version, schema_ref = await current_conversion(kv, keys, topic)
    return await create_rendition(kv, keys, topic, converter_version, schema_ref)


async def collect(
    kv: KV,
    keys: Keys,
    warehouse: ObjectStore,
    *,
    topic: str | None = None,
    staging_grace_s: float = COLLECT_GRACE_S,
    root: str = DEFAULT_ROOT,
    now_ms: int | None = None,
) -> CollectResult:
    """Collect the tables of ``topic`` (None: every topic's): the staging of runs that are over
    (no live intent, nothing committed left unpublished) and begun more than
    ``staging_grace_s`` before ``now_ms``, then every ``draining`` rendition that no reader
    holds. The active rendition and ``building`` ones are never touched; a held one is
    reported in ``held``. Idempotent."""
    if topic is None:
        topics = sorted(r.name for r in await Records(kv, keys).list_topics())
    else:
        topics = [topic]
    staging: list[str] = []
    collected: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    files = 0
    for name in topics:
        if await read_table(kv, keys, name) is None:
            continue
        staging += await collect_staging(
            kv, keys, warehouse, root, grace_s=staging_grace_s, now_ms=now_ms, topic=name
        )
        tables = TableKeys(keys, name)
        for entry in await kv.get_prefix(tables.renditions_prefix()):
            if not tables.is_rendition(entry.key):
                continue
            if RenditionRecord.decode(entry.value, entry.key).state != "draining":
                continue
            rendition = entry.key[len(tables.renditions_prefix()) :]
            try:
                files += await collect_rendition(kv, keys, name, rendition, warehouse, root)
            except RenditionHeldError as exc:
                log.info(
                    "rendition held, not collected topic=%s rendition=%s error=%s",
                    name,
                    rendition,
                    exc,
                )
                held.append((name, rendition))
                continue
            collected.append((name, rendition))
    log.info(
        "collection done topics=%d staging_runs=%d renditions=%d files=%d held=%d",
        len(topics),
        len(staging),
        len(collected),
        files,
        len(held),
    )
    return CollectResult(staging, collected, files, held)
