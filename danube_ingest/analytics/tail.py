"""Tails: what a table will hold before its partition completes, visible by name at once.

A partition is committed only once the topic clock has passed its end (``plan.py``): with
hour-wide partitions that is up to an hour after ingest. The tail closes that gap. It is the
entries with an ingest time in ``[upper, frontier)``, where ``upper`` is the active rendition's
frontier (the first partition not committed) and ``frontier`` a multiple of the tail step
(``DEFAULT_STEP_S``, configurable down to 1 s) that the topic clock has passed, so every entry
below it is uploaded. ``extend_tail`` writes the entries of ``[tail end, frontier)`` as one
Parquet file per partition touched (a *piece*), records the pieces in the table's ``tail``
record in etcd with one compare-and-swap, and ``iceberg.publish`` appends them to the Iceberg
table: the table holds exactly the entries below ``frontier`` (its snapshot summary says so).

When the partition is committed (``convert``), its pieces are no longer wanted: the next
publish replaces them with the partition's file in one overwrite snapshot (same rows, now one
file: the compaction of the open partition's small files), and ``extend_tail`` drops them
from the record. Their files stay readable by older snapshots (time travel) until
``iceberg.maintain`` finds them referenced by no remaining snapshot nor by the record.

Pieces are written under ``{root}_tails/``, never under a rendition's directories, so readers
of the rendition's Parquet (``read_topic``) never see them. A piece is the same bytes for the
same window (the converter's deterministic writer); two followers racing write the same files
and one of them loses the compare-and-swap.

Errors: what ``convert`` raises for a missing or damaged object (``ConvertError``, retriable
when the store was unreachable); nothing is recorded for the step then, and the next step
writes the window again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from danube_ingest.analytics.columns import table_schema
from danube_ingest.analytics.errors import AnalyticsError
from danube_ingest.analytics.layout import partition_dir, partition_end, partition_start
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.plan import read_plan_input
from danube_ingest.analytics.records import (
    CommittedFile,
    RenditionRecord,
    TableKeys,
    TableRecord,
    _Record,
)
from danube_ingest.analytics.source import aread_part, plan_reads
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Get, Put
from danube_ingest.objects.store import ObjectStore

__all__ = [
    "DEFAULT_STEP_S",
    "TAILS_DIR",
    "TailError",
    "TailPiece",
    "TailRecord",
    "TailStep",
    "extend_tail",
    "read_tail",
    "tail_prefix",
]

log = logging.getLogger(__name__)

#: The tail's frontier is a multiple of this (seconds): how much a table may trail its clock.
DEFAULT_STEP_S = 10
#: Pieces written per step at most: a table far behind its clock catches up over steps.
MAX_PIECES_PER_STEP = 48
TAILS_DIR = "_tails/"


class TailError(AnalyticsError):
    """A window of the tail could not be read or written; nothing was recorded for it."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


@dataclass(frozen=True, slots=True)
class TailPiece:
    """The entries of one window ``[start_ms, end_ms)`` inside one partition."""

    start_ms: int
    end_ms: int
    files: list[CommittedFile]
    """In offset order; empty for a window without entries."""

    def __post_init__(self) -> None:
        files = [f if isinstance(f, CommittedFile) else CommittedFile(**f) for f in self.files]
        object.__setattr__(self, "files", files)


@dataclass(frozen=True, slots=True)
class TailRecord(_Record):
    """``tail``: the pieces past the active rendition's frontier, contiguous, in order."""

    rendition: str
    pieces: list[TailPiece] = field(default_factory=list)
    input_revision: int = 0
    """The etcd revision of the clock and manifest the last piece was read from."""

    def __post_init__(self) -> None:
        pieces = [p if isinstance(p, TailPiece) else TailPiece(**p) for p in self.pieces]
        object.__setattr__(self, "pieces", pieces)

    def active_pieces(self, table: TableRecord) -> list[TailPiece]:
        """The pieces ``table`` holds now (``wanted_pieces`` of its active rendition from its
        ``upper``)."""
        if table.active is None:
            return []
        return wanted_pieces(self, table.active, max(table.upper_ms, table.since_ms))


