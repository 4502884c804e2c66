"""Dagster assets of the control plane (minute-scale work on etcd and the object store).

* :mod:`assets.parquet` - ``parquet_partitions``: committed Parquet, one partition per table
  partition, its sensor and checks; job ``parquet_collect`` (dead runs' staging, unheld
  draining renditions); job ``iceberg_maintenance`` (old snapshots, orphan metadata).
* :mod:`assets.objects` - job ``object_gc`` (orphaned objects); the external asset
  ``object_manifest`` with its checks ``objects_intact`` and ``ranges_contiguous`` (job
  ``manifest_integrity``).
* :mod:`assets.retention` - jobs ``object_retention`` (objects and tables) and
  ``etcd_compaction``.
* :mod:`assets.rotation` - job ``rotate_topics`` and its ``rotation_sensor``.
* :mod:`assets.tails` - ``iceberg_tail_sensor``: each table's tail, appended to its Iceberg
  table every few seconds (no run).
* :mod:`assets.topics` - ``topics``: the observable source asset every other asset starts
  from (per-topic offsets, clocks, subscription lag and prune marks, read from etcd).
* :mod:`assets.wal_marks` - ``wal_prune_marks``: per-topic WAL prune marks in etcd, job
  ``prune_marks`` and the ``prune_marks_sensor`` that requests it when a mark would move.

Edges: ``topics`` -> ``object_manifest`` -> ``wal_prune_marks`` (which also reads ``topics``'
cursors).
"""

from assets.objects import (
    manifest_integrity_checks,
    manifest_integrity_job,
    object_gc,
    object_manifest,
)
from assets.parquet import (
    iceberg_maintenance,
    parquet_checks,
    parquet_collect,
    parquet_job,
    parquet_partitions,
    parquet_topics_sensor,
)
from assets.retention import etcd_compaction, object_retention
from assets.rotation import rotate_topics, rotation_sensor
from assets.tails import iceberg_tail_sensor
from assets.topics import topics
from assets.wal_marks import prune_marks_job, prune_marks_sensor, wal_prune_marks

__all__ = [
    "etcd_compaction",
    "iceberg_maintenance",
    "iceberg_tail_sensor",
    "manifest_integrity_checks",
    "manifest_integrity_job",
    "object_gc",
    "object_manifest",
    "object_retention",
    "parquet_checks",
    "parquet_collect",
    "parquet_job",
    "parquet_partitions",
    "parquet_topics_sensor",
    "prune_marks_job",
    "prune_marks_sensor",
    "rotate_topics",
    "rotation_sensor",
    "topics",
    "wal_prune_marks",
]
