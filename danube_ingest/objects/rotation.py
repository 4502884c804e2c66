"""Rotation: merge a topic's small ranges into rolling per-topic objects (issue 13).

The uploader stores every sealed segment as one object holding many topics, and adds one
manifest entry per topic per segment. Rotation (run by Dagster, job ``rotate_topics``) merges a
topic's consecutive small ranges into one object of its own::

    topics/{ns}/{topic}/data-{epoch}-{start:020}-{end:020}.bin

``[start, end)`` are the offsets it holds (``end`` exclusive, as in manifest entries) and
``epoch`` the newest ownership epoch among the merged ranges. The object has the same ``.bin``
format as a segment object, one topic, indexed by its footer. Small frames (a quiet topic's
share of each segment) are decompressed and re-compressed together into frames of about
``frame_bytes``; a frame already of at least half that size and of the configured codec is
copied as stored, CRC32C checked (re-compressing it would cost most of rotation's time and
gain nothing).

Planning (:func:`plan_rotation`, pure in :func:`plan_ranges`): a topic's entries are walked in
offset order and packed greedily into groups of consecutive ranges, at most
``max_object_bytes`` of stored input, ``max_object_seconds`` of ingest time (first entry of the
first range to the last of the last) and 60 ranges (the swap costs two etcd operations per
range and etcd allows 128 per transaction). A group never spans a gap between ranges (a gap
stays a gap) nor a topic object of at least half ``max_object_bytes`` (never merged again). A
group is rotated once it is *closed*: the next range did not fit, or a gap or a large object
follows, or (the newest group) the topic's clock says every later entry is more than
``max_object_seconds`` younger than its first. Groups of fewer than ``min_ranges`` are left
alone. Planning is deterministic: the same manifest gives the same groups and keys.

Which ranges may be merged (the manifest's "Limit"): only those wholly below the topic's ingest
clock offset (``storage/topics/{t}/clock``). The owner writes its clock only once every offset
below is in a segment it has marked uploaded, and never commits a range below the stored clock
again (a segment recovered after a crash is checked against the manifest, rotated entries
included), so nobody can re-commit what rotation merged. A topic without a clock is not
rotated.

Rotating one group (:func:`rotate_group`):

1. read the footer and the topic's byte range of every old object (ranged reads), check both
   against the manifest entry, and copy the frames (CRC32C checked) into a new object, in a
   worker thread;
2. store it with ``put_if_absent`` under the deterministic key. An object already there (an
   earlier run that died, or a concurrent rotation of the same group) is used as it is when its
   footer holds exactly the group's offsets and entries; a damaged one nobody names is
   replaced; one that holds something else stops the rotation (``RotationError``). An object
   stored longer ago than ``OBJECT_REFRESH_SECONDS`` is stored again before the swap (the
   orphan collector's grace is twice that), as the uploader does;
3. read the whole object back and check its size and CRC32C, which the new entry records;
4. swap the old entries for the new one with ``Manifest.replace`` (one compare-and-swap on
   every old entry's exact value; it writes the old objects' retirement records).

Guarantees:

* No range is ever lost or duplicated: the swap is all or nothing, and it fails if any old
  entry changed (a concurrent rotation) or the new key appeared. A failed swap re-plans from
  the manifest (:func:`rotate_topic`); after ``CONFLICT_ATTEMPTS`` lost races in a row it
  stops with a retriable ``RotationError``, the manifest as the last swap left it.
* Crash-safe and convergent: a run that dies after storing an object and before the swap
  leaves an unreferenced object; the next run plans the same group, finds the object under the
  same key and swaps it in. A run that dies after the swap has nothing left to redo. Superseded
  objects are never deleted here: the orphan collector deletes them once nothing names them
  and their retirement is older than its grace period, so a reader that opened one finishes
  with it (a reader that finds one gone re-reads the manifest).
* An object rotation wrote is never deleted by rotation (another run may have swapped it in).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from crc32c import crc32c

from danube_ingest.config.models import BrokerConfig
from danube_ingest.errors import FrameError, ObjectFormatError, ObjectNotFoundError, RotationError
from danube_ingest.metadata.clock import TopicClock, read_clock
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import (
    CODECS,
    BinWriter,
    Footer,
    TopicSpan,
    frame_wal_bytes,
    parse_object,
    read_footer_from,
)
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.uploader import OBJECT_FRAME_BYTES, OBJECT_REFRESH_SECONDS
from danube_ingest.stoppoint import reached

log = logging.getLogger(__name__)

#: Most ranges merged by one swap: it compares each old entry, deletes all but one, puts the new
#: entry and writes up to one retirement record per old object, so 2 ops per range; etcd's
#: default ``--max-txn-ops`` is 128.
MAX_GROUP_RANGES = 60
#: Plan-and-rotate passes of one ``rotate_topic`` call. A pass merges what is closed; the next
#: may merge the objects a pass wrote when the 60-range cap closed them (small topics).
MAX_PASSES = 8
#: Lost compare-and-swaps in a row (the manifest changed under the group) before giving up.
CONFLICT_ATTEMPTS = 3
#: Old objects read at once while building a group's object.
READ_CONCURRENCY = 8
#: ``raw_len`` in a frame prefix (``binfmt.layout``): bytes 8..12.
_RAW_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class RotationLimits:
    """How rotation packs ranges (``storage.rotation`` and ``storage.cloud.compression``)."""

    max_object_bytes: int = 128 << 20
    max_object_seconds: float = 3600.0
    min_ranges: int = 2
    codec: str = "zstd"
    frame_bytes: int = OBJECT_FRAME_BYTES

    def __post_init__(self) -> None:
        if self.max_object_bytes <= 0 or self.max_object_seconds <= 0:
            raise ValueError("max_object_bytes and max_object_seconds must be positive")
        if not 2 <= self.min_ranges <= MAX_GROUP_RANGES:
            raise ValueError(f"min_ranges must be between 2 and {MAX_GROUP_RANGES}")

    @classmethod
    def from_config(cls, config: BrokerConfig) -> RotationLimits:
        rotation = config.storage.rotation
        return cls(
            max_object_bytes=rotation.max_object_bytes,
            max_object_seconds=rotation.max_object_seconds,
            min_ranges=rotation.min_ranges,
            codec=config.storage.cloud.compression,
        )

    def mergeable(self, rng: ObjectRange) -> bool:
        """A segment range, or a topic object under half ``max_object_bytes``."""
        return rng.kind == "segment" or rng.byte_length * 2 < self.max_object_bytes


def rolling_key(topic: str, epoch: int, start: int, end: int) -> str:
    """The key of the rolling object holding ``topic``'s offsets ``[start, end)``."""
    ns, name = split_topic(topic)
    return f"topics/{ns}/{name}/data-{epoch}-{start:020d}-{end:020d}.bin"


