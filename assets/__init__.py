"""Dagster assets of the control plane (minute-scale work on etcd and the object store).

* :mod:`assets.wal_marks` - ``wal_prune_marks``: per-topic WAL prune marks in etcd.
"""

from assets.wal_marks import wal_prune_marks

__all__ = ["wal_prune_marks"]
