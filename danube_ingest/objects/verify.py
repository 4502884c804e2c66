"""Check that the manifest and the objects it names agree (``danube-ingest objects verify``).

For every manifest range of the topics asked about: the object exists, has the recorded size
and CRC32C, its footer lists the topic at the recorded byte range with offsets inside the range,
and (``deep``) every frame of the topic decodes, with the recorded number of entries. Ranges
that overlap make the manifest unreadable (``ManifestConflictError``) and are reported as such.

Gaps: offsets missing between consecutive ranges, or between the topic's start (its retained
floor, else 0) and its first range, are listed. A gap is a problem unless recorded offset jumps
(``metadata.jumps``: a new owner continued from its reservation) cover it; the problem names
the offsets no jump covers (a range that was acknowledged and never committed, or removed).
Offsets below the retained floor (retention removed them) are not gaps. Nothing is changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crc32c import crc32c

from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.jumps import OffsetJump, read_jumps, uncovered
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.objects.binfmt import decode_frame_bytes, parse_object
from danube_ingest.objects.store import ObjectStore


@dataclass
class TopicReport:
    topic: str
    ranges: int = 0
    entries: int = 0
    bytes: int = 0
    first_offset: int | None = None
    end_offset: int | None = None
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) offset intervals between consecutive ranges (and from the floor, else 0,
    to the first range), above the retained floor."""
    unexplained: list[tuple[int, int]] = field(default_factory=list)
    """The parts of ``gaps`` no recorded jump covers (each one is also a problem)."""
    jumps: int = 0
    """Recorded offset jumps of the topic."""
    floor: int | None = None
    """The retained floor (None: retention never removed a range)."""
    range_problems: list[str] = field(default_factory=list)
    """The manifest itself: unreadable (overlapping or malformed entries), unexplained gaps."""
    object_problems: list[str] = field(default_factory=list)
    """Ranges whose object is missing, of another size or CRC32C, or disagrees with them."""

    @property
    def problems(self) -> list[str]:
        """Every problem (ranges first); empty when the topic verifies."""
        return [*self.range_problems, *self.object_problems]


async def verify_topic(
    manifest: Manifest, objects: ObjectStore, topic: str, *, deep: bool = False
) -> TopicReport:
    """Check every manifest range of ``topic`` against its object (see the module docs)."""
    report = TopicReport(topic)
    try:
        ranges = await manifest.ranges(topic)
        floor = await manifest.floor(topic)
        jumps = await read_jumps(manifest.kv, manifest.keys, topic)
    except DanubeIngestError as exc:
        report.range_problems.append(f"manifest unreadable: {exc}")
        return report
    report.floor = None if floor is None else floor.offset
    report.jumps = len(jumps)
    position = report.floor or 0
    for rng in ranges:
        report.ranges += 1
        report.entries += rng.entries
        report.bytes += rng.byte_length
        if report.first_offset is None:
            report.first_offset = rng.start_offset
        if rng.start_offset > position:
            _gap(report, position, rng.start_offset, jumps)
        report.end_offset = rng.end_offset
        position = max(position, rng.end_offset)
        problem = await _check_range(objects, rng, deep)
        if problem is not None:
            report.object_problems.append(
                f"range {rng.start_offset}..{rng.end_offset} in {rng.object_key}: {problem}"
            )
    return report


def _gap(report: TopicReport, start: int, end: int, jumps: list[OffsetJump]) -> None:
    """List the gap ``[start, end)``; what no jump covers is a problem."""
    report.gaps.append((start, end))
    for a, b in uncovered(start, end, jumps):
        report.unexplained.append((a, b))
        report.range_problems.append(
            f"offsets {a}..{b - 1} are in no range (gap {start}..{end - 1} before the range "
            f"at {end}) and no recorded offset jump covers them: a range was lost or never "
            "committed (look for 'segment ranges orphaned' in the brokers' logs)"
        )


async def _check_range(objects: ObjectStore, rng: ObjectRange, deep: bool) -> str | None:
    try:
        data = await objects.get(rng.object_key)
    except DanubeIngestError as exc:
        return str(exc)
    if len(data) != rng.object_size:
        return f"object has {len(data)} bytes, the manifest says {rng.object_size}"
    if crc32c(data) != rng.object_crc:
        return "object CRC32C differs from the manifest's"
    try:
        footer = parse_object(data, rng.object_key)
    except DanubeIngestError as exc:
        return str(exc)
    span = footer.topics.get(rng.topic)
    if span is None:
        return "the object's footer does not list the topic"
    if (span.position, span.length) != (rng.byte_start, rng.byte_length):
        return (
            f"the topic's bytes are at {span.position}+{span.length}, the manifest says "
            f"{rng.byte_start}+{rng.byte_length}"
        )
    if span.first_offset < rng.start_offset or span.last_offset >= rng.end_offset:
        return (
            f"the object holds offsets {span.first_offset}..{span.last_offset}, outside the "
            "manifest range"
        )
    if span.entries != rng.entries:
        return f"the object holds {span.entries} entries, the manifest says {rng.entries}"
    if deep:
        count = 0
        for ref in span.frames:
            try:
                count += len(
                    decode_frame_bytes(
                        data[ref.position : ref.position + ref.length], ref, rng.object_key
                    )
                )
            except DanubeIngestError as exc:
                return str(exc)
        if count != rng.entries:
            return f"the frames decode to {count} entries, the manifest says {rng.entries}"
    return None


__all__ = ["TopicReport", "verify_topic"]