@dataclass(frozen=True, slots=True)
class RotationGroup:
    """Consecutive ranges of one topic to merge into one rolling object."""

    ranges: tuple[ObjectRange, ...]
    closed_by: str
    """Why it is complete: ``full``, ``gap``, ``large`` (a large object follows) or ``age``."""

    @property
    def topic(self) -> str:
        return self.ranges[0].topic

    @property
    def start(self) -> int:
        return self.ranges[0].start_offset

    @property
    def end(self) -> int:
        return self.ranges[-1].end_offset

    @property
    def entries(self) -> int:
        return sum(r.entries for r in self.ranges)

    @property
    def input_bytes(self) -> int:
        return sum(r.byte_length for r in self.ranges)

    @property
    def key(self) -> str:
        return rolling_key(self.topic, max(r.epoch for r in self.ranges), self.start, self.end)


@dataclass(frozen=True, slots=True)
class RotationPlan:
    """What one look at a topic's manifest decided."""

    topic: str
    entries: int
    """Manifest entries of the topic now."""
    safe_below: int
    """The topic's clock offset: only ranges wholly below it may be merged."""
    groups: tuple[RotationGroup, ...]


def plan_ranges(
    topic: str, ranges: Sequence[ObjectRange], clock: TopicClock | None, limits: RotationLimits
) -> RotationPlan:
    """The closed groups of ``ranges`` (a topic's manifest, in order) given its ``clock``."""
    safe_below = 0 if clock is None else clock.offset
    max_ms = limits.max_object_seconds * 1000
    groups: list[RotationGroup] = []
    current: list[ObjectRange] = []
    size = 0

    def close(reason: str) -> None:
        if len(current) >= limits.min_ranges:
            groups.append(RotationGroup(tuple(current), reason))

    for rng in ranges:
        if rng.end_offset > safe_below:
            break  # the owner may still commit here: the group before it is the tail
        if not limits.mergeable(rng):
            close("large")
            current, size = [], 0
            continue
        reason = None
        if current:
            if rng.start_offset != current[-1].end_offset:
                reason = "gap"
            elif (
                len(current) >= MAX_GROUP_RANGES
                or size + rng.byte_length > limits.max_object_bytes
                or rng.last_ingest_ms - current[0].first_ingest_ms > max_ms
            ):
                reason = "full"
        if reason is not None:
            close(reason)
            current, size = [], 0
        current.append(rng)
        size += rng.byte_length
    # The tail: later ranges (at or above the clock offset) hold entries ingested at or after
    # the clock's time, so none of them can join once that is past the group's time window.
    if current and clock is not None and clock.ingest_ms - current[0].first_ingest_ms > max_ms:
        close("age")
    return RotationPlan(topic, len(ranges), safe_below, tuple(groups))


