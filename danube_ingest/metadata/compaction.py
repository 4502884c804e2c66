"""etcd history compaction (issue 13, run by Dagster every 6 hours).

Every write adds a revision to etcd's history, and etcd keeps every old revision until it is
compacted: without compaction the database grows for ever (and hits its quota, after which
etcd refuses writes). ``compact_history`` compacts at a revision old enough that no reader of
old revisions still needs it:

* **Time.** Each run records a sample ``(now_ms, revision)`` in ``compaction/samples`` and
  compacts at the newest sample older than ``keep_s`` (default an hour): the last ``keep_s`` of
  history are always kept, for watches that resume from a revision (a Dagster sensor's
  cursor, a broker's watch reconnecting). The first run only records its sample.
* **Holds.** A reader that must read from an old revision for longer registers a hold
  ``revision_holds/{name}`` = ``{revision, holder}`` (under its lease, so a dead holder's hold
  goes with it: ``hold_revision``); an open Parquet conversion's intent counts as a hold at
  its input revision. Compaction never goes past the lowest hold.

Guarantees: never compacts history newer than ``keep_s`` or at or above any hold's revision;
never compacts backwards (a revision at or below the last compaction is skipped); idempotent
(a re-run with no new sample older than ``keep_s`` does nothing).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError, RevisionCompactedError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV

log = logging.getLogger(__name__)

#: An hour: far longer than a watch takes to reconnect or a sensor tick to come round.
DEFAULT_KEEP_S = 3600.0


@dataclass
class CompactionReport:
    """What one ``compact_history`` run found and did."""

    revision: int
    """The store's revision when the run began (of its sample)."""
    compacted: int | None = None
    """The revision compacted at by this run, ``None`` if none."""
    previous: int = 0
    """The revision of the last compaction before this run (0: never)."""
    held_by: list[str] = field(default_factory=list)
    """Holds that kept the compaction lower than ``keep_s`` alone would have."""
    db_size: int | None = None
    """The store's database size in bytes after the run, where known."""


@dataclass(frozen=True, slots=True)
class _State:
    samples: list[tuple[int, int]]
    compacted: int

    def encode(self) -> bytes:
        raw = {"samples": [list(s) for s in self.samples], "compacted": self.compacted}
        return json.dumps(raw, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> _State:
        try:
            raw = values.loads(data)
            samples = [(int(ms), int(rev)) for ms, rev in raw["samples"]]
            return cls(samples, int(raw["compacted"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed compaction samples at {key}: {exc}") from exc


async def hold_revision(
    kv: KV, keys: Keys, name: str, revision: int, *, holder: str, lease: int | None = None
) -> None:
    """Keep etcd history from ``revision`` on until ``release_revision`` (or the lease ends)."""
    value = json.dumps({"revision": revision, "holder": holder}, separators=(",", ":"))
    await kv.put(keys.revision_hold(name), value.encode(), lease=lease)


async def release_revision(kv: KV, keys: Keys, name: str) -> None:
    """Drop the hold ``name`` (nothing if it is gone)."""
    await kv.delete(keys.revision_hold(name))


async def revision_holds(kv: KV, keys: Keys) -> dict[str, int]:
    """Holder description -> the lowest revision it needs: every ``revision_holds/`` key and
    every open Parquet conversion's intent (its input revision)."""
    holds: dict[str, int] = {}
    head = keys.revision_holds_prefix()
    for stored in await kv.get_prefix(head):
        try:
            raw = json.loads(stored.value)
            holds[f"hold {stored.key[len(head) :]} ({raw['holder']})"] = int(raw["revision"])
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed revision hold at {stored.key}: {exc}") from exc
    tables = f"{keys.prefix}/tables/"
    for stored in await kv.get_prefix(tables):
        if "/intents/" not in stored.key:
            continue
        try:
            revision = int(json.loads(stored.value)["input_revision"])
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed conversion intent at {stored.key}: {exc}") from exc
        holds[f"conversion {stored.key[len(tables) :]}"] = revision
    return holds


async def compact_history(
    kv: KV, keys: Keys, *, keep_s: float = DEFAULT_KEEP_S, now_ms: int | None = None
) -> CompactionReport:
    """Record this run's sample and compact (see the module docstring)."""
    if keep_s <= 0:
        raise ValueError(f"keep_s must be above zero (got {keep_s})")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    key = keys.compaction_samples()
    stored = await kv.get(key)
    state = _State([], 0) if stored is None else _State.decode(stored.value, key)
    # Writing the state back first gives the store's current revision: the sample's.
    revision = await kv.put(key, state.encode())
    samples = [*state.samples, (now, revision)]
    report = CompactionReport(revision=revision, previous=state.compacted)
    cutoff = now - keep_s * 1000
    old = [s for s in samples if s[0] <= cutoff]
    target = old[-1][1] if old else 0
    holds = await revision_holds(kv, keys)
    if holds and target > min(holds.values()):
        report.held_by = sorted(h for h, rev in holds.items() if rev < target)
        target = min(holds.values())
    compacted = state.compacted
    if target > compacted:
        try:
            await kv.compact(target)
            report.compacted = target
        except RevisionCompactedError:
            log.info("etcd history already compacted past revision=%d", target)
        compacted = target
    # Keep the newest sample at or before the cutoff (the next run's candidate) and the newer.
    kept = samples[max(len(old) - 1, 0) :]
    await kv.put(key, _State(kept, compacted).encode())
    report.db_size = await kv.db_size()
    log.info(
        "etcd compaction revision=%d compacted=%s previous=%d held_by=%d db_size=%s",
        revision,
        report.compacted,
        report.previous,
        len(report.held_by),
        report.db_size,
    )
    return report


__all__ = [
    "DEFAULT_KEEP_S",
    "CompactionReport",
    "compact_history",
    "hold_revision",
    "release_revision",
    "revision_holds",
]
