"""Exceptions raised by danube_ingest.metadata.

::

    DanubeIngestError
     └── MetadataError                 root of this package's errors
          ├── MetadataUnavailableError  etcd did not answer (down, unreachable); retriable
          ├── CommitStateUnknownError   a write timed out or its connection broke: it may or may
          │                             not have been applied; re-read before retrying
          ├── LeaseExpiredError         the lease is gone (expired or revoked), so are its keys
          ├── FencedError               a fenced write failed: this broker no longer owns the topic
          ├── TopicDeletedError         the topic has no record (deleted): it cannot be acquired
          ├── BrokerIdConflictError     another live broker is registered under the same id
          ├── RevisionCompactedError    a watch asked for history that was compacted away
          ├── InvalidNameError          a topic, subscription or broker name that cannot be a key
          └── EtcdServerError           a local etcd server could not be found, started or reached

``CommitStateUnknownError`` is deliberately distinct from a failed compare-and-swap: a failed
CAS returns ``TxnResult(succeeded=False)``, while an unknown outcome must never be treated as
either success or failure (pyiceberg makes the same split).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from danube_ingest.errors import DanubeIngestError

if TYPE_CHECKING:
    from danube_ingest.metadata.kv import KeyValue


class MetadataError(DanubeIngestError):
    """Root of the metadata layer's errors (KV store, sessions, ownership, records)."""


class MetadataUnavailableError(MetadataError):
    """The metadata store could not be reached or did not answer in time.

    Safe to retry: puts, deletes and transactions raising this were never sent (a lease grant
    may have happened, but an unused lease just expires).
    """

    retriable = True


class CommitStateUnknownError(MetadataError):
    """A write's outcome is unknown: it timed out or its connection broke after it was sent.

    It may or may not have been applied. Re-read the keys it touched before retrying; a blind
    retry can apply a compare-and-swap twice or report a spurious conflict.
    """

    retriable = False


class LeaseExpiredError(MetadataError):
    """The lease does not exist any more (it expired or was revoked).

    Every key attached to it has been deleted; the holder lost what the lease guarded.
    """


class FencedError(MetadataError):
    """A fenced write was rejected because this broker no longer owns the topic.

    Nothing was written. Stop serving the topic and redirect clients to the new owner.
    """

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


class TopicDeletedError(MetadataError):
    """The topic's record does not exist (it was deleted, or never created), so it cannot be
    acquired. Stop serving it and skip anything of it still held locally."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


class BrokerIdConflictError(MetadataError):
    """Another live broker is registered under this broker id.

    ``holder`` is its registration (key, value, lease) when it was read, else ``None``.
    """

    def __init__(self, message: str, *, holder: KeyValue | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class RevisionCompactedError(MetadataError):
    """A watch asked to start below the oldest revision the store still keeps.

    Re-read the current state, then watch from the revision of that read.
    """

    def __init__(self, message: str, compacted_revision: int) -> None:
        super().__init__(message)
        self.compacted_revision = compacted_revision


class InvalidNameError(MetadataError, ValueError):
    """A name that cannot become part of a key (a topic not shaped ``/ns/topic``, a '/'...)."""


class EtcdServerError(MetadataError):
    """A local etcd server could not be found, started, or did not become healthy.

    The message names the binary, the data directory and the log file to read.
    """
