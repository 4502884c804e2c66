"""The run protocol: stage, commit each partition once, publish (definite output).

A conversion run (Materialize's definite collections + lakeFS's staged commits):

1. ``begin`` announces an intent ``intents/{token}`` (rendition, partitions, input revision)
   under a lease the run keeps alive while it works. The token is unique and starts with its
   creation time.
2. The run writes each partition's files under ``{root}_staging/{token}/`` (the final path's
   tail), with ``parquet.write_partition``.
3. ``commit_partition`` commits a partition with ONE compare-and-swap that creates
   ``renditions/{r}/parts/{start:020}`` (a ``PartitionCommit``: files, rows, offsets, input
   revision, converter version, token) if it is absent, the run's intent still exists and the
   rendition is not collected. The loser of a race (another run committed first) deletes its
   own staging files and reports ``"already"``.
4. The winner publishes: each staged file is copied to its final path (skipped when a file is
   there with the recorded size and CRC32C; the copy is atomic on every backend), the record
   is marked ``published``, then the staging copies are deleted.
5. ``advance_frontier`` moves the rendition's ``upper`` (and the table's, for the active
   rendition) over the contiguous published partitions.

Convergence: whatever step a run dies at, the next run or ``finish_published`` completes it. A
committed partition's staged files are kept until it is published, because ``collect_staging``
only removes the staging of tokens with no live intent, no unpublished commit, and older than
a grace period; and a run whose intent expired can no longer commit (the CAS checks it). So a
rerun, a crash at any point and concurrent runs end with the same files and one record.

Errors: ``CommitFailedError`` when the commit was definitely not applied;
``CommitStateUnknownError`` (from etcd) only when a timed-out transaction could not be settled
by re-reading the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Self

import crc32c

from danube_ingest.analytics.errors import CommitFailedError, PublishError
from danube_ingest.analytics.layout import (
    final_of_staging,
    parse_path,
    partition_end,
    staging_path,
    staging_prefix,
)
from danube_ingest.analytics.parquet import FileInfo
from danube_ingest.analytics.records import (
    CommittedFile,
    PartitionCommit,
    RenditionRecord,
    RunIntent,
    TableKeys,
    TableRecord,
)
from danube_ingest.errors import DanubeIngestError, ObjectNotFoundError
from danube_ingest.metadata.errors import CommitStateUnknownError, MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Get, KeyValue, Put
from danube_ingest.objects.store import ObjectStore
from danube_ingest.stoppoint import reached

__all__ = [
    "CommitOutcome",
    "Intent",
    "advance_frontier",
    "advance_since",
    "begin",
    "collect_staging",
    "commit_partition",
    "finish_published",
    "token_created_ms",
]

log = logging.getLogger(__name__)

#: Lease TTL of a run's intent: a crashed run's intent is gone this long after its last
#: keepalive, and its staging becomes collectable after the grace period.
INTENT_TTL_S = 30
#: How old a dead run's staging must be before it is collected. It must exceed the time
#: between ``begin`` and the first staged file, and the time a collector spends between its
#: listing and its deletes.
STAGING_GRACE_S = 900
#: CAS attempts of one commit when the rendition record keeps changing (a new hold bumps it).
_COMMIT_ATTEMPTS = 20


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def token_created_ms(token: str) -> int | None:
    """When the run of ``token`` began (tokens are ``{created_ms:013}-{random}``)."""
    head = token.split("-", 1)[0]
    return int(head) if head.isdigit() else None


class Intent:
    """A running conversion's intent; keeps its lease alive until ``close`` (or ``async
    with`` exits), which deletes the intent. Staged files stay until published or collected."""

    def __init__(
        self,
        kv: KV,
        tables: TableKeys,
        rendition: str,
        token: str,
        record: RunIntent,
        lease: int,
        ttl: int,
    ) -> None:
        self.kv = kv
        self.tables = tables
        self.topic = tables.topic
        self.rendition = rendition
        self.token = token
        self.record = record
        self.lease = lease
        self._task = asyncio.create_task(self._keepalive(ttl), name=f"intent-{token}")

    async def _keepalive(self, ttl: int) -> None:
        while True:
            await asyncio.sleep(max(ttl / 3, 0.2))
            try:
                await self.kv.refresh_lease(self.lease)
            except MetadataError as exc:
                # An expired intent makes every later commit of this run fail (it checks the
                # intent); nothing else is at stake, so log and keep trying while we can.
                log.warning(
                    "intent keepalive failed topic=%s token=%s error=%s",
                    self.topic,
                    self.token,
                    exc,
                )

    async def close(self) -> None:
        """Stop the keepalive and delete the intent (revoke its lease). Idempotent."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(DanubeIngestError):
            await self.kv.revoke_lease(self.lease)

    def staging_path(self, root: str, final: str) -> str:
        """Where this run stages the file to be published at ``final``."""
        return staging_path(root, self.token, final)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def begin(
    kv: KV,
    keys: Keys,
    topic: str,
    rendition: str,
    partitions: Sequence[int],
    input_revision: int,
    *,
    ttl: int = INTENT_TTL_S,
    now_ms: int | None = None,
) -> Intent:
    """Announce a run converting ``partitions`` (their starts) of ``rendition``; returns the
    ``Intent`` whose lease is kept alive until it is closed."""
    tables = TableKeys(keys, topic)
    created = _now_ms() if now_ms is None else now_ms
    token = f"{created:013d}-{uuid.uuid4().hex[:16]}"
    record = RunIntent(rendition, sorted(partitions), input_revision, created)
    lease = await kv.grant_lease(ttl)
    try:
        result = await kv.txn(
            [Compare(tables.rendition(rendition), "create", ">", 0)],
            [Put(tables.intent(token), record.encode(), lease)],
        )
    except BaseException:
        with contextlib.suppress(DanubeIngestError):
            await kv.revoke_lease(lease)
        raise
    if not result.succeeded:
        await kv.revoke_lease(lease)
        raise CommitFailedError(
            f"cannot begin a run of {topic} rendition {rendition}: the rendition does not exist; "
            "create it first"
        )
    log.info(
        "run intent topic=%s rendition=%s token=%s partitions=%d input_revision=%d",
        topic,
        rendition,
        token,
        len(partitions),
        input_revision,
    )
    return Intent(kv, tables, rendition, token, record, lease, ttl)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """What ``commit_partition`` did."""

    status: Literal["committed", "already"]
    """``committed``: this run's commit; ``already``: another run had committed it."""
    record: PartitionCommit
    """The partition's record as stored (the other run's when ``already``)."""


