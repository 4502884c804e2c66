"""Object lifecycle jobs: ``object_gc`` (orphan collection) and ``manifest_integrity``.

Thin wrappers over :mod:`danube_ingest.objects.orphans`: each run reads etcd and the store
itself, calls one function and reports its figures as metadata.
"""

import asyncio

from dagster import Failure, MetadataValue, OpExecutionContext, Output, job, op

from danube_ingest.objects.orphans import (
    DEFAULT_GRACE_S,
    IntegrityReport,
    OrphanReport,
    collect_orphans,
    manifest_integrity,
)
from pipelines.resources import EtcdResource, ObjectStoreResource


@op(config_schema={"grace_s": float, "dry_run": bool})
def collect_orphan_objects(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[int]:
    """Delete objects no manifest entry names, older than ``grace_s`` (default an hour)."""

    async def run() -> OrphanReport:
        async with etcd.connect() as (kv, keys), objects.open() as store:
            return await collect_orphans(
                kv,
                keys,
                store,
                grace_s=context.op_config["grace_s"],
                dry_run=context.op_config["dry_run"],
            )

    report = asyncio.run(run())
    return Output(
        len(report.deleted),
        metadata={
            "deleted": len(report.deleted),
            "bytes": report.deleted_bytes,
            "too_young": report.too_young,
            "kept": report.kept,
            "no_time": len(report.no_time),
            "rescued": report.rescued,
            "retired_recently": report.retired_recently,
            "dry_run": report.dry_run,
            "deleted_keys": MetadataValue.md("\n".join(f"- {k}" for k in report.deleted) or "-"),
        },
    )


@op(config_schema={"deep": bool})
def check_manifest_integrity(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[int]:
    """Fail when a manifest entry's object is missing, truncated or differs in CRC32C."""

    async def run() -> IntegrityReport:
        async with etcd.connect() as (kv, keys), objects.open() as store:
            return await manifest_integrity(kv, keys, store, deep=context.op_config["deep"])

    report = asyncio.run(run())
    metadata = {
        "topics": len(report.topics),
        "ranges": sum(t.ranges for t in report.topics),
        "gaps": report.gaps,
        "problems": len(report.problems),
    }
    if not report.ok:
        raise Failure(
            f"{len(report.problems)} manifest entries disagree with their objects: "
            + "; ".join(report.problems[:20]),
            metadata={**metadata, "details": MetadataValue.md("\n".join(report.problems))},
        )
    return Output(len(report.topics), metadata=metadata)


@job(
    tags={"kind": "objects"},
    config={
        "ops": {
            "collect_orphan_objects": {
                "config": {"grace_s": float(DEFAULT_GRACE_S), "dry_run": False}
            }
        }
    },
)
def object_gc() -> None:
    """Orphan collection (see :mod:`danube_ingest.objects.orphans`)."""
    collect_orphan_objects()


@job(
    name="manifest_integrity",
    tags={"kind": "objects"},
    config={"ops": {"check_manifest_integrity": {"config": {"deep": False}}}},
)
def manifest_integrity_job() -> None:
    """Every manifest entry's object exists with its recorded size and CRC32C."""
    check_manifest_integrity()


__all__ = [
    "check_manifest_integrity",
    "collect_orphan_objects",
    "manifest_integrity_job",
    "object_gc",
]
