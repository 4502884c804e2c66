"""``parquet_partitions``: a topic's committed Parquet, one Dagster partition per table partition.

Partitions are one ``DynamicPartitionsDefinition`` (``danube_table_partitions``) whose keys
name a topic and a partition start, ``/default/orders@2026-11-23T10:37`` (UTC, minute
precision): exactly the partitions of each topic's table, from its ``since`` on, a minute each
for a 60 s table and an hour each for an hourly one. ``parquet_topics_sensor`` adds them from
etcd as they become complete, so Dagster shows no partition that cannot be converted, and a
backfill over every partition converts exactly what exists.

The asset is thin: per topic it sorts its partitions with ``preflight.preflight`` (etcd and the
store's listing only, seconds), then starts the conversion program (``ConvertJobResource``)
through Pipes for those to convert, and reports what etcd then records for them (rows,
first/last offset, files) as materialization metadata. A key that is not a partition of the
table (before its ``since``, off its grid) is skipped and listed, never a failure. A run that
cannot convert fails with the cause as its message (partition not complete, object missing,
etcd unreachable, or the program's own error as it reported it through Pipes), and the asset's
check ``converted`` records the cause as metadata. The program commits each partition exactly
once, so a rerun or an overlapping run is harmless.

Backfills use ``BackfillPolicy.single_run()``: Dagster cuts the selected keys into ranges of
consecutive keys (in the order the sensor added them) and launches one run per range; a run
converts one topic per program. Keys of one topic added in one sensor tick are consecutive.

Checks (``danube_ingest.analytics.checks`` and ``iceberg``), over every table of the active
renditions: ``rows_match_offsets``, ``frontier_contiguous``, ``files_intact``,
``iceberg_matches``, ``iceberg_fresh`` (a warning) and ``partitions_fresh`` (a warning: complete
partitions still unconverted ``LATE_AFTER_S`` after their end, by the topic clock).

Job ``parquet_collect`` (op ``collect_parquet``): ``lifecycle.collect`` over every table, its
counts as metadata.

Job ``iceberg_maintenance`` (op ``maintain_iceberg``): ``iceberg.maintain`` over every table
(expire old snapshots, delete orphan metadata files), its totals as metadata.
"""

import asyncio
import json
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeVar

from dagster import (
    AddDynamicPartitionsRequest,
    AssetCheckExecutionContext,
    AssetCheckKey,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetSelection,
    BackfillPolicy,
    DagsterRunStatus,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    Failure,
    Field,
    MaterializeResult,
    MetadataValue,
    OpExecutionContext,
    Output,
    PipesSubprocessClient,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    asset,
    asset_check,
    define_asset_job,
    job,
    op,
    open_pipes_session,
    sensor,
)
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
)

from danube_ingest.analytics.checks import (
    CheckFinding,
    check_contiguity,
    check_files,
    check_rows,
    committed_parts,
    topics_with_manifest,
)
from danube_ingest.analytics.convert import failure_cause, pending_partitions
from danube_ingest.analytics.iceberg import (
    FRESHNESS_SLACK_S,
    MIN_SNAPSHOTS,
    Freshness,
    IcebergTarget,
    MaintenanceResult,
    check_table,
    freshness,
    maintain,
)
from danube_ingest.analytics.layout import DEFAULT_WIDTH_S, partition_end
from danube_ingest.analytics.lifecycle import CollectResult, collect
from danube_ingest.analytics.preflight import Preflight, preflight, table_starts
from danube_ingest.analytics.renditions import read_table
from danube_ingest.config.values import parse_duration
from danube_ingest.errors import ConfigError, DanubeIngestError
from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.clock import read_clock
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource

T = TypeVar("T")

PARTITIONS = "danube_table_partitions"
"""The dynamic partitions of ``parquet_partitions``: one key per table partition."""
table_partitions = DynamicPartitionsDefinition(name=PARTITIONS)
KEY_SEPARATOR = "@"
START_FORMAT = "%Y-%m-%dT%H:%M"

