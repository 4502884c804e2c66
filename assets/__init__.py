"""Dagster assets of the control plane (minute-scale work on etcd and the object store).

* :mod:`assets.parquet` - ``parquet_partitions``: committed Parquet, one partition per table
  partition, its sensor and checks; job ``parquet_collect`` (dead runs' staging, unheld
  draining renditions).
* :mod:`assets.objects` - job ``object_gc`` (orphaned objects); the external asset
  ``object_manifest`` with its checks ``objects_intact`` and ``ranges_contiguous`` (job
  ``manifest_integrity``).
* :mod:`assets.retention` - jobs ``object_retention`` (objects and tables) and
  ``etcd_compaction``.
* :mod:`assets.rotation` - job ``rotate_topics`` and its ``rotation_sensor``.
* :mod:`assets.wal_marks` - ``wal_prune_marks``: per-topic WAL prune marks in etcd.
"""

from assets.objects import (
    manifest_integrity_checks,
    manifest_integrity_job,
    object_gc,
    object_manifest,
)
from assets.parquet import (
    parquet_checks,
    parquet_collect,
    parquet_job,
    parquet_partitions,
    parquet_topics_sensor,
)
from assets.retention import etcd_compaction, object_retention
from assets.rotation import rotate_topics, rotation_sensor
from assets.wal_marks import wal_prune_marks

__all__ = [
    "etcd_compaction",
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
    "rotate_topics",
    "rotation_sensor",
    "wal_prune_marks",
]
