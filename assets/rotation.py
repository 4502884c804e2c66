"""Rotation in Dagster: sensor ``rotation_sensor`` decides, job ``rotate_topics`` merges.

Thin wrappers over :mod:`danube_ingest.objects.rotation`. The sensor only reads: one prefix read
of the manifests and clocks, the same planning as a run (no object is read), and a run request
(run key ``{topic}|{revision}``) for each topic whose manifest or clock changed since the
revision in its cursor and of which a run would merge at least
``storage.rotation.sensor_min_ranges`` ranges (groups that are full, or old enough). Each run
re-reads etcd, plans again and swaps with compare-and-swap: what the sensor saw is never
trusted.
"""

import asyncio
import json
from typing import Any

from dagster import (
    DefaultSensorStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    Output,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    job,
    op,
    sensor,
)

from danube_ingest.errors import RotationError
from danube_ingest.metadata import Manifest
from danube_ingest.objects.rotation import (
    RotationLimits,
    RotationReport,
    rotate_topic,
    rotation_candidates,
)
from pipelines.resources import EtcdResource, ObjectStoreResource


@op(config_schema={"topics": [str]})
def rotate(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[int]:
    """Rotate each topic of ``topics`` until nothing closed is left to merge; fails (after
    trying every topic) when one could not be rotated, naming it."""
    limits = RotationLimits.from_config(objects.broker_config())
    topics: list[str] = context.op_config["topics"]

    async def run() -> tuple[list[RotationReport], list[str]]:
        reports: list[RotationReport] = []
        errors: list[str] = []
        async with etcd.connect() as (kv, keys), objects.open() as store:
            manifest = Manifest(kv, keys)
            for topic in topics:
                try:
                    reports.append(await rotate_topic(manifest, store, topic, limits))
                except RotationError as exc:
                    errors.append(f"{topic}: {exc} (retriable: {exc.retriable})")
        return reports, errors

    reports, errors = asyncio.run(run())
    metadata: dict[str, Any] = {
        "topics": len(topics),
        "objects_rotated": sum(len(r.objects) for r in reports),
        "ranges_replaced": sum(r.ranges_replaced for r in reports),
        "bytes_in": sum(r.bytes_in for r in reports),
        "bytes_out": sum(r.bytes_out for r in reports),
        "entries_before": sum(r.entries_before for r in reports),
        "entries_after": sum(r.entries_after for r in reports),
        "conflicts": sum(r.conflicts for r in reports),
        "per_topic": MetadataValue.md(
            "\n".join(
                f"- {r.topic}: entries {r.entries_before} -> {r.entries_after}, "
                f"objects {len(r.objects)}, bytes {r.bytes_in} -> {r.bytes_out}"
                for r in reports
            )
            or "-"
        ),
    }
    if errors:
        raise Failure(
            f"rotation failed for {len(errors)} topic(s): " + "; ".join(errors),
            metadata={**metadata, "errors": MetadataValue.md("\n".join(errors))},
        )
    return Output(metadata["objects_rotated"], metadata=metadata)


@job(tags={"kind": "objects"}, config={"ops": {"rotate": {"config": {"topics": []}}}})
def rotate_topics() -> None:
    """Merge topics' small ranges into rolling topic objects (see
    :mod:`danube_ingest.objects.rotation`)."""
    rotate()


@sensor(
    job=rotate_topics,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Requests a rotate_topics run for each topic whose manifest changed and of "
    "which a run would merge at least storage.rotation.sensor_min_ranges ranges.",
)
def rotation_sensor(
    context: SensorEvaluationContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> SensorResult:
    """One prefix read of etcd; the cursor is the highest manifest revision seen."""
    config = objects.broker_config()
    threshold = config.storage.rotation.sensor_min_ranges
    limits = RotationLimits.from_config(config)
    seen = json.loads(context.cursor)["revision"] if context.cursor else 0

    async def read() -> tuple[dict[str, int], dict[str, int]]:
        async with etcd.connect() as (kv, keys):
            return await rotation_candidates(kv, keys, limits)

    counts, revisions = asyncio.run(read())
    runs = [
        RunRequest(
            run_key=f"{topic}|{revisions[topic]}",
            run_config={"ops": {"rotate": {"config": {"topics": [topic]}}}},
            tags={"danube/topic": topic},
        )
        for topic, count in sorted(counts.items())
        if count >= threshold and revisions[topic] > seen
    ]
    newest = max([seen, *revisions.values()])
    context.log.info(
        f"topics={len(revisions)} candidates={len(counts)} requested={len(runs)} revision={newest}"
    )
    return SensorResult(
        run_requests=runs,
        cursor=json.dumps({"revision": newest}),
        skip_reason=None
        if runs
        else SkipReason(f"no changed topic with {threshold} ranges ready to merge"),
    )


__all__ = ["rotate", "rotate_topics", "rotation_sensor"]