async def commit_partition(
    intent: Intent,
    store: ObjectStore,
    root: str,
    start_ms: int,
    width_s: int,
    files: Sequence[FileInfo],
    converter_version: str,
    *,
    now_ms: int | None = None,
) -> CommitOutcome:
    """Commit one partition staged by ``intent`` (``files`` from ``write_partition`` under
    the run's staging; none for an empty partition), then publish it.

    Exactly one run's record is ever stored for a partition. ``already``: this run's staged
    files were deleted. Raises ``CommitFailedError`` (nothing committed, staging deleted) if the
    intent expired or the rendition was collected, ``CommitStateUnknownError`` if etcd timed out
    and re-reading could not tell whether the commit applied (run again: it re-reads).
    """
    kv, tables = intent.kv, intent.tables
    end_ms = partition_end(start_ms, width_s)
    record = PartitionCommit(
        start_ms=start_ms,
        end_ms=end_ms,
        files=[
            _committed(root, intent.token, f) for f in sorted(files, key=lambda f: f.first_offset)
        ],
        rows=sum(f.rows for f in files),
        first_offset=min((f.first_offset for f in files), default=-1),
        last_offset=max((f.last_offset for f in files), default=-1),
        input_revision=intent.record.input_revision,
        converter_version=converter_version,
        token=intent.token,
        committed_ms=_now_ms() if now_ms is None else now_ms,
        published=not files,
    )
    part_key = tables.part(intent.rendition, start_ms)
    rendition_key = tables.rendition(intent.rendition)
    for _ in range(_COMMIT_ATTEMPTS):
        seen = await kv.get(rendition_key)
        state = None if seen is None else RenditionRecord.decode(seen.value, rendition_key).state
        if state in (None, "collected"):
            await _delete_staged(store, files)
            raise CommitFailedError(
                f"commit of {intent.topic} partition {start_ms} rendition {intent.rendition} "
                "failed: the rendition was collected; convert into the active rendition"
            )
        try:
            result = await kv.txn(
                [
                    Compare.absent(part_key),
                    Compare(tables.intent(intent.token), "create", ">", 0),
                    Compare.unchanged(rendition_key, seen),
                ],
                [Put(part_key, record.encode())],
                [Get(part_key), Get(tables.intent(intent.token))],
            )
        except CommitStateUnknownError:
            stored = await kv.get(part_key)
            if stored is None:
                continue  # not applied (yet): the same CAS cannot apply twice, so retry it
            return await _settle(intent, store, root, files, stored)
        if result.succeeded:
            reached("convert.committed")
            stored = await kv.get(part_key)
            assert (
                stored is not None
            )  # created by this very transaction, never deleted but by collection
            return await _settle(intent, store, root, files, stored)
        existing = result.kv(0)
        if existing is not None:
            return await _settle(intent, store, root, files, existing)
        if result.kv(1) is None:
            await _delete_staged(store, files)
            raise CommitFailedError(
                f"commit of {intent.topic} partition {start_ms} failed: the intent of run "
                f"{intent.token} expired (its keepalive stopped); run the conversion again"
            )
    raise CommitFailedError(
        f"commit of {intent.topic} partition {start_ms} failed: rendition {intent.rendition} "
        f"changed during {_COMMIT_ATTEMPTS} attempts; retry",
        retriable=True,
    )


