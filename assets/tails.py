"""Fresh tables in Dagster: sensor ``iceberg_tail_sensor`` extends each table's tail.

Every ``SENSOR_INTERVAL_S`` the sensor runs :func:`danube_ingest.analytics.tail.extend_tail` on
every topic's table (the entries past its committed partitions, up to the last multiple of
``iceberg.tail_step_seconds`` the topic clock has passed) and publishes the tables it changed to
the Iceberg catalog (a topic without a table gets one, as its first conversion run would
make it), in the sensor's own process: a tail step reads seconds of data, less work
than launching a run. It requests no run; what it did is its tick's skip message and log. The
complete partitions stay ``parquet_partitions``' (``parquet_topics_sensor``); their commits
replace the tail's pieces in the tables.
"""

import asyncio
import time

from dagster import DefaultSensorStatus, SensorEvaluationContext, SkipReason, sensor

from danube_ingest.analytics.checks import topics_with_manifest
from danube_ingest.analytics.iceberg import IcebergPublishError, IcebergTarget, publish
from danube_ingest.analytics.tail import TailError, TailStep, extend_tail
from danube_ingest.metadata import KV, Keys
from pipelines.resources import EtcdResource, ObjectStoreResource

#: Seconds between two evaluations (Dagster's minimum interval; at most the default step).
SENSOR_INTERVAL_S = 10


@sensor(
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=DefaultSensorStatus.RUNNING,
    description="Appends each table's entries past its complete partitions (the tail, up to "
    "the last multiple of iceberg.tail_step_seconds the topic clock has passed) to its Iceberg "
    "table, so queries by name see data seconds after ingest. Requests no run.",
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

    async def work(kv: KV, keys: Keys) -> tuple[list[TailStep], list[str]]:
        steps: list[TailStep] = []
        problems: list[str] = []
        async with objects.open() as store:
            for topic in await topics_with_manifest(kv, keys):
                try:
                    step = await extend_tail(
                        kv,
                        keys,
                        topic,
                        store,
                        store,
                        root=objects.warehouse_root,
                        step_s=step_s,
                        create=True,
                    )
                    if step is not None and step.recorded and (step.added or step.dropped):
                        await publish(kv, keys, topic, target)
                except (TailError, IcebergPublishError) as exc:
                    problems.append(f"{topic}: {exc}")
                    continue
                if step is not None:
                    steps.append(step)
        return steps, problems

    async def run() -> tuple[list[TailStep], list[str]]:
        async with etcd.connect() as (kv, keys):
            return await work(kv, keys)

    steps, problems = asyncio.run(run())
    for problem in problems:
        context.log.warning(f"tail not extended: {problem}")
    moved = [s for s in steps if s.added or s.dropped]
    for s in moved:
        context.log.info(
            f"tail {s.topic}: frontier {s.frontier_ms}, +{s.added} pieces ({s.rows} rows), "
            f"-{s.dropped}"
        )
    return SkipReason(
        f"{len(moved)} of {len(steps)} tables extended, {len(problems)} failed, in "
        f"{time.monotonic() - started:.1f} s"
    )