def tail_key(keys: Keys, topic: str) -> str:
    return f"{TableKeys(keys, topic).prefix}tail"


def tail_prefix(root: str) -> str:
    """Every tail file starts with this."""
    return f"{root}{TAILS_DIR}"


async def read_tail(kv: KV, keys: Keys, topic: str) -> tuple[TailRecord | None, int]:
    """The topic's tail record and its ``mod_revision`` (0: none)."""
    key = tail_key(keys, topic)
    stored = await kv.get(key)
    if stored is None:
        return None, 0
    return TailRecord.decode(stored.value, key), stored.mod_revision


def wanted_pieces(tail: TailRecord | None, active: str, upper_ms: int) -> list[TailPiece]:
    """The pieces of ``tail`` a table whose active rendition is ``active`` and whose
    partitions are committed up to ``upper_ms`` holds: those from ``upper_ms`` on, contiguous
    from it (none when the tail is another rendition's, or has a gap)."""
    if tail is None or tail.rendition != active:
        return []
    kept: list[TailPiece] = []
    at = upper_ms
    for piece in tail.pieces:
        if piece.end_ms <= upper_ms:
            continue
        if piece.start_ms != at:
            break
        kept.append(piece)
        at = piece.end_ms
    return kept


@dataclass(frozen=True, slots=True)
class TailStep:
    """What one ``extend_tail`` did."""

    topic: str
    rendition: str
    frontier_ms: int
    """The tail's end after the step (the active rendition's upper when it holds no piece)."""
    added: int
    """Pieces written by this step."""
    dropped: int
    """Pieces left out because their partition is committed (or the rendition changed)."""
    rows: int
    """Rows of the pieces added."""
    recorded: bool
    """False when another follower changed the record first (nothing of this step is in it)."""


