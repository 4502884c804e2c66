"""``defs``: everything the Dagster UI shows for danube_ingest."""

from __future__ import annotations

from dagster import (
    AssetSelection,
    DefaultScheduleStatus,
    Definitions,
    ScheduleDefinition,
    define_asset_job,
)

from assets import wal_prune_marks
from pipelines.resources import EtcdResource

prune_marks_job = define_asset_job(
    "prune_marks", selection=AssetSelection.assets(wal_prune_marks), tags={"kind": "wal"}
)

#: Every minute: a mark lets the brokers' cleaners free WAL up to a minute after the data was
#: uploaded and consumed (the cleaner falls back to the cursors itself while no mark exists).
prune_marks_schedule = ScheduleDefinition(
    job=prune_marks_job,
    cron_schedule="* * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
)

defs = Definitions(
    assets=[wal_prune_marks],
    jobs=[prune_marks_job],
    schedules=[prune_marks_schedule],
    resources={"etcd": EtcdResource.from_env()},
)
