"""The cluster id: every broker of one cluster (one etcd prefix) uses the same object store.

Brokers whose object stores differ silently break each other's readers (a manifest entry
names an object the reader's store does not have). So a cluster has an id, stored twice: in
etcd at ``cluster/id`` under the prefix, and in the object store as the marker object
``cluster-id`` at its root. ``check_cluster_id`` runs before a broker registers, and

* both present and equal: the broker starts;
* etcd's id present, the store's marker missing or different: ``ClusterIdMismatchError``
  naming both ids (the broker is configured with another store than the cluster's);
* etcd's id missing (the first broker of a new cluster, or a cluster from before ids): the
  marker is created first if missing (``put_if_absent``: concurrent first brokers agree on
  one), then etcd's key is created from it in a transaction that requires it absent. A crash
  between the two leaves only the marker, which the next start adopts.

The ``memory`` backend is per process (tests): it has nothing to share and is not checked.
"""

from __future__ import annotations

import logging
import uuid

from danube_ingest.errors import DanubeIngestError, ObjectNotFoundError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Get, Put
from danube_ingest.objects.store import ObjectStore

log = logging.getLogger(__name__)

#: The marker object, at the store's root (outside every prefix the orphan collector lists).
MARKER_KEY = "cluster-id"


class ClusterIdMismatchError(DanubeIngestError):
    """This broker's object store is not the cluster's (missing or different marker).
    Not retriable: fix ``storage.cloud`` (or the etcd prefix) and start again."""


async def _marker(objects: ObjectStore) -> str | None:
    try:
        return (await objects.get(MARKER_KEY)).decode().strip()
    except ObjectNotFoundError:
        return None


async def check_cluster_id(kv: KV, keys: Keys, objects: ObjectStore) -> str | None:
    """The cluster's id, after checking that ``objects`` is the cluster's store (creating the
    id for a new cluster); None for the ``memory`` backend. Raises ``ClusterIdMismatchError``
    when the store is not the cluster's: nothing was written then."""
    if objects.scheme == "memory":
        return None
    key = keys.cluster_id()
    stored = await kv.get(key)
    marker = await _marker(objects)
    if stored is not None:
        cluster = stored.value.decode()
        if marker != cluster:
            raise ClusterIdMismatchError(
                f"object store {objects.description} is not this cluster's: etcd {key} says "
                f"cluster {cluster}, the store's marker object {MARKER_KEY!r} says "
                f"{marker or '(none)'}; configure storage.cloud to the store the other brokers "
                "of this cluster use (or use another etcd prefix for a separate cluster)"
            )
        return cluster
    if marker is None:
        # False when another broker created it first: then theirs is used.
        await objects.put_if_absent(MARKER_KEY, uuid.uuid4().hex.encode())
        marker = await _marker(objects)
        assert marker is not None  # just created, by this broker or another
    result = await kv.txn([Compare.absent(key)], [Put(key, marker.encode())], [Get(key)])
    if not result.succeeded:
        winner = result.kv(0)
        cluster = "" if winner is None else winner.value.decode()
        if cluster != marker:
            raise ClusterIdMismatchError(
                f"object store {objects.description} is not this cluster's: etcd {key} was "
                f"just set to cluster {cluster} by another broker, the store's marker object "
                f"{MARKER_KEY!r} says {marker}; configure storage.cloud to the store the other "
                "brokers of this cluster use"
            )
        return cluster
    log.info("cluster id created cluster_id=%s store=%s", marker, objects.description)
    return marker


__all__ = ["MARKER_KEY", "ClusterIdMismatchError", "check_cluster_id"]