def _by_offset(files: Sequence[FileInfo]) -> list[FileInfo]:
    return sorted(files, key=lambda f: f.first_offset)


def _committed(root: str, token: str, info: FileInfo) -> CommittedFile:
    final = final_of_staging(root, info.path)
    if staging_path(root, token, final) != info.path:
        raise ValueError(f"{info.path!r} was not staged by run {token}")
    return CommittedFile(
        final,
        info.size,
        info.rows,
        info.first_offset,
        info.last_offset,
        info.crc32c,
        info.dead_letters,
    )


async def _settle(
    intent: Intent,
    store: ObjectStore,
    root: str,
    files: Sequence[FileInfo],
    stored: KeyValue,
) -> CommitOutcome:
    record = PartitionCommit.decode(stored.value, stored.key)
    if record.token != intent.token:
        await _delete_staged(store, files)
        if not record.published:
            # Its run may have died before publishing: finish it (idempotent if it has not).
            record = await publish(intent.kv, intent.tables, store, root, intent.rendition, stored)
        log.info(
            "partition already committed topic=%s rendition=%s start_ms=%d token=%s winner=%s",
            intent.topic,
            intent.rendition,
            record.start_ms,
            intent.token,
            record.token,
        )
        return CommitOutcome("already", record)
    log.info(
        "partition committed topic=%s rendition=%s start_ms=%d rows=%d first=%d last=%d token=%s",
        intent.topic,
        intent.rendition,
        record.start_ms,
        record.rows,
        record.first_offset,
        record.last_offset,
        intent.token,
    )
    record = await publish(intent.kv, intent.tables, store, root, intent.rendition, stored)
    return CommitOutcome("committed", record)


async def _delete_staged(store: ObjectStore, files: Sequence[FileInfo]) -> None:
    for info in files:
        await store.delete(info.path)


async def _matches(store: ObjectStore, path: str, size: int, crc: int) -> bool:
    if await store.size(path) != size:
        return False
    return crc32c.crc32c(await store.get(path)) == crc


async def publish(
    kv: KV,
    tables: TableKeys,
    store: ObjectStore,
    root: str,
    rendition: str,
    stored: KeyValue,
) -> PartitionCommit:
    """Publish a committed partition (idempotent): copy each file from its run's staging to
    its final path unless it is there already, mark the record published, delete the staging
    copies. ``PublishError`` if a file is neither at its final path nor staged intact."""
    record = PartitionCommit.decode(stored.value, stored.key)
    staged = [staging_path(root, record.token, f.path) for f in record.files]
    if not record.published:
        for info, source in zip(record.files, staged, strict=True):
            if await _matches(store, info.path, info.size, info.crc32c):
                continue
            try:
                data = await store.get(source)
            except ObjectNotFoundError:
                data = b""
            if len(data) != info.size or crc32c.crc32c(data) != info.crc32c:
                # A concurrent publisher copies the file before it deletes the staging copy.
                if await _matches(store, info.path, info.size, info.crc32c):
                    continue
                raise PublishError(
                    f"cannot publish {info.path} of {tables.topic} rendition {rendition}: it is "
                    f"not there and its staging copy {source} is missing or does not match its "
                    f"recorded size {info.size} and CRC32C {info.crc32c:08x}; reconvert the "
                    "partition into a new rendition"
                )
            await store.put_large(info.path, [data])
        record = await _mark_published(kv, stored, record)
    for source in staged:
        await store.delete(source)
    return record