#: A requested partition still pending this long after its request (its run failed or was
#: lost) is requested again.
RETRY_AFTER_MS = 15 * 60 * 1000
#: Keys the sensor adds per topic and tick: a day of minute partitions. A table whose since is
#: long ago is shown in full over a few ticks rather than in one enormous request.
ADD_LIMIT = 1440
#: Run statuses during which a topic's run is in flight: the sensor requests nothing more of
#: that topic until it ends (a minute table then gets one run per run's length, not per minute).
IN_FLIGHT = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]
TOPIC_TAG = "danube/topic"

CONVERTED = "converted"
"""The asset's own check: whether the run converted every partition it was asked for."""
converted_check_key = AssetCheckKey(AssetKey("parquet_partitions"), CONVERTED)


def partition_key(topic: str, start_ms: int) -> str:
    """The partition key of ``topic``'s table partition starting at ``start_ms``."""
    start = datetime.fromtimestamp(start_ms / 1000, UTC).strftime(START_FORMAT)
    return f"{topic}{KEY_SEPARATOR}{start}"


def parse_partition_key(key: str) -> tuple[str, int]:
    """``(topic, start_ms)`` of a partition key; ``Failure`` naming a key of another form."""
    topic, _, start = key.rpartition(KEY_SEPARATOR)
    try:
        moment = datetime.strptime(start, START_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        moment = None
    if not topic or moment is None:
        raise Failure(
            f"partition key {key!r} is not of the form /namespace/topic@YYYY-MM-DDTHH:MM (UTC); "
            f"remove it from {PARTITIONS} and let parquet_topics_sensor add the table's keys"
        )
    return topic, int(moment.timestamp() * 1000)


def _starts_by_topic(keys: Sequence[str]) -> dict[str, list[int]]:
    by_topic: dict[str, set[int]] = defaultdict(set)
    for key in keys:
        topic, start = parse_partition_key(key)
        by_topic[topic].add(start)
    return {topic: sorted(starts) for topic, starts in sorted(by_topic.items())}


def _run_etcd(etcd: EtcdResource, work: Callable[[KV, Keys], Awaitable[T]]) -> T:
    async def run() -> T:
        async with etcd.connect() as (kv, keys):
            return await work(kv, keys)

    return asyncio.run(run())


class _Refused(Exception):
    """Why a run cannot convert: its message and cause, for the failure and the check."""

    def __init__(self, message: str, cause: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.cause = cause
        self.retriable = retriable


def _preflight(
    etcd: EtcdResource, objects: ObjectStoreResource, topic: str, starts: list[int]
) -> Preflight:
    """``preflight.preflight`` of the run's partitions of ``topic``; ``_Refused`` with the
    cause when it refuses them or etcd cannot be reached."""

    async def work(kv: KV, keys: Keys) -> Preflight:
        async with objects.open() as store:
            return await preflight(kv, keys, topic, starts, objects=store)

    try:
        return _run_etcd(etcd, work)
    except DanubeIngestError as exc:
        cause = failure_cause(exc)
        where = f" at {etcd.endpoints}" if cause == "etcd_unreachable" else ""
        raise _Refused(
            f"cannot convert {topic}{where}: {exc}", cause, retriable=bool(exc.retriable)
        ) from exc


def _convert(
    context: AssetExecutionContext,
    client: PipesSubprocessClient,
    command: list[str],
    env: dict[str, str],
    topic: str,
) -> int:
    """Run the conversion program through Pipes; the number of partitions it reported.
    ``_Refused`` with the error the program reported through Pipes when it fails (else its
    exit code and where its output is)."""
    with open_pipes_session(
        context=context,
        context_injector=client.context_injector,
        message_reader=client.message_reader,
    ) as session:
        process = subprocess.Popen(
            command,
            cwd=client.cwd,
            env={**os.environ, **client.env, **env, **session.get_bootstrap_env_vars()},
        )
        code = process.wait()
    messages: list[Any] = list(session.get_custom_messages())
    if code == 0:
        return sum(1 for m in messages if isinstance(m, dict) and "start_ms" in m)
    errors = [m for m in messages if isinstance(m, dict) and "error" in m]
    if errors:
        error = errors[-1]
        raise _Refused(
            f"the conversion program failed for {topic}: {error['error']}",
            str(error.get("cause", "conversion")),
            retriable=bool(error.get("retriable", False)),
        )
    raise _Refused(
        f"the conversion program failed for {topic} with exit code {code} before reporting "
        "why; its output is in this step's stderr (partitions it committed stay committed)",
        "program_crashed",
        retriable=True,
    )


def _commit_rows(
    etcd: EtcdResource, topic: str, starts: list[int]
) -> tuple[list[tuple[str, int, int, int, int]], list[str]]:
    """``(key, rows, first offset, last offset, files)`` of each of ``starts`` committed, and
    the keys of those not committed."""
    _, commits = _run_etcd(etcd, partial(committed_parts, topic=topic))
    by_start = {c.start_ms: c for c in commits}
    rows, missing = [], []
    for start in starts:
        commit = by_start.get(start)
        if commit is None:
            missing.append(partition_key(topic, start))
            continue
        rows.append(
            (
                partition_key(topic, start),
                commit.rows,
                commit.first_offset if commit.rows else -1,
                commit.last_offset if commit.rows else -1,
                len(commit.files),
            )
        )
    return rows, missing


def _md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> MetadataValue:
    text = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n"
    text += "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in rows)
    return MetadataValue.md(text if rows else "none")


@asset(
    partitions_def=table_partitions,
    backfill_policy=BackfillPolicy.single_run(),
    deps=[AssetKey("object_manifest")],
    check_specs=[
        AssetCheckSpec(
            CONVERTED,
            asset="parquet_partitions",
            description="The run converted every partition it was asked for; when not, its "
            "metadata say why (cause: not_complete, object_missing, etcd_unreachable, ...).",
        )
    ],
    group_name="analytics",
    kinds={"spark", "parquet"},
    description=(
        "A topic's messages as committed Hive-style Parquet, one partition per table "
        "partition from the table's since (the Spark program danube_ingest.analytics.job, "
        "launched through Pipes)."
    ),
)
def parquet_partitions(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    objects: ObjectStoreResource,
    convert_job: ConvertJobResource,
    pipes_subprocess_client: PipesSubprocessClient,
) -> Iterator[MaterializeResult[None] | AssetCheckResult]:
    """Convert exactly this run's table partitions (one program per topic, only those not
    committed yet; keys that are not partitions of their table are skipped and listed); then
    report their commits from etcd. Fails with the cause as message and as the ``converted``
    check's metadata when a partition cannot be converted; partitions committed before stay."""
    check = converted_check_key in context.selected_asset_check_keys
    by_topic = _starts_by_topic(list(context.partition_keys))
    env = {**etcd.child_env(), **objects.child_env(), **convert_job.child_env()}
    reported = 0
    rows: list[tuple[str, int, int, int, int]] = []
    skipped: list[tuple[str, str]] = []
    try:
        for topic, starts in by_topic.items():
            checked = _preflight(etcd, objects, topic, starts)
            skipped.extend((partition_key(topic, s), why) for s, why in checked.outside.items())
            context.log.info(
                f"topic={topic} requested={len(starts)} convert={len(checked.convert)} "
                f"committed={len(checked.committed)} skipped={len(checked.outside)}"
            )
            if checked.convert:
                command = convert_job.command(topic, checked.convert)
                reported += _convert(context, pipes_subprocess_client, command, env, topic)
            done, missing = _commit_rows(etcd, topic, sorted(checked.convert + checked.committed))
            if missing:
                raise _Refused(
                    f"the conversion left {len(missing)} partition(s) of {topic} uncommitted: "
                    f"{', '.join(missing[:10])}; run them again",
                    "uncommitted",
                    retriable=True,
                )
            rows.extend(done)
    except _Refused as refused:
        context.log.error(f"conversion refused cause={refused.cause} error={refused}")
        if check:
            yield AssetCheckResult(
                check_name=CONVERTED,
                passed=False,
                severity=AssetCheckSeverity.ERROR,
                metadata={
                    "cause": refused.cause,
                    "error": str(refused),
                    "retriable": refused.retriable,
                    "committed_before": len(rows),
                },
            )
        raise Failure(
            str(refused),
            metadata={"cause": refused.cause, "retriable": refused.retriable},
            allow_retries=refused.retriable,
        ) from refused
    for key, why in skipped:
        context.log.info(f"skipped partition={key} reason={why}")
    with_rows = [r for r in rows if r[2] >= 0]
    yield MaterializeResult(
        metadata={
            "rows": sum(r[1] for r in rows),
            "first_offset": min((r[2] for r in with_rows), default=-1),
            "last_offset": max((r[3] for r in with_rows), default=-1),
            "files": sum(r[4] for r in rows),
            "partitions": len(rows),
            "skipped": len(skipped),
            "pipes_reports": reported,
            "table": _md_table(["partition", "rows", "first offset", "last offset", "files"], rows),
            "skipped_partitions": _md_table(["partition", "why"], skipped),
        },
        check_results=(
            [
                AssetCheckResult(
                    check_name=CONVERTED,
                    passed=True,
                    metadata={"partitions": len(rows), "skipped": len(skipped)},
                )
            ]
            if check
            else []
        ),
    )


#: The sensor's runs convert and record the ``converted`` check; the other checks read every
#: table's files, so they run on their own schedule (job ``parquet_checks``).
parquet_job = define_asset_job(
    "parquet",
    selection=AssetSelection.assets(parquet_partitions).without_checks()
    | AssetSelection.checks(converted_check_key),
    tags={"kind": "analytics"},
)


def _segments(order: Sequence[str], wanted: set[str]) -> list[list[str]]:
    """``wanted`` cut into runs of keys consecutive in ``order`` (what one range names)."""
    segments: list[list[str]] = []
    previous = False
    for key in order:
        if key in wanted:
            if previous:
                segments[-1].append(key)
            else:
                segments.append([key])
        previous = key in wanted
    return segments


@sensor(
    job=parquet_job,
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Adds every complete partition of every reliable topic's table as a "
    "partition of parquet_partitions and requests the uncommitted ones.",
)
def parquet_topics_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult:
    """One pass over etcd: each topic's complete table partitions not shown yet become keys
    (from the table's ``since``, ``ADD_LIMIT`` per tick); each topic's pending partitions (complete,
    not committed) are requested as one run per range of consecutive keys, except while a run
    of that topic is in flight and those requested less than ``RETRY_AFTER_MS`` ago (the
    cursor: ``{key: requested_ms}``)."""
    known = list(context.instance.get_dynamic_partitions(PARTITIONS))
    last: dict[str, int] = {}
    for key in known:
        try:
            topic, start = parse_partition_key(key)
        except Failure as exc:
            # A key added by hand: the asset refuses it when run; it must not stop the sensor.
            context.log.warning(f"ignored partition={key!r} error={exc.description}")
            continue
        last[topic] = max(start, last.get(topic, start))

    async def read(kv: KV, keys: Keys) -> dict[str, tuple[list[int], list[int]]]:
        found = {}
        for topic in await topics_with_manifest(kv, keys):
            new = await table_starts(kv, keys, topic, after_ms=last.get(topic), limit=ADD_LIMIT)
            found[topic] = (new, await pending_partitions(kv, keys, topic))
        return found

    found = _run_etcd(etcd, read)
    added = [partition_key(t, s) for t, (new, _) in found.items() for s in new]
    order = known + added
    shown = set(order)
    requested: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    now_ms = int(time.time() * 1000)
    runs = []
    cursor: dict[str, int] = {}
    for topic, (_, pending) in found.items():
        pending_keys = [k for k in (partition_key(topic, s) for s in pending) if k in shown]
        busy = context.instance.get_runs(
            filters=RunsFilter(tags={TOPIC_TAG: topic}, statuses=IN_FLIGHT), limit=1
        )
        due: set[str] = set()
        for key in pending_keys:
            at = requested.get(key)
            if busy or (at is not None and now_ms - at < RETRY_AFTER_MS):
                if at is not None:
                    cursor[key] = at
                continue
            due.add(key)
        for segment in _segments(order, due):
            cursor.update(dict.fromkeys(segment, now_ms))
            runs.append(
                RunRequest(
                    run_key=f"{segment[0]}|{segment[-1]}|{now_ms}",
                    tags={
                        TOPIC_TAG: topic,
                        ASSET_PARTITION_RANGE_START_TAG: segment[0],
                        ASSET_PARTITION_RANGE_END_TAG: segment[-1],
                    },
                )
            )
    context.log.info(f"topics={len(found)} added={len(added)} requested={len(runs)}")
    return SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=(
            [AddDynamicPartitionsRequest(PARTITIONS, added)] if added else []
        ),
        cursor=json.dumps(cursor, sort_keys=True),
        skip_reason=None if runs or added else SkipReason("no new or uncommitted partition"),
    )


def _check(
    etcd: EtcdResource,
    objects: ObjectStoreResource,
    check: Callable[[KV, Keys, ObjectStore, str], Awaitable[list[CheckFinding]]],
) -> AssetCheckResult:
    async def work(kv: KV, keys: Keys) -> tuple[int, list[CheckFinding]]:
        async with objects.open() as store:
            topics = await topics_with_manifest(kv, keys)
            findings = [f for t in topics for f in await check(kv, keys, store, t)]
            return len(topics), findings

    topics, findings = _run_etcd(etcd, work)
    shown = "\n".join(
        f"- {partition_key(f.topic, f.start_ms)} ({f.start_ms}): {f.problem}" for f in findings[:50]
    )
    return AssetCheckResult(
        passed=not findings,
        metadata={
            "topics": topics,
            "findings": len(findings),
            "details": MetadataValue.md(shown or "none"),
        },
    )


@asset_check(
    asset=parquet_partitions,
    description="Committed rows equal the files' footers and "
    "the manifest's entries in the partition's offset range.",
)
def rows_match_offsets(
    context: AssetCheckExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> AssetCheckResult:
    """``checks.check_rows`` over every table."""

    async def rows(kv: KV, keys: Keys, store: ObjectStore, topic: str) -> list[CheckFinding]:
        return await check_rows(kv, keys, store, topic)

    return _check(etcd, objects, rows)


@asset_check(
    asset=parquet_partitions,
    description="No gap between committed partitions from the table's since to its upper.",
)
def frontier_contiguous(
    context: AssetCheckExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> AssetCheckResult:
    """``checks.check_contiguity`` over every table."""

    async def gaps(kv: KV, keys: Keys, store: ObjectStore, topic: str) -> list[CheckFinding]:
        return await check_contiguity(kv, keys, topic)

    return _check(etcd, objects, gaps)


@asset_check(
    asset=parquet_partitions,
    description="Every committed file exists with its recorded size (and CRC32C up to 64 MiB).",
)
def files_intact(
    context: AssetCheckExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> AssetCheckResult:
    """``checks.check_files`` over every table."""

    async def files(kv: KV, keys: Keys, store: ObjectStore, topic: str) -> list[CheckFinding]:
        return await check_files(kv, keys, store, topic)

    return _check(etcd, objects, files)


@asset_check(
    asset=parquet_partitions,
    description="The topic's Iceberg table holds exactly the published files of its active "
    "rendition up to its upper, no offset twice, and its snapshots' frontiers never move back.",
)
def iceberg_matches(
    context: AssetCheckExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> AssetCheckResult:
    """``iceberg.check_table`` over every table (passes with no finding when the catalog is
    ``off``)."""
    target = IcebergTarget.from_config(objects.broker_config())

    async def tables(kv: KV, keys: Keys, store: ObjectStore, topic: str) -> list[CheckFinding]:
        return [] if target is None else await check_table(kv, keys, topic, target)

    return _check(etcd, objects, tables)


@asset_check(
    asset=parquet_partitions,
    description="Each topic's Iceberg table trails its topic clock by at most its partition "
    f"width plus {FRESHNESS_SLACK_S:.0f} s (a warning otherwise); the lag of every table is "
    "in the metadata.",
)
def iceberg_fresh(etcd: EtcdResource, objects: ObjectStoreResource) -> AssetCheckResult:
    """``iceberg.freshness`` of every table: topic clock minus the current snapshot's frontier
    (passes with no table when the catalog is ``off``)."""
    target = IcebergTarget.from_config(objects.broker_config())

    async def work(kv: KV, keys: Keys) -> list[Freshness]:
        if target is None:
            return []
        found = [await freshness(kv, keys, t, target) for t in await topics_with_manifest(kv, keys)]
        return [f for f in found if f is not None]

    tables = _run_etcd(etcd, work)
    stale = [f for f in tables if f.stale()]

    def seconds(ms: int | None) -> str:
        return "-" if ms is None else f"{ms / 1000:.0f}"

    def when(ms: int | None) -> str:
        return "-" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat()

    rows = [
        f"| {f.table} | {when(f.frontier_ms)} | {when(f.clock_ms)} | {seconds(f.lag_ms)} | "
        f"{f.width_s} | {'**stale**' if f.stale() else 'ok'} |"
        for f in sorted(tables, key=lambda f: (not f.stale(), f.table))
    ]
    header = (
        "| table | snapshot frontier | topic clock | lag s | width s | |\n|---|---|---|---|---|---|"
    )
    lags = [f.lag_ms for f in tables if f.lag_ms is not None]
    return AssetCheckResult(
        passed=not stale,
        severity=AssetCheckSeverity.WARN,
        metadata={
            "tables": len(tables),
            "stale": len(stale),
            "max_lag_s": max(lags, default=0) / 1000,
            "details": MetadataValue.md("\n".join([header, *rows[:100]]) if rows else "none"),
        },
    )


#: A complete partition still not committed when its topic's clock is this far past the
#: partition's end is late (``partitions_fresh``): its table then trails the clock by more than
#: its width plus ``iceberg.FRESHNESS_SLACK_S``, the bound ``iceberg_fresh`` holds tables to.
LATE_AFTER_S = FRESHNESS_SLACK_S


async def late_partitions(
    kv: KV, keys: Keys, topic: str, *, late_after_s: float = LATE_AFTER_S
) -> tuple[list[int], int, int | None]:
    """``(starts, width_s, clock_ms)``: the starts of ``topic``'s complete partitions not
    committed in the active rendition (``convert.pending_partitions``: at most a day of minute
    partitions from the rendition's upper) whose end the topic clock passed more than
    ``late_after_s`` ago, in order."""
    pending = await pending_partitions(kv, keys, topic)
    if not pending:
        return [], 0, None
    table = await read_table(kv, keys, topic)
    width_s = DEFAULT_WIDTH_S if table is None else table.width_s
    clock = await read_clock(kv, keys, topic)
    if clock is None:
        return [], width_s, None
    due = clock.ingest_ms - int(late_after_s * 1000)
    return [s for s in pending if partition_end(s, width_s) < due], width_s, clock.ingest_ms


@asset_check(
    asset=parquet_partitions,
    description="No complete partition is still unconverted when its topic's clock is more than "
    f"{LATE_AFTER_S / 60:.0f} min past its end (a warning otherwise); the metadata name each "
    "table's late partitions and the oldest.",
)
def partitions_fresh(etcd: EtcdResource) -> AssetCheckResult:
    """``late_partitions`` of every topic: each is a finding named by its partition key."""

    async def work(kv: KV, keys: Keys) -> tuple[int, dict[str, tuple[list[int], int, int]]]:
        topics = await topics_with_manifest(kv, keys)
        found = {}
        for topic in topics:
            starts, width_s, clock_ms = await late_partitions(kv, keys, topic)
            if starts and clock_ms is not None:
                found[topic] = (starts, width_s, clock_ms)
        return len(topics), found

    topics, late = _run_etcd(etcd, work)
    rows = [
        (
            topic,
            len(starts),
            partition_key(topic, starts[0]),
            f"{(clock_ms - partition_end(starts[0], width_s)) / 60_000:.0f}",
        )
        for topic, (starts, width_s, clock_ms) in late.items()
    ]
    late_keys = [partition_key(t, s) for t, (starts, _, _) in late.items() for s in starts]
    shown = "\n".join(f"- {k}" for k in late_keys[:50]) + (
        f"\n- ... and {len(late_keys) - 50} more" if len(late_keys) > 50 else ""
    )
    return AssetCheckResult(
        passed=not late_keys,
        severity=AssetCheckSeverity.WARN,
        metadata={
            "topics": topics,
            "late": len(late_keys),
            "late_tables": len(late),
            "late_after_s": LATE_AFTER_S,
            "by_table": _md_table(
                ["topic", "late partitions", "oldest late partition", "min past its end"], rows
            ),
            "details": MetadataValue.md(shown if late_keys else "none"),
        },
    )


parquet_checks = [
    rows_match_offsets,
    frontier_contiguous,
    files_intact,
    iceberg_matches,
    iceberg_fresh,
    partitions_fresh,
]


@op(
    description="Deletes dead conversion runs' staging (after an hour) and the draining "
    "renditions no reader holds (danube_ingest.analytics.lifecycle.collect).",
    tags={"kind": "analytics"},
)
def collect_parquet(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[dict[str, int]]:
    """``lifecycle.collect`` over every table; its counts as the output and its metadata (a
    held rendition is counted, not a failure: the next run collects it)."""

    async def work(kv: KV, keys: Keys) -> CollectResult:
        async with objects.open() as store:
            return await collect(
                kv,
                keys,
                store,
                root=objects.warehouse_root,
                iceberg=IcebergTarget.from_config(objects.broker_config()),
            )

    result = _run_etcd(etcd, work)
    counts = result.counts()
    held = ", ".join(f"{topic} {rendition}" for topic, rendition in result.held)
    context.log.info(" ".join(f"{k}={v}" for k, v in counts.items()))
    return Output(counts, metadata={**counts, "held": held or "none"})


@job(tags={"kind": "analytics"}, description="Collect what no reader or run needs any more.")
def parquet_collect() -> None:
    """One ``collect_parquet`` step."""
    collect_parquet()


@op(
    description="Expires each Iceberg table's snapshots older than max_snapshot_age, and its "
    "tail-only snapshots older than max_tail_snapshot_age (never the current one nor the newest "
    "min_snapshots), and deletes its metadata files nothing references, once older than "
    "orphan_grace (danube_ingest.analytics.iceberg.maintain).",
    config_schema={
        "max_snapshot_age": Field(str, default_value="5d"),
        "max_tail_snapshot_age": Field(str, default_value="1h"),
        "min_snapshots": Field(int, default_value=MIN_SNAPSHOTS),
        "orphan_grace": Field(str, default_value="1h"),
    },
    tags={"kind": "analytics"},
)
def maintain_iceberg(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[dict[str, int]]:
    """``iceberg.maintain`` over every topic's table; totals as output and metadata (nothing to
    do when the catalog is ``off``)."""
    config = context.op_config
    try:
        max_age = parse_duration(config["max_snapshot_age"])
        max_tail_age = parse_duration(config["max_tail_snapshot_age"])
        grace = parse_duration(config["orphan_grace"])
    except (ConfigError, ValueError) as exc:
        raise Failure(f"iceberg_maintenance config: {exc}") from exc
    target = IcebergTarget.from_config(objects.broker_config())

    async def work(kv: KV, keys: Keys) -> list[MaintenanceResult]:
        if target is None:
            return []
        done = []
        for topic in await topics_with_manifest(kv, keys):
            result = await maintain(
                target,
                topic,
                max_snapshot_age_s=max_age,
                max_tail_snapshot_age_s=max_tail_age,
                min_snapshots=config["min_snapshots"],
                orphan_grace_s=grace,
                tails=(kv, keys, objects.warehouse_root),
            )
            if result is not None:
                done.append(result)
        return done

    results = _run_etcd(etcd, work)
    totals = {
        "tables": len(results),
        "snapshots_expired": sum(r.snapshots_expired for r in results),
        "snapshots_kept": sum(r.snapshots_kept for r in results),
        "files_deleted": sum(r.files_deleted for r in results),
        "bytes_deleted": sum(r.bytes_deleted for r in results),
    }
    context.log.info(" ".join(f"{k}={v}" for k, v in totals.items()))
    return Output(totals, metadata=dict(totals))


@job(tags={"kind": "analytics"}, description="Expire old Iceberg snapshots, delete orphans.")
def iceberg_maintenance() -> None:
    """One ``maintain_iceberg`` step."""
    maintain_iceberg()


__all__ = [
    "PARTITIONS",
    "collect_parquet",
    "converted_check_key",
    "iceberg_maintenance",
    "late_partitions",
    "maintain_iceberg",
    "parquet_checks",
    "parquet_collect",
    "parquet_job",
    "parquet_partitions",
    "parquet_topics_sensor",
    "parse_partition_key",
    "partition_key",
    "partitions_fresh",
    "table_partitions",
]
