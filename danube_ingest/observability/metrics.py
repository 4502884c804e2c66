"""The daemon's Prometheus metrics that code updates as it works (process-wide).

They live in :data:`REGISTRY`, not in prometheus-client's global registry, so that importing
``danube_ingest`` never adds to an application's own metrics. Figures that are a state rather
than a count (subscription lag, WAL bytes, upload backlog) are read when scraped, per broker, by
``observability.collector``.

Cost on the hot path: every update is a lock-protected float add in prometheus-client (about
0.3 µs for a counter, 1 µs for a histogram here). The WAL records per group commit (in its
writer thread, not per message), the cache per read, the RPC interceptor twice per call.

Label cardinality is bounded: no metric here is labelled by topic; ``method`` takes at most
``MAX_METHODS`` values (see ``observability.rpc``); ``code`` is a gRPC status name; ``op`` a
fixed word.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

#: The daemon's metrics; exposed by ``observability.http`` together with a broker's collector.
REGISTRY = CollectorRegistry(auto_describe=True)

#: Latency buckets (seconds) from 50 µs (a fast fdatasync here) to 10 s (a slow object PUT).
_LATENCY = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
#: Powers of 4 from one message (a lone append) to 1M (the largest group a write carries).
_COUNTS = tuple(float(4**i) for i in range(11))
#: Powers of 4 from 64 B to 64 MiB (a group commit's bytes).
_BYTES = tuple(float(64 * 4**i) for i in range(11))

WAL_APPEND_SECONDS = Histogram(
    "danube_ingest_wal_append_seconds",
    "From handing a chunk of appends to the WAL writer until it is durable (written and, "
    "with fsync: always, fdatasync'ed).",
    buckets=_LATENCY,
    registry=REGISTRY,
)
WAL_FSYNC_SECONDS = Histogram(
    "danube_ingest_wal_fsync_seconds",
    "Duration of one fdatasync of a WAL segment (one per group commit).",
    buckets=_LATENCY,
    registry=REGISTRY,
)
WAL_APPENDED_BYTES = Counter(
    "danube_ingest_wal_appended_bytes",
    "Bytes written to the WAL (frames, all topics).",
    registry=REGISTRY,
)
WAL_GROUP_MESSAGES = Histogram(
    "danube_ingest_wal_group_messages",
    "Messages made durable by one group commit (one write + one fdatasync).",
    buckets=_COUNTS,
    registry=REGISTRY,
)
WAL_GROUP_BYTES = Histogram(
    "danube_ingest_wal_group_bytes",
    "Bytes written by one group commit.",
    buckets=_BYTES,
    registry=REGISTRY,
)
CACHE_HITS = Counter(
    "danube_ingest_cache_hits",
    "Reads served from the WAL cache (hit ratio: hits / (hits + misses)).",
    registry=REGISTRY,
)
CACHE_MISSES = Counter(
    "danube_ingest_cache_misses",
    "Reads the WAL cache could not serve (they go to segment files or objects).",
    registry=REGISTRY,
)
UPLOAD_SECONDS = Histogram(
    "danube_ingest_upload_seconds",
    "From a segment's seal (or the uploader's start, for older segments) until its object is "
    "stored and committed to the manifest.",
    buckets=_LATENCY,
    registry=REGISTRY,
)
OBJECT_WRITE_SECONDS = Histogram(
    "danube_ingest_object_write_seconds",
    "Duration of one object write (PUT) to the object store.",
    buckets=_LATENCY,
    registry=REGISTRY,
)
MANIFEST_TXN_SECONDS = Histogram(
    "danube_ingest_manifest_txn_seconds",
    "Duration of one manifest transaction in etcd (op: commit = the uploader adds ranges, "
    "replace = rotation swaps entries).",
    ["op"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
RPC_SECONDS = Histogram(
    "danube_ingest_rpc_seconds",
    "gRPC calls served, by method and status code; _count is the number of calls. A "
    "streaming call counts once, when it ends, with its whole duration.",
    ["method", "code"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
TAKEOVER_WAIT_SECONDS = Histogram(
    "danube_ingest_takeover_wait_seconds",
    "How long a new owner served nothing of a topic while it waited for the previous owner's "
    "unuploaded tail (from the first wait to serving again, per resolved takeover).",
    buckets=_LATENCY,
    registry=REGISTRY,
)
TAKEOVER_LOST_OFFSETS = Counter(
    "danube_ingest_takeover_lost_offsets",
    "Offsets a new owner skipped because an operator declared the previous owner lost "
    "('danube-ingest brokers forget'): an upper bound of the acknowledged entries lost.",
    registry=REGISTRY,
)
