"""Exceptions raised by danube_ingest.

Every error carries ``retriable``: ``True`` when the same call may succeed later without
anyone changing anything (a full disk that is being drained, an unreachable server), ``False``
when retrying cannot help (bad input, corruption, a closed object). Retry policy reads this flag,
never the message text.

::

    DanubeIngestError
     ├── ConfigError                  invalid configuration; the message names the key
     ├── DataDirLockedError           another process holds the data directory (names its pid)
     ├── MetadataStoreMismatchError   the data directory belongs to another metadata store
     └── StorageError
          ├── FrameError               bytes that are not a valid frame
          │    ├── TruncatedFrameError  fewer bytes than the frame claims (a torn tail)
          │    └── CorruptFrameError    CRC or header mismatch
          ├── WalCorruptionError       a WAL file is damaged; names the file and byte position
          ├── WalClosedError           the log was closed
          ├── WalFailedError           a write or fsync failed; the log refuses further appends
          ├── WalBackpressureError     the WAL is full (retention limit); retriable
          │    └── WalStalledError      the WAL's Kafka stores nothing for now; retriable
          ├── OffsetOutOfRangeError    a reader asked for an offset that is no longer retained
          ├── PayloadTooLargeError     an entry larger than the configured maximum
          ├── InvalidEntryError        an entry (or topic name) with a field the WAL cannot frame
          ├── SequenceError            an idempotent producer's batch sequence does not fit
          │    ├── SequenceGapError     a sequence beyond the next expected one
          │    └── DuplicateSequenceError  an old sequence whose offsets are no longer known
          ├── ObjectFormatError        bytes that are not a valid .bin object (names key + position)
          ├── RotationError            a topic's rotation stopped (names topic, offsets, object)
          └── ObjectStoreError         the object store failed; ``retriable`` says whether to retry
               └── ObjectNotFoundError  no object under that key
"""

from __future__ import annotations

from pathlib import Path


class DanubeIngestError(Exception):
    """Root of every error raised by danube_ingest."""

    retriable: bool = False


class ConfigError(DanubeIngestError, ValueError):
    """The configuration is invalid. The message names the offending key."""


class MetadataStoreMismatchError(DanubeIngestError):
    """The data directory was made with another metadata store than the one configured
    (``danube_ingest.datadir.check_metadata_store``).

    ``path`` is the record (``{data_dir}/METADATA``), ``recorded`` the store it names,
    ``configured`` this broker's. Nothing in the directory was changed. Not retriable: start
    with the directory's store, or give the broker another data directory.
    """

    def __init__(self, message: str, *, path: Path, recorded: str, configured: str) -> None:
        super().__init__(message)
        self.path = path
        self.recorded = recorded
        self.configured = configured


class DataDirLockedError(DanubeIngestError):
    """Another process holds the data directory's lock (``danube_ingest.datadir``).

    ``path`` is the lock file, ``holder`` what it says about the holder (pid and host). Nothing
    in the directory was read or changed. Not retriable: the holder must stop first.
    """

    def __init__(self, message: str, *, path: Path, holder: str) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


class StorageError(DanubeIngestError):
    """Root of the storage layer's errors (WAL, cache, topic store)."""


class FrameError(StorageError):
    """Bytes that do not decode as a frame.

    ``position`` is the byte offset of the frame within the buffer or file that was decoded.
    """

    def __init__(self, message: str, position: int = 0) -> None:
        super().__init__(message)
        self.position = position


class TruncatedFrameError(FrameError):
    """The buffer ends before the frame does: the tail of a log torn by a crash."""


class CorruptFrameError(FrameError):
    """A frame whose header or body CRC32C does not match, or whose fields are invalid."""


class WalCorruptionError(StorageError):
    """A WAL segment is damaged somewhere other than its torn tail.

    The log refuses to open. ``danube-ingest wal verify`` shows the damage and
    ``danube-ingest wal repair`` truncates the log at ``position`` (losing what follows).
    """

    def __init__(self, path: str, position: int, reason: str) -> None:
        super().__init__(
            f"WAL corruption in {path} at byte {position}: {reason}; "
            f"inspect with 'danube-ingest wal verify', truncate with 'danube-ingest wal repair'"
        )
        self.path = path
        self.position = position
        self.reason = reason


class WalClosedError(StorageError):
    """The log (or the store on top of it) has been closed."""


class WalFailedError(StorageError):
    """A write or fdatasync failed. Nothing after the failure was acknowledged.

    After a failed fsync the page cache can no longer be trusted, so the log stops accepting
    appends until it is reopened (which re-runs recovery from what is really on disk).
    """


class WalBackpressureError(StorageError):
    """The WAL holds as much as its retention allows; try again once uploads catch up."""

    retriable = True


class WalStalledError(WalBackpressureError):
    """The WAL's backend has stored nothing for a while (the Kafka WAL: Kafka has committed
    none of its appends for ``storage.wal.kafka.delivery_timeout_ms``): new appends are refused
    before they get an offset, until it stores again. Appends staged before are stored once it
    does."""


class OffsetOutOfRangeError(StorageError):
    """A reader asked for an offset below the topic's first retained offset."""

    def __init__(self, topic: str, offset: int, first_offset: int) -> None:
        super().__init__(
            f"offset {offset} of topic {topic} is no longer retained "
            f"(first retained offset is {first_offset})"
        )
        self.topic = topic
        self.offset = offset
        self.first_offset = first_offset


class PayloadTooLargeError(StorageError):
    """An entry exceeds the configured maximum size; nothing was stored."""


class InvalidEntryError(StorageError, ValueError):
    """An entry (or a topic name) with a field the WAL frame cannot hold (a routing key or an
    attribute key over 65,535 UTF-8 bytes, an integer out of its field's range...). Raised
    before the entry gets an offset: nothing was stored and no offset was used."""


class SequenceError(StorageError):
    """An idempotent producer's batch sequence does not follow the topic's record of it.

    ``expected`` is the next sequence the log would accept from that producer.
    """

    def __init__(self, message: str, *, expected: int) -> None:
        super().__init__(message)
        self.expected = expected


class SequenceGapError(SequenceError):
    """A sequence beyond the next expected one: batches in between were never stored (the
    producer must resend them first, or start again with a new producer id)."""


class DuplicateSequenceError(SequenceError):
    """A sequence older than the batches the log remembers: it was stored before, but its
    offsets are no longer known. Nothing was stored again."""


class ObjectFormatError(StorageError):
    """Bytes read from the object store are not a valid ``.bin`` object (corrupt, truncated, or
    of an unknown version). Names the object key and the byte position when known."""

    def __init__(self, key: str, position: int | None, reason: str) -> None:
        where = f"{key}" if position is None else f"{key} at byte {position}"
        super().__init__(f"invalid object {where}: {reason}")
        self.key = key
        self.position = position
        self.reason = reason


class RotationError(StorageError):
    """Rotation of a topic's ranges into a rolling topic object stopped; the manifest is as it
    was before the group it names (no range lost or changed). ``retriable`` is True when the
    manifest kept changing under it (run it again later), False when an object is not what
    the manifest says (inspect it: ``danube-ingest objects verify``)."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class ObjectStoreError(StorageError):
    """An object store operation failed. ``retriable`` is True for transient failures
    (unreachable endpoint, timeouts, throttling, 5xx) and False for fatal ones (permission
    denied, missing bucket, invalid configuration)."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class ObjectNotFoundError(ObjectStoreError):
    """No object exists under the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object {key} not found", retriable=False)
        self.key = key