async def _mark_published(kv: KV, stored: KeyValue, record: PartitionCommit) -> PartitionCommit:
    done = replace(record, published=True)
    seen: KeyValue | None = stored
    while seen is not None:
        current = PartitionCommit.decode(seen.value, seen.key)
        if current.published:
            return current
        try:
            result = await kv.txn(
                [Compare.unchanged(seen.key, seen)], [Put(seen.key, done.encode())], [Get(seen.key)]
            )
        except CommitStateUnknownError:
            seen = await kv.get(stored.key)
            continue
        if result.succeeded:
            return done
        seen = result.kv(0)
    # The record was deleted meanwhile: only collection of the rendition deletes it.
    raise CommitFailedError(f"{stored.key} disappeared while it was being published")


async def _get_many(kv: KV, keys: Sequence[str]) -> list[KeyValue | None]:
    """Each key's current value, 64 per transaction (etcd allows 128 ops per branch)."""
    found: list[KeyValue | None] = []
    for at in range(0, len(keys), 64):
        result = await kv.txn([], [Get(k) for k in keys[at : at + 64]])
        found.extend(result.kv(i) for i in range(len(result.responses)))
    return found


async def _staged_runs(
    store: ObjectStore, root: str, topic: str | None = None
) -> dict[str, tuple[list[str], set[tuple[str, str, int]]]]:
    """Per token in the warehouse's staging: its staged keys and the (topic, rendition,
    partition start) they belong to. Keys that do not parse are logged and left out."""
    runs: dict[str, tuple[list[str], set[tuple[str, str, int]]]] = {}
    for key in await store.list(staging_prefix(root)):
        try:
            parsed = parse_path(root, key)
        except ValueError:
            log.warning("unknown staged object left alone key=%s", key)
            continue
        assert parsed.token is not None
        if topic is not None and parsed.topic != topic:
            continue
        staged, partitions = runs.setdefault(parsed.token, ([], set()))
        staged.append(key)
        partitions.add((parsed.topic, parsed.rendition, parsed.start_ms))
    return runs


async def finish_published(
    kv: KV, keys: Keys, topic: str, store: ObjectStore, root: str
) -> list[PartitionCommit]:
    """Publish every committed but unpublished partition of the topic from its run's staging,
    then advance the frontiers of the renditions it touched. Returns what it published. Safe to
    run at any time, concurrently with runs.

    An unpublished commit always has its staging (collection keeps it), so the commits to look
    at are found from the staging listing: the cost follows the staging, not the table's age.
    """
    tables = TableKeys(keys, topic)
    candidates = sorted(
        {
            (rendition, start)
            for _, (_, partitions) in (await _staged_runs(store, root, topic)).items()
            for _, rendition, start in partitions
        }
    )
    stored = await _get_many(kv, [tables.part(r, s) for r, s in candidates])
    done: list[PartitionCommit] = []
    touched: set[str] = set()
    for (rendition, _), entry in zip(candidates, stored, strict=True):
        if entry is None:
            continue
        record = PartitionCommit.decode(entry.value, entry.key)
        touched.add(rendition)
        if record.published:
            continue
        done.append(await publish(kv, tables, store, root, rendition, entry))
        log.info(
            "partition published on recovery topic=%s rendition=%s start_ms=%d token=%s",
            topic,
            rendition,
            record.start_ms,
            record.token,
        )
    for rendition in sorted(touched):
        await advance_frontier(kv, keys, topic, rendition)
    return done


