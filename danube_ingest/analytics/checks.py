"""What the control plane checks about a topic's tables, without Dagster.

* :func:`topics_with_manifest` - the reliable topics that have objects in the manifest: the
  topics a table can be made of. (Which of a table's partitions exist, are complete or are
  pending: ``preflight.table_starts``, ``preflight.preflight`` and
  ``convert.pending_partitions``.)

Checks (each returns :class:`CheckFinding`\\ s, empty when the table is sound; they read etcd and
the warehouse now and change nothing):

* :func:`check_rows` - each committed partition's ``rows`` equals the rows of its files'
  Parquet footers and the entries the manifest holds in its offset range.
* :func:`check_contiguity` - the committed partitions of the active rendition leave no gap from
  the table's ``since`` up to its ``upper``.
* :func:`check_files` - every committed file exists in the warehouse with its recorded size, and
  (for files up to ``crc_max_bytes``) its recorded CRC32C.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c
import pyarrow.parquet as pq

from danube_ingest.analytics.records import PartitionCommit, TableKeys, TableRecord
from danube_ingest.analytics.renditions import read_table
from danube_ingest.errors import ObjectNotFoundError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.records import Records
from danube_ingest.objects.store import ObjectStore

__all__ = [
    "CheckFinding",
    "check_contiguity",
    "check_files",
    "check_rows",
    "committed_parts",
    "topics_with_manifest",
]

log = logging.getLogger(__name__)

#: Files up to this size are read whole to compare their CRC32C; larger ones are checked by
#: size only, so a check over a long table stays cheap (a 512 MiB file is not fetched).
CRC_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class CheckFinding:
    """One thing wrong with a table, named so an operator can act on it."""

    topic: str
    start_ms: int
    """The partition concerned (its start)."""
    problem: str
    """What is wrong and what to do."""


async def topics_with_manifest(kv: KV, keys: Keys) -> list[str]:
    """The reliable topics with at least one object range in the manifest, in name order."""
    found = []
    for record in await Records(kv, keys).list_topics():
        if not record.reliable:
            continue
        if await kv.get_prefix(keys.storage_objects_prefix(record.name)):
            found.append(record.name)
    return found


async def committed_parts(
    kv: KV, keys: Keys, topic: str
) -> tuple[TableRecord | None, list[PartitionCommit]]:
    """The table record and the partition commits of its active rendition, in start order
    (``(None, [])`` without a table, ``(table, [])`` before a rendition is active)."""
    table = await read_table(kv, keys, topic)
    if table is None or table.active is None:
        return table, []
    prefix = TableKeys(keys, topic).parts_prefix(table.active)
    commits = [PartitionCommit.decode(e.value, e.key) for e in await kv.get_prefix(prefix)]
    return table, sorted(commits, key=lambda c: c.start_ms)


def _manifest_entries(ranges: Sequence[ObjectRange], first: int, last: int) -> int | None:
    """Entries the manifest holds at offsets ``[first, last]``; ``None`` when a range that
    only partly overlaps them has offsets without entries (then only its footer could tell)."""
    total = 0
    for r in ranges:
        low, high = max(r.start_offset, first), min(r.end_offset, last + 1)
        if low >= high:
            continue
        if low == r.start_offset and high == r.end_offset:
            total += r.entries
        elif r.entries == r.end_offset - r.start_offset:
            total += high - low
        else:
            return None
    return total


async def check_rows(kv: KV, keys: Keys, warehouse: ObjectStore, topic: str) -> list[CheckFinding]:
    """Each committed partition's rows equal its files' Parquet footers and the manifest's
    entries in its offset range (a file that cannot be read is reported by :func:`check_files`
    and here as unreadable)."""
    _, commits = await committed_parts(kv, keys, topic)
    ranges = await Manifest(kv, keys).ranges(topic)
    findings = []
    for commit in commits:

        def finding(problem: str, commit: PartitionCommit = commit) -> CheckFinding:
            return CheckFinding(topic, commit.start_ms, problem)

        footer_rows = 0
        for f in commit.files:
            try:
                footer_rows += await _footer_rows(warehouse, f.path, f.size)
            except (ObjectNotFoundError, OSError, ValueError) as exc:
                findings.append(finding(f"file {f.path} has no readable Parquet footer: {exc}"))
                footer_rows = -1
                break
        if footer_rows >= 0 and footer_rows != commit.rows:
            findings.append(
                finding(
                    f"the commit records {commit.rows} rows, its files' footers hold "
                    f"{footer_rows}: reconvert the partition into a new rendition"
                )
            )
        if commit.rows == 0:
            continue
        expected = _manifest_entries(ranges, commit.first_offset, commit.last_offset)
        if expected is not None and expected != commit.rows:
            findings.append(
                finding(
                    f"the commit records {commit.rows} rows for offsets "
                    f"{commit.first_offset}..{commit.last_offset}, the manifest holds "
                    f"{expected} entries there: reconvert the partition into a new rendition"
                )
            )
    return findings


async def _footer_rows(store: ObjectStore, path: str, size: int) -> int:
    """Rows in the Parquet footer of ``path`` (reads the footer's tail, then the footer)."""
    actual = await store.size(path)
    if actual is None:
        raise ObjectNotFoundError(f"{path} is missing")
    if actual < 12:
        raise ValueError(f"{path} is {actual} bytes, too short for Parquet")
    tail = await store.get_range(path, actual - 8, 8)
    if tail[4:] != b"PAR1":
        raise ValueError(f"{path} does not end with the Parquet magic (truncated?)")
    length = int.from_bytes(tail[:4], "little")
    if length + 8 > actual:
        raise ValueError(f"{path}: footer length {length} exceeds the file")
    footer = await store.get_range(path, actual - 8 - length, length + 8)
    return int(pq.read_metadata(io.BytesIO(b"PAR1" + footer)).num_rows)


async def check_contiguity(kv: KV, keys: Keys, topic: str) -> list[CheckFinding]:
    """The active rendition has a published commit for every partition in the table's
    ``[since, upper)``, and each starts where the previous one ended."""
    table, commits = await committed_parts(kv, keys, topic)
    if table is None or table.active is None:
        return []
    findings = []
    expected = table.since_ms
    for commit in commits:
        if commit.end_ms <= table.since_ms or commit.start_ms >= table.upper_ms:
            continue
        if commit.start_ms != expected:
            findings.append(
                CheckFinding(
                    topic,
                    expected,
                    f"no committed partition in [{expected}, {commit.start_ms}) below the "
                    f"table's upper {table.upper_ms}: convert it again (the frontier skipped it)",
                )
            )
        if not commit.published:
            findings.append(
                CheckFinding(
                    topic,
                    commit.start_ms,
                    "committed below the table's upper but not published: run a conversion "
                    "(it publishes committed partitions)",
                )
            )
        expected = commit.end_ms
    if expected < table.upper_ms:
        findings.append(
            CheckFinding(
                topic,
                expected,
                f"no committed partition in [{expected}, {table.upper_ms}) below the table's "
                "upper: convert it again (the frontier skipped it)",
            )
        )
    return findings


async def check_files(
    kv: KV, keys: Keys, warehouse: ObjectStore, topic: str, *, crc_max_bytes: int = CRC_MAX_BYTES
) -> list[CheckFinding]:
    """Every file of a published commit exists in ``warehouse`` with its recorded size, and its
    recorded CRC32C when it is at most ``crc_max_bytes``."""
    _, commits = await committed_parts(kv, keys, topic)
    findings = []
    for commit in commits:
        if not commit.published:
            continue  # its files may still be in staging; check_contiguity reports it
        for f in commit.files:
            size = await warehouse.size(f.path)
            problem = None
            if size is None:
                problem = f"file {f.path} is missing"
            elif size != f.size:
                problem = f"file {f.path} is {size} bytes, its commit records {f.size}"
            elif size <= crc_max_bytes and crc32c.crc32c(await warehouse.get(f.path)) != f.crc32c:
                problem = f"file {f.path} does not match its recorded CRC32C {f.crc32c:#010x}"
            if problem is not None:
                findings.append(
                    CheckFinding(
                        topic,
                        commit.start_ms,
                        f"{problem}: reconvert the partition into a new rendition",
                    )
                )
    return findings
