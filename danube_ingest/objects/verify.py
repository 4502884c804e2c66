"""Check that the manifest and the objects it names agree (``danube-ingest objects verify``).

For every manifest range of the topics asked about: the object exists, has the recorded size
and CRC32C, its footer lists the topic at the recorded byte range with offsets inside the range,
and (``deep``) every frame of the topic decodes, with the recorded number of entries. Ranges
that overlap make the manifest unreadable (``ManifestConflictError``) and are reported as such;
gaps between ranges are listed (offsets that never existed, or ranges a broker could not commit)
but are not problems. Nothing is changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crc32c import crc32c

from danube_ingest.errors import DanubeIngestError
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
    """[start, end) offset intervals between consecutive ranges."""
    problems: list[str] = field(default_factory=list)


async def verify_topic(
    manifest: Manifest, objects: ObjectStore, topic: str, *, deep: bool = False
) -> TopicReport:
    """Check every manifest range of ``topic`` against its object (see the module docs)."""
    report = TopicReport(topic)
    try:
        ranges = await manifest.ranges(topic)
    except DanubeIngestError as exc:
        report.problems.append(f"manifest unreadable: {exc}")
        return report
    previous: ObjectRange | None = None
    for rng in ranges:
        report.ranges += 1
        report.entries += rng.entries
        report.bytes += rng.byte_length
        if previous is None:
            report.first_offset = rng.start_offset
        elif rng.start_offset > previous.end_offset:
            report.gaps.append((previous.end_offset, rng.start_offset))
        report.end_offset = rng.end_offset
        previous = rng
        problem = await _check_range(objects, rng, deep)
        if problem is not None:
            report.problems.append(
                f"range {rng.start_offset}..{rng.end_offset} in {rng.object_key}: {problem}"
            )
    return report


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
