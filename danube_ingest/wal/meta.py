"""RegionMeta: per-topic state of one region log, and its atomic snapshot.

Per topic the region keeps the next offset to assign, the high watermark (every offset below
it is durable), the first retained offset, the last ingest time, an optional prune mark, and a
sparse index: for every segment holding the topic, a :class:`SegSpan` with the segment's offset
range and (offset, byte position) pairs at most ``index_interval_bytes`` apart.

The snapshot is a JSON document written atomically (tmp file, fsync, rename, directory fsync) at
segment seals, behind a header line carrying its CRC32C and length. It records the state
through the end of segment ``next_seq - 1``; recovery loads
it and scans segments from ``next_seq`` on. Segment files are the source of truth: a missing or
unreadable snapshot only makes recovery scan more.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crc32c import crc32c

SNAPSHOT_NAME = "meta.json"
SNAPSHOT_VERSION = 1
SNAPSHOT_MAGIC = "DNMETA1"


@dataclass(slots=True)
class SegSpan:
    """The offsets of one topic held by one segment."""

    seq: int
    first_offset: int
    last_offset: int
    first_ingest_ms: int
    last_ingest_ms: int
    index: list[tuple[int, int]] = field(default_factory=list)
    """(offset, byte position of the MESSAGES frame holding that offset), ascending."""

    def to_json(self) -> list[Any]:
        return [
            self.seq,
            self.first_offset,
            self.last_offset,
            self.first_ingest_ms,
            self.last_ingest_ms,
            [list(pair) for pair in self.index],
        ]

    @classmethod
    def from_json(cls, data: list[Any]) -> SegSpan:
        seq, first, last, first_ms, last_ms, index = data
        return cls(seq, first, last, first_ms, last_ms, [(int(o), int(p)) for o, p in index])


#: Batches remembered per idempotent producer and topic: a retry of any of them is answered with
#: its original offsets. A producer keeps at most this many batches in flight.
PRODUCER_WINDOW = 32
#: Idempotent producers remembered per topic; the least recently used is forgotten beyond it.
MAX_PRODUCERS = 10_000


@dataclass(slots=True)
class ProducerBatch:
    """One stored batch of an idempotent producer: its sequence and offsets."""

    sequence: int
    base_offset: int
    count: int
    future: Any = None
    """The log's durability future while the batch is not yet durable (never persisted)."""


