"""Object lifecycle: job ``object_gc`` (orphan collection), the external asset
``object_manifest`` and its checks ``objects_intact`` and ``ranges_contiguous`` (run hourly by
job ``manifest_integrity``).

Thin wrappers over :mod:`danube_ingest.objects.orphans`: each run reads etcd and the store
itself, calls one function and reports its figures as metadata.
"""

import asyncio
from collections.abc import Iterator

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetSelection,
    AssetSpec,
    Field,
    MetadataValue,
    OpExecutionContext,
    Output,
    define_asset_job,
    job,
    multi_asset_check,
    op,
)

from assets.topics import TOPICS_KEY
from danube_ingest.objects.orphans import (
    DEFAULT_GRACE_S,
    IntegrityReport,
    OrphanReport,
    collect_orphans,
    manifest_integrity,
)
from pipelines.resources import EtcdResource, ObjectStoreResource

#: Problems listed in a check's metadata (the count is always exact).
MAX_LISTED = 50


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


#: What the daemon writes: its uploaders' segment objects and their manifest ranges in etcd
#: (rotation and retention change them from Dagster). External: Dagster never materializes it.
object_manifest = AssetSpec(
    "object_manifest",
    deps=[TOPICS_KEY],
    group_name="objects",
    kinds={"etcd"},
    description=(
        "Every topic's object manifest (etcd storage/topics/{ns}/{topic}/objects/...) and the "
        "objects it names, written by the brokers' uploaders."
    ),
)

_INTACT = "objects_intact"
_CONTIGUOUS = "ranges_contiguous"


@multi_asset_check(
    name="manifest_integrity_checks",
    specs=[
        AssetCheckSpec(
            _INTACT,
            asset=object_manifest.key,
            description="Every manifest range's object exists with its recorded size and "
            "CRC32C and its footer agrees (op config deep: every frame decodes).",
        ),
        AssetCheckSpec(
            _CONTIGUOUS,
            asset=object_manifest.key,
            description="Every topic's ranges are readable, do not overlap, and leave no gap "
            "above the retained floor that no recorded offset jump covers.",
        ),
    ],
    config_schema={"deep": Field(bool, default_value=False)},
)
def manifest_integrity_checks(
    context: AssetCheckExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Iterator[AssetCheckResult]:
    """``manifest_integrity`` over every topic with a manifest: one read of etcd and of every
    object, two check results (both severity ERROR on failure)."""

    async def run() -> IntegrityReport:
        async with etcd.connect() as (kv, keys), objects.open() as store:
            return await manifest_integrity(
                kv, keys, store, deep=context.op_execution_context.op_config["deep"]
            )

    report = asyncio.run(run())
    figures = {
        "topics": len(report.topics),
        "ranges": report.ranges,
        "gaps": report.gaps,
        "jumps": report.jumps,
    }
    for name, problems in (
        (_INTACT, report.object_problems),
        (_CONTIGUOUS, report.range_problems),
    ):
        shown = "\n".join(f"- {p}" for p in problems[:MAX_LISTED])
        if len(problems) > MAX_LISTED:
            shown += f"\n- ... and {len(problems) - MAX_LISTED} more"
        yield AssetCheckResult(
            asset_key=object_manifest.key,
            check_name=name,
            passed=not problems,
            severity=AssetCheckSeverity.ERROR,
            metadata={
                **figures,
                "unexplained_gaps": report.unexplained_gaps,
                "problems": len(problems),
                "details": MetadataValue.md(shown or "none"),
            },
        )


#: Job ``manifest_integrity``: the two checks (run hourly by its schedule).
manifest_integrity_job = define_asset_job(
    "manifest_integrity",
    selection=AssetSelection.checks(manifest_integrity_checks),
    tags={"kind": "objects"},
)


__all__ = [
    "collect_orphan_objects",
    "manifest_integrity_checks",
    "manifest_integrity_job",
    "object_gc",
    "object_manifest",
]
