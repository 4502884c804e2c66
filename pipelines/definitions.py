"""``defs``: everything the Dagster UI shows for danube_ingest."""

from __future__ import annotations

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    Definitions,
    PipesSubprocessClient,
    ScheduleDefinition,
    define_asset_job,
)

from assets import (
    etcd_compaction,
    iceberg_maintenance,
    iceberg_tail_sensor,
    manifest_integrity_checks,
    manifest_integrity_job,
    object_gc,
    object_manifest,
    object_retention,
    parquet_checks,
    parquet_collect,
    parquet_job,
    parquet_partitions,
    parquet_topics_sensor,
    prune_marks_job,
    prune_marks_sensor,
    rotate_topics,
    rotation_sensor,
    topics,
    wal_prune_marks,
)
from assets.iceberg_tables import iceberg_tables
from pipelines.resources import ConvertJobResource, EtcdResource, ObjectStoreResource

parquet_checks_job = define_asset_job(
    "parquet_checks",
    selection=AssetSelection.checks(*parquet_checks),
    tags={"kind": "analytics"},
)

#: Hourly, a little after the hour's conversions: the checks read every committed file (CRC32C
#: up to 64 MiB each), which is not worth doing on every run.
parquet_checks_schedule = ScheduleDefinition(
    job=parquet_checks_job,
    cron_schedule="20 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

#: Hourly, after the hour's conversions and checks: a dead run's staging is collected an hour
#: after it began (``lifecycle.COLLECT_GRACE_S``), a draining rendition once no reader holds it.
parquet_collect_schedule = ScheduleDefinition(
    job=parquet_collect,
    cron_schedule="40 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

#: Hourly, after collection: tail-only snapshots (one per tail step) expire after an hour (the
#: op's ``max_tail_snapshot_age``), the partitions' after days (``max_snapshot_age``, 5 days),
#: and orphan metadata waits an hour (``orphan_grace``). Hourly bounds what a table holds: every
#: snapshot makes each commit slower (docs/benchmarks.md, iceberg_commit.py).
iceberg_maintenance_schedule = ScheduleDefinition(
    job=iceberg_maintenance,
    cron_schedule="45 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

#: Hourly: an orphan is collected an hour after it was written (``orphans.DEFAULT_GRACE_S``).
object_gc_schedule = ScheduleDefinition(
    job=object_gc, cron_schedule="50 * * * *", default_status=DefaultScheduleStatus.RUNNING
)

#: Hourly: the checks of ``object_manifest`` read every object the manifest names (size and
#: CRC32C), so not on every minute.
manifest_integrity_schedule = ScheduleDefinition(
    job=manifest_integrity_job,
    cron_schedule="10 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

#: Hourly: expired ranges leave the manifest; their objects go with a later object_gc run
#: once the retirement is older than its grace.
object_retention_schedule = ScheduleDefinition(
    job=object_retention, cron_schedule="30 * * * *", default_status=DefaultScheduleStatus.RUNNING
)

#: Every 6 hours: etcd keeps an hour of history (``compaction.DEFAULT_KEEP_S``) and what holds
#: need; between runs it grows by six hours of writes at most.
etcd_compaction_schedule = ScheduleDefinition(
    job=etcd_compaction,
    cron_schedule="15 */6 * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

defs = Definitions(
    assets=[topics, object_manifest, parquet_partitions, iceberg_tables, wal_prune_marks],
    asset_checks=[*parquet_checks, manifest_integrity_checks],
    jobs=[
        prune_marks_job,
        parquet_job,
        parquet_checks_job,
        parquet_collect,
        iceberg_maintenance,
        object_gc,
        manifest_integrity_job,
        object_retention,
        etcd_compaction,
        rotate_topics,
    ],
    schedules=[
        parquet_checks_schedule,
        parquet_collect_schedule,
        iceberg_maintenance_schedule,
        object_gc_schedule,
        manifest_integrity_schedule,
        object_retention_schedule,
        etcd_compaction_schedule,
    ],
    # prune_marks_sensor: a prune_marks run only when a mark would move (a mark lets the
    # brokers' cleaners free WAL about a minute after the data was uploaded and consumed; the
    # cleaner falls back to the cursors itself while no mark exists).
    # iceberg_tail_sensor: the tables' tails, in the sensor itself (no run); it reports a
    # runless materialization of iceberg_tables when a tail moved.
    sensors=[prune_marks_sensor, parquet_topics_sensor, rotation_sensor, iceberg_tail_sensor],
    resources={
        "etcd": EtcdResource.from_env(),
        "objects": ObjectStoreResource.from_env(),
        "convert_job": ConvertJobResource(),
        "pipes_subprocess_client": PipesSubprocessClient(),
    },
)
