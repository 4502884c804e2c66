"""A table's records in etcd, and their keys.

Below ``Keys.tables_prefix(topic)`` (``{prefix}/tables/{ns}/{topic}/``), compact JSON values::

    table                               TableRecord: width, active rendition, since/upper
    renditions/{r}                      RenditionRecord: converter version, schema ref, state, upper
    renditions/{r}/parts/{start:020}    PartitionCommit: the committed files of one partition
    intents/{token}                     RunIntent of a running conversion; under its lease
    holds/{id}                          HoldRecord: a reader holds a rendition; under its lease

Decoding ignores fields it does not know and names the key of a malformed value.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys

RenditionState = Literal["building", "active", "draining", "collected"]


def _encode(record: Any) -> bytes:
    return json.dumps(dataclasses.asdict(record), separators=(",", ":"), sort_keys=True).encode()


def _decode(cls: type[Any], data: bytes, key: str) -> Any:
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})
    except (ValueError, TypeError) as exc:
        raise MetadataError(f"malformed {cls.__name__} at {key}: {exc}") from exc


class _Record:
    """A record stored as compact JSON with sorted keys (always the same bytes); fields a newer
    version added are ignored when read."""

    __slots__ = ()

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, data: bytes, key: str) -> Self:
        """Parse a stored record; ``MetadataError`` naming ``key`` if malformed."""
        record: Self = _decode(cls, data, key)
        return record


@dataclass(frozen=True, slots=True)
class TableRecord(_Record):
    """``table``: the table of one topic."""

    width_s: int
    """Partition width in seconds (``layout.check_width``); fixed at creation."""
    active: str | None
    """The rendition readers use, ``None`` before the first activation."""
    since_ms: int
    """Oldest partition start that is readable: nothing below it is converted or kept."""
    upper_ms: int
    """The active rendition's frontier: every partition in ``[since_ms, upper_ms)`` is committed
    and published; the partition at ``upper_ms`` is not. Never decreases."""
    created_ms: int


@dataclass(frozen=True, slots=True)
class RenditionRecord(_Record):
    """``renditions/{r}``: one conversion of the table (a converter version + schema decoding)."""

    converter_version: str
    schema_ref: str
    """The decode schema (``subject:version``), ``""`` when payloads are not decoded."""
    created_ms: int
    state: RenditionState
    """``building`` until activated, ``active``, ``draining`` once replaced, ``collected``."""
    upper_ms: int
    """This rendition's frontier: partitions in ``[table since, upper_ms)`` are committed and
    published. Never decreases."""
    holds: int = 0
    """Bumped by each new reader hold, so a collection racing a new hold fails its CAS."""
    dead_letters: bool = False
    """Rows whose payload does not decode go to dead-letter files (``CommittedFile``) instead
    of the table's files (fixed when the rendition is created: ``iceberg.dead_letters``)."""


@dataclass(frozen=True, slots=True)
class CommittedFile:
    """One Parquet file of a committed partition."""

    path: str
    """Final key in the object store (root included)."""
    size: int
    rows: int
    first_offset: int
    last_offset: int
    crc32c: int
    """CRC32C of the whole file: a published copy is checked against it."""
    dead_letters: bool = False
    """A file of the partition's dead letters (rows that do not decode, kept apart by a
    rendition with ``dead_letters``), below ``_dead_letters/``: in the ``<topic>__dlq``
    Iceberg table, not the topic's."""


@dataclass(frozen=True, slots=True)
class PartitionCommit(_Record):
    """``renditions/{r}/parts/{start_ms:020}``: a partition committed exactly once."""

    start_ms: int
    end_ms: int
    files: list[CommittedFile]
    """In offset order; empty for an empty partition."""
    rows: int
    first_offset: int
    """-1 when the partition is empty."""
    last_offset: int
    """-1 when the partition is empty."""
    input_revision: int
    """The etcd revision of the manifest and clock the run planned from."""
    converter_version: str
    token: str
    """The run that committed it; its staging holds the files until they are published."""
    committed_ms: int
    published: bool = False
    """Every file is at its final path (then the staging copies may be gone)."""

    def __post_init__(self) -> None:
        files = [f if isinstance(f, CommittedFile) else CommittedFile(**f) for f in self.files]
        object.__setattr__(self, "files", files)


@dataclass(frozen=True, slots=True)
class RunIntent(_Record):
    """``intents/{token}``: a conversion run at work; it lives under the run's lease."""

    rendition: str
    partitions: list[int]
    """Start of each partition the run converts."""
    input_revision: int
    created_ms: int


@dataclass(frozen=True, slots=True)
class HoldRecord(_Record):
    """``holds/{id}``: a reader reads ``rendition``; it lives under the reader's lease."""

    rendition: str
    created_ms: int
    holder: str = field(default="")
    """Free text for operators (host, pid, job)."""


class TableKeys:
    """The keys of one topic's table."""

    def __init__(self, keys: Keys, topic: str) -> None:
        self.topic = topic
        self.prefix = keys.tables_prefix(topic)

    def table(self) -> str:
        return f"{self.prefix}table"

    def renditions_prefix(self) -> str:
        """Prefix of every rendition record and every partition commit."""
        return f"{self.prefix}renditions/"

    def rendition(self, rendition: str) -> str:
        return f"{self.renditions_prefix()}{rendition}"

    def parts_prefix(self, rendition: str) -> str:
        return f"{self.rendition(rendition)}/parts/"

    def part(self, rendition: str, start_ms: int) -> str:
        return f"{self.parts_prefix(rendition)}{start_ms:020d}"

    def intents_prefix(self) -> str:
        return f"{self.prefix}intents/"

    def intent(self, token: str) -> str:
        return f"{self.intents_prefix()}{token}"

    def holds_prefix(self) -> str:
        return f"{self.prefix}holds/"

    def hold(self, hold_id: str) -> str:
        return f"{self.holds_prefix()}{hold_id}"

    def is_rendition(self, key: str) -> bool:
        """Whether ``key`` (below ``renditions_prefix``) is a rendition record, not a part."""
        return (
            key.startswith(self.renditions_prefix())
            and "/" not in key[len(self.renditions_prefix()) :]
        )