async def plan_rotation(
    manifest: Manifest, topic: str, limits: RotationLimits = RotationLimits()
) -> RotationPlan:
    """Read the topic's manifest and clock (two etcd reads) and plan (see the module docs)."""
    clock = await read_clock(manifest.kv, manifest.keys, topic)
    return plan_ranges(topic, await manifest.ranges(topic), clock, limits)


async def rotation_candidates(
    kv: KV, keys: Keys, limits: RotationLimits = RotationLimits()
) -> tuple[dict[str, int], dict[str, int]]:
    """For the sensor, from one prefix read of every manifest and clock: topic -> how many
    ranges a run would merge now (those of its closed groups, when any), and topic -> the
    highest etcd revision among its manifest entries and clock."""
    head = f"{keys.prefix}/storage/topics/"
    clocks: dict[str, TopicClock] = {}
    entries: dict[str, list[ObjectRange]] = {}
    revisions: dict[str, int] = {}
    for stored in await kv.get_prefix(head):
        rest = stored.key[len(head) :]
        if "/objects/" in rest:
            entry = ObjectRange.decode(stored.value, stored.key)
            entries.setdefault(entry.topic, []).append(entry)
            topic = entry.topic
        elif rest.endswith("/clock"):
            topic = "/" + rest[: -len("/clock")]
            clocks[topic] = TopicClock.decode(stored.value, stored.key)
        else:
            continue
        revisions[topic] = max(revisions.get(topic, 0), stored.mod_revision)
    counts = {}
    for topic, ranges in entries.items():
        plan = plan_ranges(topic, ranges, clocks.get(topic), limits)
        if plan.groups:
            counts[topic] = sum(len(g.ranges) for g in plan.groups)
    return counts, revisions


@dataclass
class RotationReport:
    """What ``rotate_topic`` did to one topic."""

    topic: str
    entries_before: int = 0
    entries_after: int = 0
    objects: list[str] = field(default_factory=list)
    """Rolling objects swapped into the manifest."""
    ranges_replaced: int = 0
    bytes_in: int = 0
    """Stored bytes of the replaced ranges."""
    bytes_out: int = 0
    """Size of the objects swapped in."""
    conflicts: int = 0
    """Swaps lost to a concurrent change (re-planned)."""
    passes: int = 0


async def rotate_topic(
    manifest: Manifest,
    store: ObjectStore,
    topic: str,
    limits: RotationLimits = RotationLimits(),
    *,
    now_ms: int | None = None,
) -> RotationReport:
    """Plan and rotate ``topic`` until nothing closed is left to merge (see the module docs).

    ``now_ms`` stamps the retirement records (default: the wall clock). Raises a retriable
    ``RotationError`` after ``CONFLICT_ATTEMPTS`` lost swaps in a row, a non-retriable one when
    an object disagrees with its manifest entry; what was swapped before stays swapped.
    """
    report = RotationReport(topic)
    conflicts = 0
    plan = await plan_rotation(manifest, topic, limits)
    report.entries_before = plan.entries
    while plan.groups and report.passes < MAX_PASSES:
        report.passes += 1
        lost = False
        for group in plan.groups:
            new = await rotate_group(manifest, store, group, limits, now_ms=now_ms)
            if new is None:
                lost = True
                break
            conflicts = 0
            report.objects.append(new.object_key)
            report.ranges_replaced += len(group.ranges)
            report.bytes_in += group.input_bytes
            report.bytes_out += new.object_size
        before = plan.entries
        plan = await plan_rotation(manifest, topic, limits)
        if lost:
            report.conflicts += 1
            # Fewer entries: another rotation is making progress, which is no conflict.
            conflicts = 0 if plan.entries < before else conflicts + 1
            if conflicts >= CONFLICT_ATTEMPTS:
                raise RotationError(
                    f"rotation of {topic} lost {conflicts} manifest swaps in a row: its "
                    "manifest keeps changing; run it again later",
                    retriable=True,
                )
    report.entries_after = plan.entries
    log.info(
        "rotation done topic=%s entries_before=%d entries_after=%d objects=%d ranges=%d "
        "bytes_in=%d bytes_out=%d conflicts=%d",
        topic,
        report.entries_before,
        report.entries_after,
        len(report.objects),
        report.ranges_replaced,
        report.bytes_in,
        report.bytes_out,
        report.conflicts,
    )
    return report


