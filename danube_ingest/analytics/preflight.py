"""What a conversion of chosen partitions will do, decided from etcd (and the object store's
listing) before anything heavy starts: the Dagster asset and the Spark program ask this before
a SparkSession exists, so a run that cannot succeed fails in seconds with its cause.

:func:`preflight` sorts the requested partition starts of a topic's table into

* ``convert`` - complete and not committed: a run converts them;
* ``committed`` - already committed by the active rendition (a run reports them);
* ``outside`` - not partitions of the table at all: before its ``since`` (not kept) or not
  on its grid (another width). A run skips them; they are not an error.

and raises :class:`~danube_ingest.analytics.convert.ConvertError` with ``cause``
``not_complete`` (the topic clock has not passed a requested partition's end) or, given the
object store, ``object_missing`` (a manifest object the partitions read is absent). etcd
errors (``MetadataUnavailableError`` when it cannot be reached) pass through unchanged.
Without a table, the table a first run would create (``convert.first_since``, ``width_s``) is
the one judged. Reads only; changes nothing.

:func:`table_starts` lists a table's complete partitions from its ``since`` (the partitions
that exist), for a scheduler that names them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from danube_ingest.analytics.convert import ConvertError, first_since, not_complete_error
from danube_ingest.analytics.layout import DEFAULT_WIDTH_S, check_width
from danube_ingest.analytics.plan import DEFAULT_LIMIT, complete_partitions, read_plan_input
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.analytics.renditions import read_table
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.objects.store import ObjectStore

__all__ = ["Preflight", "preflight", "table_starts"]


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Preflight:
    """The requested partitions of one topic, sorted by what a run does with them."""

    topic: str
    width_s: int
    since_ms: int
    """The table's ``since`` (or the one a first run would give it)."""
    convert: list[int] = field(default_factory=list)
    """Starts to convert, in order."""
    committed: list[int] = field(default_factory=list)
    """Starts already committed by the active rendition, in order."""
    outside: dict[int, str] = field(default_factory=dict)
    """Starts that are not partitions of the table, each with why."""
    objects: list[str] = field(default_factory=list)
    """The object keys the partitions to convert read, in order."""


async def preflight(
    kv: KV,
    keys: Keys,
    topic: str,
    starts_ms: Sequence[int],
    *,
    width_s: int = DEFAULT_WIDTH_S,
    objects: ObjectStore | None = None,
) -> Preflight:
    """Sort ``starts_ms`` of ``topic`` (module docstring); ``ConvertError`` when one is not
    complete or, with ``objects``, when an object they read is missing. ``width_s`` applies only
    while the topic has no table."""
    plan_input = await read_plan_input(kv, keys, topic)
    table = await read_table(kv, keys, topic)
    committed: dict[int, PartitionCommit] = {}
    if table is None:
        width_s, since = check_width(width_s), first_since(plan_input, width_s)
    else:
        width_s, since = table.width_s, table.since_ms
        if table.active is not None:
            prefix = TableKeys(keys, topic).parts_prefix(table.active)
            records = [PartitionCommit.decode(e.value, e.key) for e in await kv.get_prefix(prefix)]
            committed = {r.start_ms: r for r in records}
    result = Preflight(topic, width_s, since)
    width_ms = width_s * 1000
    not_complete: list[int] = []
    wanted: set[str] = set()
    for start in sorted(set(starts_ms)):
        if start < 0 or start % width_ms:
            result.outside[start] = (
                f"{_iso(start)} is not the start of a partition of the table ({width_s} s wide)"
            )
        elif start < since:
            result.outside[start] = (
                f"{_iso(start)} is before the table's since {_iso(since)}: not part of the table"
            )
        elif start in committed:
            result.committed.append(start)
        else:
            found = complete_partitions(
                plan_input.clock, plan_input.ranges, width_s=width_s, upper_ms=start, limit=1
            )
            if not found or found[0].start_ms != start:
                not_complete.append(start)
                continue
            result.convert.append(start)
            wanted.update(r.object_key for r in found[0].ranges)
    if not_complete:
        error = not_complete_error(topic, not_complete[0], width_s, plan_input)
        more = f" (and {len(not_complete) - 1} later partition(s))" if len(not_complete) > 1 else ""
        raise ConvertError(f"{error}{more}", cause="not_complete")
    result.objects.extend(sorted(wanted))
    if objects is not None:
        missing = [key for key in result.objects if await objects.size(key) is None]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ConvertError(
                f"{len(missing)} object(s) the manifest names for {topic}'s requested "
                f"partitions are missing from the object store: {shown}; restore them (or "
                "retire their ranges) before converting these partitions",
                cause="object_missing",
            )
    return result


async def table_starts(
    kv: KV,
    keys: Keys,
    topic: str,
    *,
    after_ms: int | None = None,
    width_s: int = DEFAULT_WIDTH_S,
    limit: int = DEFAULT_LIMIT,
) -> list[int]:
    """Starts of ``topic``'s table's complete partitions, in order, from its ``since`` (or,
    given ``after_ms``, from the partition after it), at most ``limit``. Without a table,
    those of the table a first run with ``width_s`` would create."""
    plan_input = await read_plan_input(kv, keys, topic)
    if not plan_input.ranges and plan_input.clock is None:
        return []
    table = await read_table(kv, keys, topic)
    if table is None:
        since = first_since(plan_input, width_s)
    else:
        width_s, since = table.width_s, table.since_ms
    upper = since if after_ms is None else max(since, after_ms - after_ms % (width_s * 1000))
    if after_ms is not None and upper <= after_ms:
        upper += width_s * 1000
    partitions = complete_partitions(
        plan_input.clock, plan_input.ranges, width_s=width_s, upper_ms=upper, limit=limit
    )
    return [p.start_ms for p in partitions]