class TopicMeta:
    """State of one topic within a region.

    ``next_offset`` counts assigned offsets (some may not be durable yet); ``hwm`` counts durable
    ones. Both only grow. ``last_ingest_ms`` never decreases.
    """

    __slots__ = (
        "first_offset",
        "hwm",
        "last_index_pos",
        "last_ingest_ms",
        "name",
        "next_offset",
        "producers",
        "prune_mark",
        "spans",
        "topic_id",
        "waiters",
    )

    def __init__(self, name: str, topic_id: int, next_offset: int = 0) -> None:
        self.name = name
        self.topic_id = topic_id
        self.next_offset = next_offset
        self.hwm = next_offset
        self.first_offset = next_offset
        self.last_ingest_ms = 0
        self.prune_mark: int | None = None
        self.spans: list[SegSpan] = []
        self.last_index_pos = -1
        self.waiters: list[Any] = []
        #: Idempotent producer id -> its last stored batches (oldest first), least recently
        #: used producer first.
        self.producers: dict[int, list[ProducerBatch]] = {}

    def note_producer_batch(self, producer_id: int, batch: ProducerBatch) -> None:
        """Remember ``batch`` as ``producer_id``'s newest (bounded: see PRODUCER_WINDOW and
        MAX_PRODUCERS)."""
        producers = self.producers
        batches = producers.pop(producer_id, None)
        if batches is None:
            batches = []
            if len(producers) >= MAX_PRODUCERS:
                del producers[next(iter(producers))]
        batches.append(batch)
        if len(batches) > PRODUCER_WINDOW:
            del batches[0]
        producers[producer_id] = batches

    def note_frame(
        self,
        seq: int,
        position: int,
        base_offset: int,
        count: int,
        first_ms: int,
        last_ms: int,
        index_interval: int,
    ) -> None:
        """Record that offsets [base_offset, base_offset + count) sit in a frame at ``position``."""
        last = base_offset + count - 1
        spans = self.spans
        if spans and spans[-1].seq == seq:
            span = spans[-1]
            span.last_offset = last
            span.last_ingest_ms = last_ms
            if position - self.last_index_pos >= index_interval:
                span.index.append((base_offset, position))
                self.last_index_pos = position
        else:
            spans.append(
                SegSpan(seq, base_offset, last, first_ms, last_ms, [(base_offset, position)])
            )
            self.last_index_pos = position

    def locate(self, offset: int) -> tuple[SegSpan, int] | None:
        """The first span with offsets at or after ``offset``, and the position of the frame
        holding ``offset`` there (or of the span's first frame when ``offset`` falls in a gap
        left by an offset jump); None when no span reaches ``offset``."""
        spans = self.spans
        lo, hi = 0, len(spans)
        while lo < hi:
            mid = (lo + hi) // 2
            if spans[mid].last_offset < offset:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(spans):
            return None
        span = spans[lo]
        index = span.index
        lo, hi = 0, len(index)
        while lo < hi:
            mid = (lo + hi) // 2
            if index[mid][0] <= offset:
                lo = mid + 1
            else:
                hi = mid
        return span, index[max(lo - 1, 0)][1]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.topic_id,
            "next_offset": self.next_offset,
            "first_offset": self.first_offset,
            "last_ingest_ms": self.last_ingest_ms,
            "prune_mark": self.prune_mark,
            "spans": [span.to_json() for span in self.spans],
            "producers": {
                str(pid): [[b.sequence, b.base_offset, b.count] for b in batches]
                for pid, batches in self.producers.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TopicMeta:
        topic = cls(str(data["name"]), int(data["id"]), int(data["next_offset"]))
        topic.first_offset = int(data["first_offset"])
        topic.last_ingest_ms = int(data["last_ingest_ms"])
        topic.prune_mark = data.get("prune_mark")
        topic.spans = [SegSpan.from_json(s) for s in data["spans"]]
        topic.producers = {
            int(pid): [ProducerBatch(int(q), int(b), int(c)) for q, b, c in batches]
            for pid, batches in data.get("producers", {}).items()
        }
        return topic


@dataclass(slots=True)
class Snapshot:
    """The durable state of a region through the end of segment ``next_seq - 1``."""

    region: str
    next_seq: int
    next_topic_id: int
    topics: list[dict[str, Any]]
    uploaded: list[int] = field(default_factory=list)
    dropped: dict[int, int] = field(default_factory=dict)
    """Dropped topic id -> seq of its DROP frame (see ``RegionState.dropped``)."""

    def to_bytes(self) -> bytes:
        """``{SNAPSHOT_MAGIC} {crc32c:08x} {length}\n`` then the JSON document: the CRC makes
        a damaged snapshot (even one that still parses) detectable, so it is ignored."""
        body = self._json()
        return f"{SNAPSHOT_MAGIC} {crc32c(body):08x} {len(body)}\n".encode() + body

    def _json(self) -> bytes:
        return json.dumps(
            {
                "version": SNAPSHOT_VERSION,
                "region": self.region,
                "next_seq": self.next_seq,
                "next_topic_id": self.next_topic_id,
                "uploaded": self.uploaded,
                "dropped": {str(tid): seq for tid, seq in self.dropped.items()},
                "topics": self.topics,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Snapshot:
        """Parse a snapshot file; ``ValueError`` for anything that is not a whole snapshot of
        this version (a CRC-valid one with fields of the wrong type included)."""
        try:
            return cls._from_bytes(data)
        except (KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise ValueError(f"snapshot does not decode: {exc!r}") from exc

    @classmethod
    def _from_bytes(cls, data: bytes) -> Snapshot:
        header, sep, body = data.partition(b"\n")
        parts = header.split()
        if not sep or len(parts) != 3 or parts[0] != SNAPSHOT_MAGIC.encode():
            raise ValueError("not a RegionMeta snapshot (bad header)")
        try:
            crc, length = int(parts[1], 16), int(parts[2])
        except ValueError as exc:
            raise ValueError(f"bad snapshot header {header!r}") from exc
        if len(body) != length or crc32c(body) != crc:
            raise ValueError("snapshot CRC or length mismatch")
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError(f"snapshot is a JSON {type(doc).__name__}, not an object")
        if doc.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported snapshot version {doc.get('version')!r}")
        return cls(
            region=str(doc["region"]),
            next_seq=int(doc["next_seq"]),
            next_topic_id=int(doc["next_topic_id"]),
            topics=list(doc["topics"]),
            uploaded=[int(s) for s in doc.get("uploaded", [])],
            dropped={int(t): int(s) for t, s in doc.get("dropped", {}).items()},
        )


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_snapshot(directory: Path, snapshot: Snapshot) -> None:
    write_atomic(directory / SNAPSHOT_NAME, snapshot.to_bytes())


def read_snapshot(directory: Path) -> Snapshot | None:
    """The region's snapshot, or None when there is none or it cannot be read."""
    try:
        return Snapshot.from_bytes((directory / SNAPSHOT_NAME).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:
        return None