async def advance_frontier(kv: KV, keys: Keys, topic: str, rendition: str) -> int:
    """Move ``rendition``'s ``upper`` over its contiguous published partitions, and the
    table's ``upper`` with it when the rendition is active; returns the rendition's upper.
    Frontiers only move forward (CAS; a concurrent advance is re-read). Reads only the
    partitions it moves over (plus one)."""
    tables = TableKeys(keys, topic)
    table_key, rendition_key = tables.table(), tables.rendition(rendition)
    while True:
        read = await kv.txn([], [Get(table_key), Get(rendition_key)])
        table_kv, rendition_kv = read.kv(0), read.kv(1)
        if table_kv is None or rendition_kv is None:
            raise CommitFailedError(f"{topic} has no table or no rendition {rendition}")
        table = TableRecord.decode(table_kv.value, table_key)
        current = RenditionRecord.decode(rendition_kv.value, rendition_key)
        if current.state == "collected":
            return current.upper_ms
        upper = max(current.upper_ms, table.since_ms)
        # Commits are only created and marked published (collection, which deletes them,
        # changes the rendition record first, failing the CAS below), so reading them one
        # batch at a time needs no snapshot.
        while True:
            starts = [upper]
            for _ in range(63):
                starts.append(partition_end(starts[-1], table.width_s))
            found = await _get_many(kv, [tables.part(rendition, s) for s in starts])
            moved = 0
            for entry in found:
                if entry is None or not PartitionCommit.decode(entry.value, entry.key).published:
                    break
                moved += 1
            upper = partition_end(starts[moved - 1], table.width_s) if moved else upper
            if moved < len(starts):
                break
        puts = []
        if upper > current.upper_ms:
            puts.append(Put(rendition_key, replace(current, upper_ms=upper).encode()))
        if table.active == rendition and upper > table.upper_ms:
            puts.append(Put(table_key, replace(table, upper_ms=upper).encode()))
        if not puts:
            return current.upper_ms
        try:
            result = await kv.txn(
                [
                    Compare.unchanged(table_key, table_kv),
                    Compare.unchanged(rendition_key, rendition_kv),
                ],
                puts,
            )
        except CommitStateUnknownError:
            continue  # re-read: an applied advance is seen, an unapplied one is redone
        if result.succeeded:
            log.info("frontier advanced topic=%s rendition=%s upper_ms=%d", topic, rendition, upper)
            return upper


async def advance_since(kv: KV, keys: Keys, topic: str, since_ms: int) -> TableRecord:
    """Move the table's ``since`` forward to ``since_ms`` (a partition start, at most the
    table's ``upper``); a ``since`` already at or past it is left alone. Returns the record."""
    tables = TableKeys(keys, topic)
    key = tables.table()
    while True:
        stored = await kv.get(key)
        if stored is None:
            raise CommitFailedError(f"{topic} has no table")
        table = TableRecord.decode(stored.value, key)
        partition_end(since_ms, table.width_s)
        if since_ms <= table.since_ms:
            return table
        if since_ms > table.upper_ms:
            raise CommitFailedError(
                f"cannot move since of {topic} to {since_ms}: past its upper {table.upper_ms}"
            )
        moved = replace(table, since_ms=since_ms)
        try:
            result = await kv.txn([Compare.unchanged(key, stored)], [Put(key, moved.encode())])
        except CommitStateUnknownError:
            continue
        if result.succeeded:
            return moved


async def collect_staging(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    root: str,
    *,
    grace_s: float = STAGING_GRACE_S,
    now_ms: int | None = None,
    topic: str | None = None,
) -> list[str]:
    """Delete the staging of runs that are over: no live intent, no committed-but-unpublished
    partition, and begun more than ``grace_s`` ago (only ``topic``'s runs if given). Returns
    the tokens collected. Staged keys that do not parse are left alone (and logged). Reads only
    the records the staged files name (their intents and partition commits)."""
    now = _now_ms() if now_ms is None else now_ms
    collected = []
    for token, (staged, partitions) in sorted((await _staged_runs(store, root, topic)).items()):
        created = token_created_ms(token)
        if created is None or now - created < grace_s * 1000:
            continue
        ordered = sorted(partitions)
        topics = sorted({t for t, _, _ in ordered})
        # Intents first: an intent absent now can never commit again (its CAS checks it), so
        # the commits read afterwards are all the commits the token will ever have.
        intents = await _get_many(kv, [TableKeys(keys, t).intent(token) for t in topics])
        if any(i is not None for i in intents):
            continue
        commits = await _get_many(kv, [TableKeys(keys, t).part(r, s) for t, r, s in ordered])
        if any(
            c is not None
            and (r := PartitionCommit.decode(c.value, c.key)).token == token
            and not r.published
            for c in commits
        ):
            continue
        for key in staged:
            await store.delete(key)
        collected.append(token)
        log.info("staging collected token=%s files=%d", token, len(staged))
    return collected
