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

4. ``expire_partitions`` applies a table's retention (the ``table_max_age_ms`` of the topic's
   retention policy, :mod:`danube_ingest.metadata.policies`): the table's ``since`` moves
   forward to the partition holding ``now - table_max_age`` (``commit.advance_since``, never
   past ``upper``), then the published partitions wholly below ``since`` lose their files and
   their commit records in every rendition no reader holds (a held one is skipped and
   reported; the next run takes it).

Everything here is safe to run at any time, concurrently with conversions and readers: the
functions it calls decide under compare-and-swaps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from danube_ingest.analytics.commit import advance_since, collect_staging
from danube_ingest.analytics.convert import current_conversion
from danube_ingest.analytics.errors import RenditionHeldError
from danube_ingest.analytics.iceberg import IcebergTarget, held_keys, publish
from danube_ingest.analytics.layout import (
    DEFAULT_ROOT,
    partition_end,
    partition_start,
    topic_prefix,
)
from danube_ingest.analytics.records import HoldRecord, PartitionCommit, RenditionRecord, TableKeys
from danube_ingest.analytics.renditions import collect_rendition, create_rendition, read_table
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Delete
from danube_ingest.metadata.policies import Policies, RetentionPolicy, effective
from danube_ingest.metadata.records import Records
from danube_ingest.objects.store import ObjectStore

__all__ = [
    "COLLECT_GRACE_S",
    "CollectResult",
    "ExpireResult",
    "collect",
    "expire_partitions",
    "new_rendition",
]

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
    files_kept: int = 0
    """Files of the collected renditions left in place because an Iceberg snapshot still
    holds them (``iceberg.maintain`` deletes them once none does)."""

    def counts(self) -> dict[str, int]:
        """The counts, as plain values (CLI output, Dagster metadata)."""
        return {
            "staging_runs_collected": len(self.staging_runs),
            "renditions_collected": len(self.collected),
            "rendition_files_deleted": self.files_deleted,
            "renditions_held": len(self.held),
            "rendition_files_kept": self.files_kept,
        }


async def new_rendition(kv: KV, keys: Keys, topic: str, *, dead_letters: bool = False) -> str:
    """Create the next rendition of ``topic``'s table (state ``building``, its frontier at the
    table's ``since``) for this converter and the topic's current decode schema (and
    ``dead_letters``: rows that do not decode kept apart); returns its name.
    ``RenditionError`` if the topic has no table yet (convert it once first)."""
    converter_version, schema_ref = await current_conversion(kv, keys, topic)
    return await create_rendition(
        kv, keys, topic, converter_version, schema_ref, dead_letters=dead_letters
    )


async def collect(
    kv: KV,
    keys: Keys,
    warehouse: ObjectStore,
    *,
    topic: str | None = None,
    staging_grace_s: float = COLLECT_GRACE_S,
    root: str = DEFAULT_ROOT,
    now_ms: int | None = None,
    iceberg: IcebergTarget | None = None,
) -> CollectResult:
    """Collect the tables of ``topic`` (None: every topic's): the staging of runs that are over
    (no live intent, nothing committed left unpublished) and begun more than
    ``staging_grace_s`` before ``now_ms``, then every ``draining`` rendition that no reader
    holds. The active rendition and ``building`` ones are never touched; a held one is
    reported in ``held``. Idempotent. With ``iceberg``, a table with a draining rendition is
    published to the catalog first, so its current snapshot no longer names that rendition's
    files when they go (``IcebergPublishError``: nothing of that table is collected); tables
    without one need no catalog work."""
    if topic is None:
        topics = sorted(r.name for r in await Records(kv, keys).list_topics())
    else:
        topics = [topic]
    staging: list[str] = []
    collected: list[tuple[str, str]] = []
    held: list[tuple[str, str]] = []
    files = kept = 0
    for name in topics:
        if await read_table(kv, keys, name) is None:
            continue
        tables = TableKeys(keys, name)
        draining = [
            entry.key[len(tables.renditions_prefix()) :]
            for entry in await kv.get_prefix(tables.renditions_prefix())
            if tables.is_rendition(entry.key)
            and RenditionRecord.decode(entry.value, entry.key).state == "draining"
        ]
        keep: set[str] = set()
        if iceberg is not None and draining:
            # Only a draining rendition's files may still be named by the Iceberg table: its
            # current snapshot stops naming them here; older snapshots (time travel, a query
            # that began before the handover) keep theirs until iceberg.maintain expires them.
            await publish(kv, keys, name, iceberg)
            keep = await held_keys(iceberg, name)
        staging += await collect_staging(
            kv, keys, warehouse, root, grace_s=staging_grace_s, now_ms=now_ms, topic=name
        )
        for rendition in draining:
            try:
                files += await collect_rendition(
                    kv, keys, name, rendition, warehouse, root, keep=keep
                )
                kept += sum(1 for k in keep if k.startswith(topic_prefix(root, rendition, name)))
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
    return CollectResult(staging, collected, files, held, kept)


