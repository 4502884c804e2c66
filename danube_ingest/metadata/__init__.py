"""Metadata in etcd: the KV contract, broker sessions, topic ownership, progress, records,
the object manifest and WAL prune marks.

Everything a broker keeps in etcd goes through here; see ``keys.py`` for the key layout.
``metadata`` never imports ``broker``, ``dispatch`` or ``store``.
"""

from danube_ingest.metadata.errors import (
    BrokerIdConflictError,
    CommitStateUnknownError,
    EtcdServerError,
    FencedError,
    InvalidNameError,
    LeaseExpiredError,
    MetadataError,
    MetadataUnavailableError,
    RevisionCompactedError,
)
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import (
    KV,
    Compare,
    Delete,
    Get,
    KeyValue,
    MemoryKV,
    OpResult,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
    WatchStream,
)
from danube_ingest.metadata.manifest import (
    CommitResult,
    InvalidRangeError,
    Manifest,
    ManifestConflictError,
    ObjectKind,
    ObjectRange,
    Retired,
    retire_ops,
    retired_objects,
)
from danube_ingest.metadata.marks import PruneMarks, subscription_cursors
from danube_ingest.metadata.offsets import OffsetReservation
from danube_ingest.metadata.ownership import FencedManyResult, Owner, Ownership
from danube_ingest.metadata.progress import ProgressUpdater
from danube_ingest.metadata.records import (
    ClientRecord,
    Records,
    SubscriptionRecord,
    TopicRecord,
    decode_cursor,
    encode_cursor,
)
from danube_ingest.metadata.server import EtcdServer, find_etcd_binary
from danube_ingest.metadata.session import BrokerSession

__all__ = [
    "KV",
    "BrokerIdConflictError",
    "BrokerSession",
    "ClientRecord",
    "CommitResult",
    "CommitStateUnknownError",
    "Compare",
    "Delete",
    "EtcdKV",
    "EtcdServer",
    "EtcdServerError",
    "FencedError",
    "FencedManyResult",
    "Get",
    "InvalidNameError",
    "InvalidRangeError",
    "KeyValue",
    "Keys",
    "LeaseExpiredError",
    "Manifest",
    "ManifestConflictError",
    "MemoryKV",
    "MetadataError",
    "MetadataUnavailableError",
    "ObjectKind",
    "ObjectRange",
    "OffsetReservation",
    "OpResult",
    "Owner",
    "Ownership",
    "ProgressUpdater",
    "PruneMarks",
    "Put",
    "Records",
    "Retired",
    "RevisionCompactedError",
    "SubscriptionRecord",
    "TopicRecord",
    "TxnOp",
    "TxnResult",
    "WatchEvent",
    "WatchStream",
    "decode_cursor",
    "encode_cursor",
    "find_etcd_binary",
    "retire_ops",
    "retired_objects",
    "split_topic",
    "subscription_cursors",
]
