"""Fresh tables in Dagster: sensor ``iceberg_tail_sensor`` extends each table's tail.

Every ``SENSOR_INTERVAL_S`` the sensor runs one :func:`danube_ingest.analytics.follow.tail_round`:
``tail.extend_tail`` on every topic's table (the entries past its committed partitions, up to
the last multiple of ``iceberg.tail_step_seconds`` the topic clock has passed), then publishes
the tables it changed to the Iceberg catalog (a topic without a table gets one, as its first
conversion run would make it), in the sensor's own process: a tail step reads seconds of data,
less work than launching a run. It requests no run; what it did is its tick's skip message and
log. When at least one table's tail moved, it reports a runless materialization of
``iceberg_tables`` (``assets/iceberg_tables.py``) whose metadata are those tables' states (current
snapshot, frontier, clock, lag, data files, rows), so the asset's last materialization shows
when the tables last changed; a tick that moved nothing reports nothing. The complete
partitions stay ``parquet_partitions``' (``parquet_topics_sensor``); their commits replace the
tail's pieces in the tables.
"""

import asyncio
import time

from dagster import (
    AssetMaterialization,
    DefaultSensorStatus,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from assets.iceberg_tables import ICEBERG_TABLES, TableState, table_metadata, table_states
from danube_ingest.analytics.follow import TailRound, tail_round
from danube_ingest.analytics.iceberg import IcebergTarget
from pipelines.resources import EtcdResource, ObjectStoreResource

#: Seconds between two evaluations (Dagster's minimum interval; at most the default step).
SENSOR_INTERVAL_S = 10


@sensor(
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Appends each table's entries past its complete partitions (the tail, up to "
    "the last multiple of iceberg.tail_step_seconds the topic clock has passed) to its Iceberg "
    "table, so queries by name see data seconds after ingest. Requests no run; reports a "
    "runless materialization of iceberg_tables when a tail moved.",
)
def iceberg_tail_sensor(
    context: SensorEvaluationContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> SkipReason:
    config = objects.broker_config()
    target = IcebergTarget.from_config(config)
    step_s = config.iceberg.tail_step_seconds
    if target is None or step_s == 0:
        return SkipReason("no tails: iceberg.catalog is off or tail_step_seconds is 0")
    started = time.monotonic()

    async def run() -> tuple[TailRound, list[TableState]]:
        async with etcd.connect() as (kv, keys), objects.open() as store:
            done = await tail_round(
                kv, keys, store, target, root=objects.warehouse_root, step_s=step_s
            )
            moved = [s.topic for s in done.moved]
            try:
                return done, await table_states(kv, keys, target, moved) if moved else []
            except Exception as exc:  # only the report: the tails are published
                context.log.warning(f"tails moved, their tables' state not read: {exc!r}")
                return done, []

    done, states = asyncio.run(run())
    steps, problems = done.steps, done.problems
    for problem in problems:
        context.log.warning(f"tail not extended: {problem}")
    moved = done.moved
    for s in moved:
        context.log.info(
            f"tail {s.topic}: frontier {s.frontier_ms}, +{s.added} pieces ({s.rows} rows), "
            f"-{s.dropped}"
        )
    if states:
        notes = {s.topic: f"tail +{s.added} -{s.dropped} pieces ({s.rows} rows)" for s in moved}
        context.instance.report_runless_asset_event(
            AssetMaterialization(
                asset_key=ICEBERG_TABLES,
                description=f"iceberg_tail_sensor moved the tails of {len(states)} table(s)",
                metadata=table_metadata(states, notes),
            )
        )
    return SkipReason(
        f"{len(moved)} of {len(steps)} tables extended, {len(problems)} failed, in "
        f"{time.monotonic() - started:.1f} s"
    )