@dataclass
class ExpireResult:
    """What one ``expire_partitions`` run moved and deleted."""

    since: dict[str, int] = field(default_factory=dict)
    """Topic -> its table's ``since`` after the run, for tables with a ``table_max_age``."""
    partitions: list[tuple[str, str, int]] = field(default_factory=list)
    """``(topic, rendition, start_ms)`` of the partitions whose files were deleted."""
    files_deleted: int = 0
    bytes_deleted: int = 0
    held: list[tuple[str, str]] = field(default_factory=list)
    """``(topic, rendition)`` skipped because a reader holds them."""


async def expire_partitions(
    kv: KV,
    keys: Keys,
    warehouse: ObjectStore,
    *,
    default: RetentionPolicy | None = None,
    now_ms: int | None = None,
    iceberg: IcebergTarget | None = None,
) -> ExpireResult:
    """Apply every table's ``table_max_age_ms`` (topic's policy over its namespace's over
    ``default``) at ``now_ms`` (default: the wall clock); see the module docstring.
    Idempotent: a re-run at the same clock deletes nothing more. With ``iceberg``, the table is
    published to the catalog after ``since`` moves and before any file is deleted (its current
    snapshot then holds nothing below ``since``)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    stored = await Policies(kv, keys).all()
    base = default or RetentionPolicy()
    result = ExpireResult()
    for record in await Records(kv, keys).list_topics():
        max_age = effective(record.name, stored, base).table_max_age_ms
        table = None if max_age is None else await read_table(kv, keys, record.name)
        if max_age is None or table is None:
            continue
        since = min(partition_start(now - max_age, table.width_s), table.upper_ms)
        table = await advance_since(kv, keys, record.name, max(since, table.since_ms))
        result.since[record.name] = table.since_ms
        if iceberg is not None:
            await publish(kv, keys, record.name, iceberg)
        await _expire_below(kv, keys, warehouse, record.name, table.since_ms, table.width_s, result)
    log.info(
        "table retention done tables=%d partitions=%d files=%d bytes=%d held=%d",
        len(result.since),
        len(result.partitions),
        result.files_deleted,
        result.bytes_deleted,
        len(result.held),
    )
    return result


async def _expire_below(
    kv: KV,
    keys: Keys,
    warehouse: ObjectStore,
    topic: str,
    since: int,
    width_s: int,
    result: ExpireResult,
) -> None:
    tables = TableKeys(keys, topic)
    holds = [
        HoldRecord.decode(e.value, e.key).rendition
        for e in await kv.get_prefix(tables.holds_prefix())
    ]
    for entry in await kv.get_prefix(tables.renditions_prefix()):
        if not tables.is_rendition(entry.key):
            continue
        rendition = entry.key[len(tables.renditions_prefix()) :]
        if RenditionRecord.decode(entry.value, entry.key).state == "collected":
            continue
        below = []
        for part in await kv.get_prefix(tables.parts_prefix(rendition)):
            commit = PartitionCommit.decode(part.value, part.key)
            if commit.published and partition_end(commit.start_ms, width_s) <= since:
                below.append((part, commit))
        if not below:
            continue
        if rendition in holds:
            result.held.append((topic, rendition))
            continue
        for part, commit in below:
            # Files first: a run that dies half-way leaves the record, and the next deletes
            # the rest. Readers never read below since, so nobody misses them.
            for file in commit.files:
                await warehouse.delete(file.path)
                result.files_deleted += 1
                result.bytes_deleted += file.size
            await kv.txn([Compare.unchanged(part.key, part)], [Delete(part.key)])
            result.partitions.append((topic, rendition, commit.start_ms))
            log.info(
                "table partition expired topic=%s rendition=%s start_ms=%d files=%d",
                topic,
                rendition,
                commit.start_ms,
                len(commit.files),
            )
