"""Object retention (issue 13, run hourly by Dagster): expired ranges leave the manifest.

Per topic with manifest entries, its effective policy (:mod:`danube_ingest.metadata.policies`:
topic over namespace over the caller's default) names what expires, always whole manifest
entries from the oldest on:

* ``max_age_ms``: entries whose last ingest time is older than ``now - max_age``;
* ``max_bytes``: then the oldest entries while the topic's bytes (``byte_length`` of its
  entries) exceed ``max_bytes``.

Guarantees:

* Expired entries leave the manifest in ``Manifest.remove`` transactions (one per chunk of
  ``CHUNK`` entries), each comparing the entries' exact stored values and the topic's floor,
  and raising the floor ``storage/topics/{ns}/{topic}/floor`` in the same transaction. A
  chunk that lost its compare (a rotation swapped the entries meanwhile) is planned again
  from a fresh read; no entry is removed that the policy does not expire at that read.
* Objects are never deleted here: the transaction writes their retirement records, and the
  orphan collector deletes an object no entry names once it and its retirement are older
  than its grace period (a reader that opened it finishes first).
* Objects only: the WAL keeps its own retention. A reader below the floor is moved up to it
  (the cold reader raises ``OffsetOutOfRangeError`` naming the floor), never handed a gap.
* Idempotent: a re-run with the same clock finds nothing more to expire.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.metadata.policies import Policies, RetentionPolicy, effective

log = logging.getLogger(__name__)

#: Entries per removal transaction: each costs one compare, one delete and at most one
#: retirement put, the floor one compare and one put; 60 keeps both under etcd's 128 ops.
CHUNK = 60
#: Removals in a row that lost their compare before giving up on a topic for this run.
_ATTEMPTS = 5


@dataclass
class TopicRetention:
    """What retention did to one topic."""

    topic: str
    policy: RetentionPolicy
    expired: list[ObjectRange] = field(default_factory=list)
    """Entries removed from the manifest, in offset order."""
    expired_bytes: int = 0
    """The topic's bytes in them (``byte_length``)."""
    kept_bytes: int = 0
    """The topic's bytes in the entries left."""
    floor: int | None = None
    """The retained floor after the run (``None``: never raised)."""
    reason: str = ""


@dataclass
class RetentionReport:
    """What one ``apply_retention`` run found and did."""

    now_ms: int
    topics: list[TopicRetention] = field(default_factory=list)
    """Topics with a policy (whether anything expired or not)."""

    @property
    def expired(self) -> int:
        return sum(len(t.expired) for t in self.topics)

    @property
    def expired_bytes(self) -> int:
        return sum(t.expired_bytes for t in self.topics)

    @property
    def floors_moved(self) -> list[TopicRetention]:
        return [t for t in self.topics if t.expired]


def expired_prefix(
    entries: list[ObjectRange], policy: RetentionPolicy, now_ms: int
) -> tuple[int, str]:
    """How many of ``entries`` (in offset order) expire under ``policy`` at ``now_ms``, and
    why (``"max_age"``, ``"max_bytes"`` or both, comma-separated)."""
    count = 0
    reasons: list[str] = []
    if policy.max_age_ms is not None:
        cutoff = now_ms - policy.max_age_ms
        while count < len(entries) and entries[count].last_ingest_ms < cutoff:
            count += 1
        if count:
            reasons.append("max_age")
    if policy.max_bytes is not None:
        total = sum(r.byte_length for r in entries[count:])
        before = count
        while count < len(entries) and total > policy.max_bytes:
            total -= entries[count].byte_length
            count += 1
        if count > before:
            reasons.append("max_bytes")
    return count, ",".join(reasons)


async def apply_retention(
    kv: KV,
    keys: Keys,
    *,
    default: RetentionPolicy | None = None,
    topics: list[str] | None = None,
    now_ms: int | None = None,
) -> RetentionReport:
    """Remove every expired manifest entry (see the module docstring).

    ``default`` applies where neither a topic nor its namespace sets a field (default: keep
    for ever); ``topics`` limits the run (default: every topic with manifest entries);
    ``now_ms`` is the clock ages are measured against (default: the wall clock).
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    stored = await Policies(kv, keys).all()
    manifest = Manifest(kv, keys)
    report = RetentionReport(now_ms=now)
    base = default or RetentionPolicy()
    for topic in topics if topics is not None else await manifest_topics(kv, keys):
        policy = effective(topic, stored, base)
        if policy.max_age_ms is None and policy.max_bytes is None:
            continue
        report.topics.append(await _apply_topic(manifest, topic, policy, now))
    log.info(
        "retention done topics=%d expired=%d bytes=%d floors_moved=%d",
        len(report.topics),
        report.expired,
        report.expired_bytes,
        len(report.floors_moved),
    )
    return report


async def _apply_topic(
    manifest: Manifest, topic: str, policy: RetentionPolicy, now: int
) -> TopicRetention:
    result = TopicRetention(topic, policy)
    lost = 0
    entries = await manifest.ranges(topic)
    count, reason = expired_prefix(entries, policy, now)
    while count:
        chunk = entries[: min(count, CHUNK)]
        if not await manifest.remove(chunk, now, reason=reason):
            lost += 1
            if lost >= _ATTEMPTS:
                raise MetadataError(
                    f"retention of {topic}: the manifest changed under {lost} removals in a "
                    "row; try again"
                )
            entries = await manifest.ranges(topic)  # a rotation swapped entries: plan again
            count, reason = expired_prefix(entries, policy, now)
            continue
        lost = 0
        entries, count = entries[len(chunk) :], count - len(chunk)
        result.expired += chunk
        result.expired_bytes += sum(r.byte_length for r in chunk)
        result.reason = _merge(result.reason, reason)
        log.info(
            "retention expired topic=%s ranges=%d from=%d to=%d bytes=%d reason=%s",
            topic,
            len(chunk),
            chunk[0].start_offset,
            chunk[-1].end_offset,
            sum(r.byte_length for r in chunk),
            reason,
        )
    result.kept_bytes = sum(r.byte_length for r in entries)
    floor = await manifest.floor(topic)
    result.floor = None if floor is None else floor.offset
    return result


def _merge(reasons: str, more: str) -> str:
    return ",".join(dict.fromkeys(r for r in (*reasons.split(","), *more.split(",")) if r))


async def manifest_topics(kv: KV, keys: Keys) -> list[str]:
    """Topics with at least one manifest entry, from the keys (one prefix read)."""
    head = f"{keys.prefix}/storage/topics/"
    found: set[str] = set()
    for stored in await kv.get_prefix(head):
        path, sep, _ = stored.key[len(head) :].partition("/objects/")
        if sep:
            found.add(f"/{path}")
    return sorted(found)


__all__ = [
    "CHUNK",
    "RetentionReport",
    "TopicRetention",
    "apply_retention",
    "expired_prefix",
    "manifest_topics",
]
