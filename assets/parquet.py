"""``parquet_partitions``: a topic's committed Parquet, one Dagster partition per topic and hour.

Partitions are a ``MultiPartitionsDefinition`` of a dynamic ``topic`` dimension (added by
``parquet_topics_sensor`` from etcd) and an hourly ``hour`` dimension (UTC). Dagster groups a
single-run backfill's keys by the dimension with fewer selected values, so a backfill of one
topic over many hours is ONE run (one Spark job: the program converts one topic per run);
a backfill over N topics is N runs. Tables narrower than an hour (created by ``tables
convert``) appear as hour partitions that group their minute partitions: an hour is requested
once all its minutes are complete, and its run converts every minute of it.

The asset is thin: it starts the conversion program (``ConvertJobResource``) through
``PipesSubprocessClient`` for exactly its partitions, one process per topic, and reports what
etcd then records for them (rows, first/last offset, files) as materialization metadata. The
program commits each partition exactly once, so a rerun or an overlapping run is harmless.

Checks (``danube_ingest.analytics.checks``), over every table of the active renditions:
``rows_match_offsets``, ``frontier_contiguous``, ``files_intact``.

Job ``parquet_collect`` (op ``collect_parquet``): ``lifecycle.collect`` over every table, its
counts as metadata.
"""

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from typing import TypeVar

from dagster import (
    AddDynamicPartitionsRequest,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetExecutionContext,
    AssetSelection,
    BackfillPolicy,
    DefaultSensorStatus,
    DynamicPartitionsDefinition,
    Failure,
    HourlyPartitionsDefinition,
    MaterializeResult,
    MetadataValue,
    MultiPartitionKey,
    MultiPartitionsDefinition,
    OpExecutionContext,
    Output,
    PipesSubprocessClient,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    asset,
    asset_check,
    define_asset_job,
    job,
    op,
    sensor,
)

# Not exported by `dagster` (1.13): what PipesSubprocessClient raises when the program fails.
from dagster._core.errors import DagsterPipesExecutionError

from danube_ingest.analytics.checks import (
    HOUR_MS,
    CheckFinding,
    check_contiguity,
    check_files,
    check_rows,
    committed_parts,
    pending_hours,
    topics_with_manifest,
)
from danube_ingest.analytics.lifecycle import CollectResult, collect
from danube_ingest.metadata import KV, Keys
from danube_ingest.objects.store import ObjectStore
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource

TOPIC_DIM = "topic"
HOUR_DIM = "hour"
#: The first hour Dagster can show. Earlier hours of a topic are converted by ``tables convert``
#: (the sensor skips them); a later start would hide hours already committed.
T = TypeVar("T")

HOURS_START = "2026-01-01-00:00"
HOUR_FORMAT = "%Y-%m-%d-%H:%M"

TOPICS = "danube_topics"
"""The dynamic partitions of the ``topic`` dimension."""
topics_partitions = DynamicPartitionsDefinition(name=TOPICS)
hours_partitions = HourlyPartitionsDefinition(start_date=HOURS_START, timezone="UTC")
parquet_partitions_def = MultiPartitionsDefinition(
    {TOPIC_DIM: topics_partitions, HOUR_DIM: hours_partitions}
)

#: A requested hour still pending this long after its request (its run failed or was lost) is
#: requested again.
RETRY_AFTER_MS = 15 * 60 * 1000


def hour_key(start_ms: int) -> str:
    """The ``hour`` dimension key of the hour starting at ``start_ms``."""
    return datetime.fromtimestamp(start_ms / 1000, UTC).strftime(HOUR_FORMAT)


def hour_start_ms(key: str) -> int:
    """The start (ms) of the hour named by an ``hour`` dimension key."""
    return int(datetime.strptime(key, HOUR_FORMAT).replace(tzinfo=UTC).timestamp() * 1000)