def _windows(start: int, end: int, width_s: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at partition boundaries, at most ``MAX_PIECES_PER_STEP`` pieces."""
    windows: list[tuple[int, int]] = []
    at = start
    while at < end and len(windows) < MAX_PIECES_PER_STEP:
        stop = min(end, partition_end(partition_start(at, width_s), width_s))
        windows.append((at, stop))
        at = stop
    return windows


def _merged(pieces: list[TailPiece], width_s: int) -> list[TailPiece]:
    """``pieces`` with each run of empty pieces in one partition made one piece (an idle
    topic's tail then stays one record of a few pieces while its frontier moves)."""
    merged: list[TailPiece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            last is not None
            and not last.files
            and not piece.files
            and partition_start(last.start_ms, width_s) == partition_start(piece.start_ms, width_s)
        ):
            merged[-1] = TailPiece(last.start_ms, piece.end_ms, [])
        else:
            merged.append(piece)
    return merged


async def extend_tail(
    kv: KV,
    keys: Keys,
    topic: str,
    objects: ObjectStore,
    warehouse: ObjectStore,
    *,
    root: str,
    step_s: float = DEFAULT_STEP_S,
    create: bool = False,
    dead_letters: bool = False,
) -> TailStep | None:
    """Write the entries past the tail's end up to the last multiple of ``step_s`` the topic
    clock has passed, and record them (module docstring). None when the topic has no active
    table (``create``: the table is created first, as a first conversion run would, its first
    rendition with ``dead_letters``). Rows that do not decode go to dead-letter files beside
    the piece's when the rendition keeps them apart. Raises :class:`TailError`."""
    from danube_ingest.analytics.convert import ensure_table, rendition_decoder
    from danube_ingest.analytics.evolve import evolve_schema

    if step_s < 1:
        raise TailError(f"the tail step must be at least 1 s, not {step_s}")
    tables = TableKeys(keys, topic)
    key = tail_key(keys, topic)
    read = await kv.txn([], [Get(tables.table()), Get(key)])
    table_kv, tail_kv = read.kv(0), read.kv(1)
    if create and (table_kv is None or TableRecord.decode(table_kv.value, "").active is None):
        await ensure_table(kv, keys, topic, dead_letters=dead_letters)
        read = await kv.txn([], [Get(tables.table()), Get(key)])
        table_kv, tail_kv = read.kv(0), read.kv(1)
    if table_kv is None:
        return None
    table = TableRecord.decode(table_kv.value, table_kv.key)
    if table.active is None:
        return None
    rendition_kv = await kv.get(tables.rendition(table.active))
    if rendition_kv is None:
        return None
    record = RenditionRecord.decode(rendition_kv.value, rendition_kv.key)
    tail = None if tail_kv is None else TailRecord.decode(tail_kv.value, key)
    upper = max(record.upper_ms, table.since_ms)
    pieces = wanted_pieces(tail, table.active, upper)
    dropped = 0 if tail is None else len(tail.pieces) - len(pieces)
    at = pieces[-1].end_ms if pieces else upper
    plan_input = await read_plan_input(kv, keys, topic)
    clock = plan_input.clock
    step_ms = round(step_s * 1000)
    target = 0 if clock is None else clock.ingest_ms - clock.ingest_ms % step_ms
    windows = _windows(at, target, table.width_s) if target > at else []
    if not windows and not dropped:
        return TailStep(topic, table.active, at, 0, 0, 0, True)
    if windows:  # a newer version of the topic's subject that extends the rendition's
        evolution = await evolve_schema(kv, keys, topic)
        if evolution is not None and evolution.refused is None:
            record = evolution.record
    decoder = await rendition_decoder(kv, keys, topic, record) if windows else None
    schema = table_schema(decoder)
    ordered = sorted(plan_input.ranges, key=lambda r: r.start_offset)
    added: list[TailPiece] = []
    rows = 0
    for start, end in windows:
        needed = [r for r in ordered if r.first_ingest_ms < end and r.last_ingest_ms >= start]
        files: list[CommittedFile] = []
        if needed:
            parts = plan_reads(
                needed,
                start_offset=needed[0].start_offset,
                end_offset=needed[-1].end_offset,
                start_ms=start,
                end_ms=end,
            )
            partition = partition_start(start, table.width_s)
            directory = (
                f"{tail_prefix(root)}{partition_dir(table.active, topic, partition, table.width_s)}"
                f"tail-{start:020d}-{end:020d}/"
            )
            try:
                batches = [
                    b for part in parts async for b in aread_part(objects, part, decoder=decoder)
                ]
                written = await write_partition(
                    warehouse,
                    directory,
                    batches,
                    schema,
                    dead_letters=f"{directory}dead_letters/" if record.dead_letters else None,
                )
            except DanubeIngestError as exc:
                raise TailError(
                    f"the tail of {topic} could not be written for [{start}, {end}): {exc}",
                    retriable=bool(exc.retriable),
                ) from exc
            files = [
                CommittedFile(
                    f.path, f.size, f.rows, f.first_offset, f.last_offset, f.crc32c, f.dead_letters
                )
                for f in written
            ]
            rows += sum(f.rows for f in written)
        added.append(TailPiece(start, end, files))
    new = TailRecord(table.active, _merged([*pieces, *added], table.width_s), plan_input.revision)
    result = await kv.txn([Compare.unchanged(key, tail_kv)], [Put(key, new.encode())])
    frontier = new.pieces[-1].end_ms if new.pieces else upper
    if not result.succeeded:
        log.info("tail step lost a race topic=%s", topic)
        return TailStep(topic, table.active, frontier, len(added), dropped, rows, False)
    log.info(
        "tail extended topic=%s rendition=%s frontier_ms=%d added=%d dropped=%d rows=%d",
        topic,
        table.active,
        frontier,
        len(added),
        dropped,
        rows,
    )
    return TailStep(topic, table.active, frontier, len(added), dropped, rows, True)
