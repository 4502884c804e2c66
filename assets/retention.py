"""Retention jobs: ``object_retention`` (objects and Parquet tables) and ``etcd_compaction``.

Thin wrappers: each run reads etcd (and the store) itself, calls
:func:`danube_ingest.objects.retention.apply_retention` and
:func:`danube_ingest.analytics.lifecycle.expire_partitions`, or
:func:`danube_ingest.metadata.compaction.compact_history`, and reports their figures as
metadata. The op config's ``max_age``, ``max_bytes`` and ``table_max_age`` are the default
policy where neither a topic nor its namespace sets one (empty: keep for ever).
"""

import asyncio

from dagster import Failure, MetadataValue, OpExecutionContext, Output, job, op

from danube_ingest.analytics.iceberg import IcebergTarget
from danube_ingest.analytics.lifecycle import ExpireResult, expire_partitions
from danube_ingest.config.values import parse_duration, parse_size
from danube_ingest.errors import ConfigError
from danube_ingest.metadata.compaction import DEFAULT_KEEP_S, CompactionReport, compact_history
from danube_ingest.metadata.policies import RetentionPolicy
from danube_ingest.objects.retention import RetentionReport, apply_retention
from pipelines.resources import EtcdResource, ObjectStoreResource


def _default_policy(config: dict[str, str]) -> RetentionPolicy:
    """The op config as a policy; ``Failure`` naming the field for a malformed value."""
    try:
        return RetentionPolicy(
            max_age_ms=round(parse_duration(config["max_age"]) * 1000)
            if config["max_age"]
            else None,
            max_bytes=parse_size(config["max_bytes"]) if config["max_bytes"] else None,
            table_max_age_ms=round(parse_duration(config["table_max_age"]) * 1000)
            if config["table_max_age"]
            else None,
        )
    except (ConfigError, ValueError) as exc:
        raise Failure(f"object_retention config: {exc}") from exc


@op(config_schema={"max_age": str, "max_bytes": str, "table_max_age": str})
def apply_object_retention(
    context: OpExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> Output[int]:
    """Expired manifest ranges leave the manifest (their objects go with ``object_gc``), and
    each table's partitions older than its ``table_max_age`` are deleted."""
    default = _default_policy(context.op_config)

    async def run() -> tuple[RetentionReport, ExpireResult]:
        async with etcd.connect() as (kv, keys), objects.open() as store:
            report = await apply_retention(kv, keys, default=default)
            iceberg = IcebergTarget.from_config(objects.broker_config())
            tables = await expire_partitions(kv, keys, store, default=default, iceberg=iceberg)
            return report, tables

    report, tables = asyncio.run(run())
    moved = report.floors_moved
    lines = [
        f"- {t.topic}: {len(t.expired)} ranges, {t.expired_bytes} bytes, floor {t.floor} "
        f"({t.reason})"
        for t in moved
    ]
    return Output(
        report.expired,
        metadata={
            "topics": len(report.topics),
            "ranges_expired": report.expired,
            "bytes_expired": report.expired_bytes,
            "floors_moved": len(moved),
            "floors": MetadataValue.md("\n".join(lines) or "-"),
            "table_partitions_expired": len(tables.partitions),
            "table_files_deleted": tables.files_deleted,
            "table_bytes_deleted": tables.bytes_deleted,
            "tables_held": len(tables.held),
        },
    )


@op(config_schema={"keep_s": float})
def compact_etcd_history(context: OpExecutionContext, etcd: EtcdResource) -> Output[int]:
    """Compact etcd's history older than ``keep_s`` (default an hour), never past a hold."""

    async def run() -> CompactionReport:
        async with etcd.connect() as (kv, keys):
            return await compact_history(kv, keys, keep_s=context.op_config["keep_s"])

    report = asyncio.run(run())
    return Output(
        report.compacted or 0,
        metadata={
            "revision": report.revision,
            "compacted": report.compacted or 0,
            "previous": report.previous,
            "held_by": MetadataValue.md("\n".join(f"- {h}" for h in report.held_by) or "-"),
            "db_size": report.db_size if report.db_size is not None else -1,
        },
    )


@job(
    tags={"kind": "objects"},
    config={
        "ops": {
            "apply_object_retention": {
                "config": {"max_age": "", "max_bytes": "", "table_max_age": ""}
            }
        }
    },
)
def object_retention() -> None:
    """Object and table retention (see :mod:`danube_ingest.objects.retention`)."""
    apply_object_retention()


@job(
    tags={"kind": "etcd"},
    config={"ops": {"compact_etcd_history": {"config": {"keep_s": DEFAULT_KEEP_S}}}},
)
def etcd_compaction() -> None:
    """etcd history compaction (see :mod:`danube_ingest.metadata.compaction`)."""
    compact_etcd_history()


__all__ = ["apply_object_retention", "compact_etcd_history", "etcd_compaction", "object_retention"]