def partition_key(topic: str, start_ms: int) -> MultiPartitionKey:
    """The asset partition of ``topic``'s hour starting at ``start_ms``."""
    return MultiPartitionKey({TOPIC_DIM: topic, HOUR_DIM: hour_key(start_ms)})


def _hours_by_topic(keys: list[str]) -> dict[str, list[int]]:
    by_topic: dict[str, set[int]] = defaultdict(set)
    for key in keys:
        dims = parquet_partitions_def.get_partition_key_from_str(key).keys_by_dimension
        by_topic[dims[TOPIC_DIM]].add(hour_start_ms(dims[HOUR_DIM]))
    return {topic: sorted(hours) for topic, hours in sorted(by_topic.items())}


def _run_etcd(etcd: EtcdResource, work: Callable[[KV, Keys], Awaitable[T]]) -> T:
    async def run() -> T:
        async with etcd.connect() as (kv, keys):
            return await work(kv, keys)

    return asyncio.run(run())


@asset(
    partitions_def=parquet_partitions_def,
    backfill_policy=BackfillPolicy.single_run(),
    group_name="analytics",
    kinds={"spark", "parquet"},
    description=(
        "A topic's messages as committed Hive-style Parquet, one partition per topic and hour "
        "(the Spark program danube_ingest.analytics.job, launched through Pipes)."
    ),
)
def parquet_partitions(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    objects: ObjectStoreResource,
    convert_job: ConvertJobResource,
    pipes_subprocess_client: PipesSubprocessClient,
) -> MaterializeResult[None]:
    """Convert exactly this run's topic hours (one program per topic, every partition of the
    table that starts in those hours); then report their commits from etcd. Fails if the
    program fails or an hour is left uncommitted."""
    by_topic = _hours_by_topic(list(context.partition_keys))
    env = {**etcd.child_env(), **objects.child_env(), **convert_job.child_env()}
    reported = 0
    for topic, hours in by_topic.items():
        width_s = _run_etcd(etcd, partial(_width_s, topic=topic))
        starts = [h + i * width_s * 1000 for h in hours for i in range(3600 // width_s)]
        context.log.info(f"converting topic={topic} hours={len(hours)} partitions={len(starts)}")
        try:
            completed = pipes_subprocess_client.run(
                context=context, command=convert_job.command(topic, starts), env=env
            )
        except DagsterPipesExecutionError as exc:
            shown = ", ".join(hour_key(h) for h in hours)
            raise Failure(
                f"the conversion program failed for topic {topic}, hours {shown} ({exc}); its "
                "error is in this step's stderr (e.g. an hour not complete yet, or an object "
                "missing or damaged); partitions it committed before failing stay committed",
                allow_retries=True,
            ) from exc
        reported += len(completed.get_results())
    rows: list[tuple[str, str, int, int, int, int]] = []
    missing: list[str] = []
    for topic, hours in by_topic.items():
        _, commits = _run_etcd(etcd, partial(committed_parts, topic=topic))
        for hour in hours:
            inside = [c for c in commits if hour <= c.start_ms < hour + HOUR_MS]
            if not inside or inside[-1].end_ms != hour + HOUR_MS:
                missing.append(f"{topic} {hour_key(hour)}")
                continue
            offsets = [c for c in inside if c.rows]
            rows.append(
                (
                    topic,
                    hour_key(hour),
                    sum(c.rows for c in inside),
                    offsets[0].first_offset if offsets else -1,
                    offsets[-1].last_offset if offsets else -1,
                    sum(len(c.files) for c in inside),
                )
            )
    if missing:
        raise Failure(
            f"the conversion left {len(missing)} hour(s) uncommitted: {', '.join(missing)}; "
            "are they complete (the topic clock past their end)? Run the partitions again",
            allow_retries=True,
        )
    table = (
        "| topic | hour | rows | first offset | last offset | files |\n|---|---|---|---|---|---|\n"
    )
    table += "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in rows)
    return MaterializeResult(
        metadata={
            "rows": sum(r[2] for r in rows),
            "first_offset": min((r[3] for r in rows if r[3] >= 0), default=-1),
            "last_offset": max((r[4] for r in rows), default=-1),
            "files": sum(r[5] for r in rows),
            "hours": len(rows),
            "pipes_reports": reported,
            "partitions": MetadataValue.md(table),
        }
    )


async def _width_s(kv: KV, keys: Keys, topic: str) -> int:
    table, _ = await committed_parts(kv, keys, topic)
    return 3600 if table is None else table.width_s


#: The sensor's runs convert only: the checks read every table's files, so they run on their
#: own schedule (job ``parquet_checks``), not after every hour.
parquet_job = define_asset_job(
    "parquet",
    selection=AssetSelection.assets(parquet_partitions).without_checks(),
    tags={"kind": "analytics"},
)


@sensor(
    job=parquet_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Adds every reliable topic with objects as a partition and requests its "
    "complete, uncommitted hours.",
)
def parquet_topics_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult:
    """One pass over etcd: new topics become ``topic`` partitions; each topic's complete,
    uncommitted hours are requested, except those requested less than ``RETRY_AFTER_MS`` ago
    (the cursor: ``{topic: {hour_ms: requested_ms}}``)."""

    async def read(kv: KV, keys: Keys) -> dict[str, list[int]]:
        return {t: await pending_hours(kv, keys, t) for t in await topics_with_manifest(kv, keys)}

    pending = _run_etcd(etcd, read)
    requested: dict[str, dict[str, int]] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(TOPICS))
    new_topics = [t for t in pending if t not in known]
    now_ms = int(time.time() * 1000)
    first_hour = hour_start_ms(HOURS_START)
    runs = []
    cursor: dict[str, dict[str, int]] = {}
    for topic, hours in pending.items():
        before = requested.get(topic, {})
        kept: dict[str, int] = {}
        for hour in hours:
            if hour < first_hour or hour + HOUR_MS > now_ms:
                continue  # not an hour Dagster shows (yet)
            at = before.get(str(hour))
            if at is not None and now_ms - at < RETRY_AFTER_MS:
                kept[str(hour)] = at
                continue
            kept[str(hour)] = now_ms
            runs.append(
                RunRequest(
                    run_key=f"{topic}|{hour}|{now_ms}",
                    partition_key=partition_key(topic, hour),
                    tags={"danube/topic": topic},
                )
            )
        if kept:
            cursor[topic] = kept
    context.log.info(f"topics={len(pending)} new_topics={len(new_topics)} requested={len(runs)}")
    return SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=(
            [AddDynamicPartitionsRequest(TOPICS, new_topics)] if new_topics else []
        ),
        cursor=json.dumps(cursor, sort_keys=True),
        skip_reason=None if runs or new_topics else SkipReason("no complete, uncommitted hour"),
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
        f"- {f.topic} {hour_key(f.start_ms - f.start_ms % HOUR_MS)} ({f.start_ms}): {f.problem}"
        for f in findings[:50]
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


parquet_checks = [rows_match_offsets, frontier_contiguous, files_intact]


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
            return await collect(kv, keys, store, root=objects.warehouse_root)

    result = _run_etcd(etcd, work)
    counts = result.counts()
    held = ", ".join(f"{topic} {rendition}" for topic, rendition in result.held)
    context.log.info(" ".join(f"{k}={v}" for k, v in counts.items()))
    return Output(counts, metadata={**counts, "held": held or "none"})


@job(tags={"kind": "analytics"}, description="Collect what no reader or run needs any more.")
def parquet_collect() -> None:
    """One ``collect_parquet`` step."""
    collect_parquet()


__all__ = [
    "TOPICS",
    "collect_parquet",
    "hour_key",
    "hour_start_ms",
    "parquet_checks",
    "parquet_collect",
    "parquet_job",
    "parquet_partitions",
    "parquet_partitions_def",
    "parquet_topics_sensor",
    "partition_key",
    "topics_partitions",
]