async def rotate_group(
    manifest: Manifest,
    store: ObjectStore,
    group: RotationGroup,
    limits: RotationLimits = RotationLimits(),
    *,
    now_ms: int | None = None,
) -> ObjectRange | None:
    """Merge ``group`` into its rolling object and swap it into the manifest.

    Returns the new entry once swapped; None when the manifest no longer holds the group
    (an old object is gone, or the swap's compare failed): nothing was changed, plan again.
    """
    topic = group.topic
    try:
        parts = await _read_group(store, group)
    except ObjectNotFoundError as exc:
        log.info("rotation input gone, re-planning topic=%s error=%s", topic, exc)
        return None
    body = await asyncio.to_thread(_build, group, parts, limits)
    stored_at = time.monotonic()
    if not await store.put_if_absent(group.key, body):
        found = await _existing(manifest, store, group, body)
        if found is None:
            return None
        body = found
    new = await _verified_entry(store, group, len(body), crc32c(body))
    if time.monotonic() - stored_at > OBJECT_REFRESH_SECONDS:
        await store.put(group.key, body)  # its age starts over: see the module docstring
    reached("rotation.stored")
    swapped = await manifest.replace(None, group.ranges, [new], now_ms=now_ms)
    log.info(
        "rotation group topic=%s start=%d end=%d ranges=%d closed_by=%s key=%s bytes_in=%d "
        "bytes_out=%d swapped=%s",
        topic,
        group.start,
        group.end,
        len(group.ranges),
        group.closed_by,
        group.key,
        group.input_bytes,
        new.object_size,
        swapped,
    )
    if swapped:
        reached("rotation.swapped")
    return new if swapped else None


async def _read_group(
    store: ObjectStore, group: RotationGroup
) -> list[tuple[ObjectRange, TopicSpan, bytes]]:
    """Each old range's span (from its object's footer) and bytes, in order."""
    limit = asyncio.Semaphore(READ_CONCURRENCY)

    async def read(rng: ObjectRange) -> tuple[ObjectRange, TopicSpan, bytes]:
        async with limit:
            footer = await read_footer_from(store.get_range, rng.object_size, rng.object_key)
            span = _span_as_recorded(footer, rng)
            data = await store.get_range(rng.object_key, rng.byte_start, rng.byte_length)
            return rng, span, data

    return list(await asyncio.gather(*(read(r) for r in group.ranges)))


def _span_as_recorded(footer: Footer, rng: ObjectRange) -> TopicSpan:
    span = footer.topics.get(rng.topic)
    if (
        span is None
        or (span.position, span.length) != (rng.byte_start, rng.byte_length)
        or span.entries != rng.entries
        or span.first_offset < rng.start_offset
        or span.last_offset >= rng.end_offset
    ):
        raise RotationError(
            f"cannot rotate {rng.span()}: the object's footer does not hold what the manifest "
            "entry says; nothing was changed (check it: danube-ingest objects verify)"
        )
    return span


