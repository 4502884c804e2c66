"""Orphan collection and the manifest integrity check (issue 13, run by Dagster and the CLI).

``collect_orphans``: an object under ``segments/``, ``topics/`` or the store's staging prefix
(``_staging/``) that no manifest entry names is an orphan; it is deleted once it is older than
a grace period. The warehouse (``warehouse/``) is never looked at: the analytics lifecycle
collects its own staging and renditions.

Why the grace period (default an hour): the uploader PUTs a segment object *before* committing
its manifest entries, ``put_large`` streams under ``_staging/`` before moving the object, and a
reader that opened an object before rotation replaced its entries must be able to finish. So
an orphan is due once the object is older than the grace period *and*, if a manifest change
retired it (a retirement record ``storage/retired/{key}``, written by rotation, retention and
topic deletion in the transaction that removed the entries), that retirement is older too.
An object the backend gives no modification time for (``memory``) is deleted only through a
retirement record older than the grace period; without one it is never deleted, only
reported. A deleted object's retirement record goes with it, as does a record whose object
is gone.

Guarantees:

* An object named by a manifest entry is never deleted: the manifest is read once before
  listing, and again right before each batch of deletions, so a commit that lands meanwhile
  keeps its object (counted in ``OrphanReport.rescued``).
* An object younger than the grace period, or retired more recently than that, is never
  deleted.
* ``dry_run`` deletes nothing and reports what would go.
* Idempotent: a second run finds nothing more to delete; a run that dies half-way leaves only
  orphans for the next one.

The uploader may hold a stored segment object for long before its commit lands (an etcd outage,
ranges waiting for their topic): it stores such an object again right before committing once
it is older than ``uploader.OBJECT_REFRESH_SECONDS`` (600 s), and the grace period must be at
least twice that (``MIN_GRACE_S``), so an object is never collected between being stored and
being committed.

``manifest_integrity``: every topic that has a manifest goes through
:func:`danube_ingest.objects.verify.verify_topic`. The check fails on every *problem* it reports:
of the objects (missing, of another size or CRC32C than recorded, a footer that disagrees, with
``deep`` a frame that does not decode) and of the ranges (overlapping or unreadable entries, a
gap no recorded offset jump covers). A new owner continues from its offset reservation and
records the offsets it skips (``metadata.jumps``) before assigning any above them, so a gap a
jump covers never existed as far as the manifest can know; any other gap is a range that was
acknowledged and never committed (an orphaned range in some broker's WAL) or was removed.
Gaps below the retained floor (retention) are not gaps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Delete
from danube_ingest.metadata.manifest import Manifest, ObjectRange, Retired, retired_objects
from danube_ingest.objects.store import STAGING_PREFIX, ObjectStore
from danube_ingest.objects.uploader import OBJECT_REFRESH_SECONDS
from danube_ingest.objects.verify import TopicReport, verify_topic

log = logging.getLogger(__name__)

#: Prefixes of the objects the daemon and rotation write (segment objects, rolling topic
#: objects); the staging prefix is added to them.
OBJECT_PREFIXES = ("segments/", "topics/")
#: An hour: far above an upload's PUT-to-commit time and a reader's time on one object.
DEFAULT_GRACE_S = 3600
#: The shortest grace allowed: the uploader stores a segment object again when its commit is
#: delayed past OBJECT_REFRESH_SECONDS, so an object awaiting its commit is never older than
#: that; twice it leaves room for the commit itself.
MIN_GRACE_S = 2 * OBJECT_REFRESH_SECONDS
#: Deletions between two reads of the manifest: small enough that a commit landing during a
#: run is seen within a few hundred milliseconds, large enough to keep etcd reads rare.
DELETE_BATCH = 100


@dataclass
class OrphanReport:
    """What one ``collect_orphans`` run found and did. Bytes are object sizes."""

    dry_run: bool
    grace_s: float
    referenced: int = 0
    """Distinct object keys named by the manifest."""
    candidates: int = 0
    """Objects listed under the collected prefixes."""
    kept: int = 0
    """Candidates the manifest names."""
    deleted: list[str] = field(default_factory=list)
    """Orphans deleted (with ``dry_run``: that would have been deleted)."""
    deleted_bytes: int = 0
    too_young: int = 0
    """Orphans younger than the grace period, kept."""
    too_young_bytes: int = 0
    no_time: list[str] = field(default_factory=list)
    """Orphans the backend gives no modification time for: kept, never deleted."""
    rescued: int = 0
    """Orphans a manifest commit named between the listing and their deletion: kept."""
    retired_recently: int = 0
    """Orphans (counted in ``too_young``) whose retirement is younger than the grace period."""
    records_dropped: int = 0
    """Retirement records removed: of deleted objects, and of objects already gone."""


async def referenced_objects(kv: KV, keys: Keys) -> dict[str, set[str]]:
    """Object key -> the topics whose manifest entries name it, from one prefix read.

    ``MetadataError`` naming the entry if one is malformed (nothing can be collected safely
    then: the entry's object is unknown).
    """
    found: dict[str, set[str]] = {}
    for stored in await kv.get_prefix(_manifests_prefix(keys)):
        if "/objects/" not in stored.key:
            continue  # the topic's ingest clock, not an entry
        entry = ObjectRange.decode(stored.value, stored.key)
        found.setdefault(entry.object_key, set()).add(entry.topic)
    return found


async def collect_orphans(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    now_ms: int | None = None,
    dry_run: bool = False,
) -> OrphanReport:
    """Delete the orphans older than ``grace_s`` seconds (see the module docstring).

    ``now_ms`` is the clock the ages are measured against (default: the wall clock).
    """
    if grace_s < MIN_GRACE_S:
        raise ValueError(
            f"grace_s must be at least {MIN_GRACE_S:.0f} s, twice the uploader's refresh age "
            f"of a stored segment object awaiting its commit (got {grace_s})"
        )
    now = int(time.time() * 1000) if now_ms is None else now_ms
    report = OrphanReport(dry_run=dry_run, grace_s=grace_s)
    referenced = await referenced_objects(kv, keys)
    report.referenced = len(referenced)
    candidates: list[str] = []
    for prefix in (*OBJECT_PREFIXES, STAGING_PREFIX):
        candidates += await store.list(prefix)
    report.candidates = len(candidates)
    retired = await retired_objects(kv, keys)
    grace_ms = grace_s * 1000
    due: list[tuple[str, int]] = []
    listed = set(candidates)
    for key in candidates:
        if key in referenced:
            report.kept += 1
            continue
        info = await store.stat(key)
        if info is None:
            continue  # gone since the listing (a staging object moved, another run)
        record = retired.get(key)
        if record is not None and now - record.retired_ms < grace_ms:
            report.too_young += 1
            report.too_young_bytes += info.size
            report.retired_recently += 1
        elif info.modified_ms is None and record is None:
            report.no_time.append(key)
            log.warning(
                "orphan kept: the store gives no modification time key=%s store=%s",
                key,
                store.description,
            )
        elif info.modified_ms is not None and now - info.modified_ms < grace_ms:
            report.too_young += 1
            report.too_young_bytes += info.size
        else:
            due.append((key, info.size))
    for start in range(0, len(due), DELETE_BATCH):
        await _delete_batch(kv, keys, store, due[start : start + DELETE_BATCH], retired, report)
    # Records of objects no longer stored (deleted by an earlier run that died before
    # dropping the record, or by hand) are dropped too.
    stale = [k for k in retired if k not in listed and await store.stat(k) is None]
    await _drop_records(kv, keys, stale, retired, report)
    log.info(
        "orphan collection done dry_run=%s store=%s candidates=%d referenced=%d deleted=%d "
        "bytes=%d too_young=%d no_time=%d rescued=%d",
        dry_run,
        store.description,
        report.candidates,
        report.kept,
        len(report.deleted),
        report.deleted_bytes,
        report.too_young,
        len(report.no_time),
        report.rescued,
    )
    return report


async def _delete_batch(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    batch: Sequence[tuple[str, int]],
    retired: dict[str, Retired],
    report: OrphanReport,
) -> None:
    # A commit may have landed since the first read: the manifest as it is now decides.
    referenced = await referenced_objects(kv, keys)
    deleted: list[str] = []
    for key, size in batch:
        if key in referenced:
            report.rescued += 1
            log.info("orphan rescued by a manifest commit key=%s", key)
            continue
        if not report.dry_run:
            await store.delete(key)
            log.info("orphan deleted key=%s bytes=%d", key, size)
        report.deleted.append(key)
        report.deleted_bytes += size
        deleted.append(key)
    await _drop_records(kv, keys, deleted, retired, report)


async def _drop_records(
    kv: KV, keys: Keys, objects: Sequence[str], retired: dict[str, Retired], report: OrphanReport
) -> None:
    """Delete the retirement records of ``objects`` (those that have one; none with
    ``dry_run``). Each is compared with the value read at the start of the run, so a record
    rewritten meanwhile (its object retired again by a later change) stays."""
    for key in objects:
        record = retired.get(key)
        if record is None or report.dry_run:
            continue
        stored = keys.storage_retired(key)
        done = await kv.txn([Compare.value_is(stored, record.encode())], [Delete(stored)])
        if done.succeeded:
            report.records_dropped += 1


@dataclass
class IntegrityReport:
    """``manifest_integrity``'s findings, one ``TopicReport`` per topic with a manifest."""

    topics: list[TopicReport]

    @property
    def problems(self) -> list[str]:
        """Every problem, prefixed with its topic; empty when the check passes."""
        return [f"{t.topic}: {p}" for t in self.topics for p in t.problems]

    @property
    def object_problems(self) -> list[str]:
        """Problems of the objects (missing, size, CRC32C, footer, frames), with their topic."""
        return [f"{t.topic}: {p}" for t in self.topics for p in t.object_problems]

    @property
    def range_problems(self) -> list[str]:
        """Problems of the ranges (unreadable or overlapping entries, unexplained gaps)."""
        return [f"{t.topic}: {p}" for t in self.topics for p in t.range_problems]

    @property
    def ranges(self) -> int:
        """Manifest ranges, over all topics."""
        return sum(t.ranges for t in self.topics)

    @property
    def gaps(self) -> int:
        """Gaps (between ranges, or from the floor to the first range), over all topics."""
        return sum(len(t.gaps) for t in self.topics)

    @property
    def unexplained_gaps(self) -> int:
        """The parts of gaps no recorded offset jump covers (each one a problem)."""
        return sum(len(t.unexplained) for t in self.topics)

    @property
    def jumps(self) -> int:
        """Recorded offset jumps, over all topics."""
        return sum(t.jumps for t in self.topics)

    @property
    def ok(self) -> bool:
        return not self.problems


async def manifest_integrity(
    kv: KV, keys: Keys, store: ObjectStore, *, deep: bool = False
) -> IntegrityReport:
    """Verify every topic that has manifest entries against its objects; changes nothing.

    Fails (``ok`` is False) on the problems listed in the module docstring, among them a gap
    no recorded offset jump covers.
    """
    manifest = Manifest(kv, keys)
    reports = [
        await verify_topic(manifest, store, topic, deep=deep)
        for topic in await _manifest_topics(kv, keys)
    ]
    result = IntegrityReport(reports)
    log.info(
        "manifest integrity topics=%d ranges=%d gaps=%d unexplained=%d jumps=%d problems=%d",
        len(reports),
        result.ranges,
        result.gaps,
        result.unexplained_gaps,
        result.jumps,
        len(result.problems),
    )
    return result


def _manifests_prefix(keys: Keys) -> str:
    return f"{keys.prefix}/storage/topics/"


async def _manifest_topics(kv: KV, keys: Keys) -> list[str]:
    """Topics with at least one manifest entry, from the keys (a malformed value is left for
    ``verify_topic`` to report)."""
    head = _manifests_prefix(keys)
    topics: set[str] = set()
    for stored in await kv.get_prefix(head):
        path, sep, _ = stored.key[len(head) :].partition("/objects/")
        if sep:
            topics.add(f"/{path}")
    return sorted(topics)


__all__ = [
    "DEFAULT_GRACE_S",
    "IntegrityReport",
    "OrphanReport",
    "collect_orphans",
    "manifest_integrity",
    "referenced_objects",
]