def _build(
    group: RotationGroup,
    parts: Sequence[tuple[ObjectRange, TopicSpan, bytes]],
    limits: RotationLimits,
) -> bytes:
    """The rolling object of ``group``: its frames copied (see the module docstring)."""
    writer = BinWriter(limits.codec, frame_target_bytes=limits.frame_bytes)
    codec = CODECS.index(limits.codec)
    for rng, span, data in parts:
        view = memoryview(data)
        for ref in span.frames:
            start = ref.position - span.position
            frame = view[start : start + ref.length]
            try:
                # A frame of the same codec and at least half the target size is copied as
                # stored: re-compressing it would cost most of rotation's time for no gain.
                if (
                    frame[4] == codec
                    and 2 * _RAW_LEN.unpack_from(frame, 8)[0] >= limits.frame_bytes
                ):
                    writer.add_frame(group.topic, frame, ref)
                    continue
                writer.add_wal_frames(
                    group.topic,
                    frame_wal_bytes(frame, ref, rng.object_key),
                    first_offset=ref.first_offset,
                    last_offset=ref.last_offset,
                    entries=ref.entries,
                    first_ingest_ms=ref.first_ingest_ms,
                    last_ingest_ms=ref.last_ingest_ms,
                )
            except (ObjectFormatError, FrameError, ValueError) as exc:
                raise RotationError(
                    f"cannot rotate {rng.span()}: a frame at byte {ref.position} does not "
                    f"decode ({exc}); nothing was changed (check it: danube-ingest objects "
                    "verify)"
                ) from exc
    return writer.finish()


def _holds_group(footer: Footer, group: RotationGroup) -> bool:
    span = footer.topics.get(group.topic)
    return (
        len(footer.topics) == 1
        and span is not None
        and span.entries == group.entries
        and group.start <= span.first_offset
        and span.last_offset < group.end
    )


async def _existing(
    manifest: Manifest, store: ObjectStore, group: RotationGroup, body: bytes
) -> bytes | None:
    """The object already under the group's key, made usable; None when the group is gone."""
    key = group.key
    current = await manifest.ranges(group.topic, group.start)
    named = any(r.object_key == key for r in current)
    if named or not all(r in current for r in group.ranges):
        return None  # swapped in by another run, or the manifest moved on: plan again
    try:
        stored: bytes | None = await store.get(key)
    except ObjectNotFoundError:
        stored = None
    try:
        if stored is None or not _holds_group(parse_object(stored, key), group):
            if stored is not None:
                raise RotationError(
                    f"cannot rotate {group.topic}[{group.start}, {group.end}): the object "
                    f"{key} holds other offsets; nothing was changed (move it away and run "
                    "again)"
                )
            stored = body
    except ObjectFormatError as exc:
        # Nobody names it: a PUT torn by a crash (an fs store writes in place). Replace it.
        log.warning("replacing a damaged rolling object key=%s error=%s", key, exc)
        stored = body
    info = await store.stat(key)
    modified_ms = None if info is None else info.modified_ms
    if (
        stored is body
        or modified_ms is None
        or (time.time() * 1000 - modified_ms > OBJECT_REFRESH_SECONDS * 1000)
    ):
        await store.put(key, stored)
    else:
        log.info("rolling object already stored key=%s", key)
    return stored


async def _verified_entry(
    store: ObjectStore, group: RotationGroup, size: int, crc: int
) -> ObjectRange:
    """The new entry, after reading the stored object back: its size and CRC32C must be
    ``size`` and ``crc`` and its footer must hold the group."""
    key = group.key
    data = await store.get(key)
    if len(data) != size or crc32c(data) != crc:
        raise RotationError(
            f"rotation of {group.topic}[{group.start}, {group.end}): the stored {key} has "
            f"{len(data)} bytes and another CRC32C than written ({size} bytes); nothing was "
            "swapped: run it again",
            retriable=True,
        )
    footer = parse_object(data, key)
    span = footer.topics[group.topic]
    newest = max(group.ranges, key=lambda r: r.epoch)
    return ObjectRange(
        topic=group.topic,
        object_key=key,
        start_offset=group.start,
        end_offset=group.end,
        entries=span.entries,
        byte_start=span.position,
        byte_length=span.length,
        object_size=size,
        object_crc=crc,
        first_ingest_ms=span.first_ingest_ms,
        last_ingest_ms=span.last_ingest_ms,
        kind="topic",
        broker=newest.broker,
        epoch=newest.epoch,
    )


__all__ = [
    "CONFLICT_ATTEMPTS",
    "MAX_GROUP_RANGES",
    "RotationGroup",
    "RotationLimits",
    "RotationPlan",
    "RotationReport",
    "plan_ranges",
    "plan_rotation",
    "rolling_key",
    "rotate_group",
    "rotate_topic",
    "rotation_candidates",
]
