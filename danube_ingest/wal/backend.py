"""The contract between a region's sequencer (``RegionLog``) and the backend that stores its bytes.

The sequencer, on the event loop, assigns offsets, frames entries and decides where each frame
goes: which segment (``seq``) and at which byte position. It hands the frames over in
:class:`Chunk` objects, in order. A backend only stores those bytes and says when they are
durable. Two backends exist: :class:`~danube_ingest.wal.local.FileBackend` (segment files, one
writer thread, fdatasync) and :class:`~danube_ingest.wal.memory.MemoryBackend` (bytearrays,
for tests and ``storage.wal.mode: memory``). ``tests/wal/test_backend_contract.py`` runs the
same contract tests against both.

What a backend must do (:class:`Backend`):

* **recover**: return what an earlier tenure left (topics, offsets, segments), before ``start``.
  Offsets assigned after a restart continue from there; a backend that keeps nothing across a
  restart (memory) returns an empty state.
* **append durably, in order**: store every chunk's ``pieces`` after the previous chunk's, in
  the order ``submit`` was called. A chunk with ``rotate_to`` set starts segment ``rotate_to``
  and so **seals** the one before it (its final size is reported once, with the first durable
  chunk of the next segment).
* **report the durable end**: once chunks are durable, call ``sink.chunks_written(chunks,
  sealed)`` on the event loop, with chunks in submit order (a backend may report several at
  once: that is group commit). Each chunk's ``seq``/``end`` is then the durable end of its
  segment. A chunk is never reported before every chunk submitted before it.
* **fail loudly**: if bytes cannot be stored, call ``sink.chunks_failed(error, chunks)`` on the
  event loop with every chunk not reported durable, and fail every later ``submit`` the same
  way. Never report a chunk durable after an earlier one failed.
* **read back** what was reported durable (``read``), **delete** the oldest sealed segment (the
  sequencer only ever deletes below its mark, oldest first), record **snapshots** (the region's
  metadata, which only shortens recovery), and **close**: write out what was submitted, stop.

Per-message work stays in the sequencer; a backend sees one call per chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from danube_ingest.observability.metrics import (
    WAL_APPEND_SECONDS,
    WAL_APPENDED_BYTES,
    WAL_GROUP_BYTES,
    WAL_GROUP_MESSAGES,
)
from danube_ingest.wal.completion import Completion
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.meta import Snapshot, TopicMeta
from danube_ingest.wal.recovery import RegionState

FsyncMode = Literal["always", "never"]

#: A group of one topic's entries written in one MESSAGES frame: (topic, entries, encoded
#: bytes of the frame, the parts of its body). A TIME marker appears as
#: (topic, [], next offset after the marker, None).
Group = tuple[TopicMeta, Sequence[Entry], int, Sequence[bytes] | None]


class Chunk:
    """Frames handed from the sequencer to the backend in one piece."""

    __slots__ = (
        "end",
        "future",
        "groups",
        "handed",
        "pieces",
        "rotate_to",
        "seal",
        "seal_waiters",
        "seq",
    )

    def __init__(self, future: Completion | None) -> None:
        #: Completed by the sequencer once the chunk is durable (or failed).
        self.future = future
        self.handed = time.monotonic()  # for danube_ingest_wal_append_seconds
        #: The framed bytes, to be stored in this order.
        self.pieces: list[bytes] = []
        #: The entry groups the pieces hold (for ``on_durable`` and metrics).
        self.groups: list[Group] = []
        #: The segment the pieces belong to, and its size once they are stored.
        self.seq = -1
        self.end = 0
        #: Set on the first chunk of a new segment: store it in segment ``rotate_to``,
        #: sealing the previous one.
        self.rotate_to: int | None = None
        #: A region snapshot to record once this chunk is durable (made at a seal).
        self.seal: Snapshot | None = None
        #: Futures completed once ``seal`` is recorded (``adopt_producers``).
        self.seal_waiters: list[asyncio.Future[None]] = []


def chunk_bytes(chunk: Chunk) -> int:
    """The number of bytes ``chunk`` adds to its segment."""
    total = 0
    for piece in chunk.pieces:
        total += len(piece)
    return total


def observe_group(group: list[Chunk]) -> None:
    """Record a durable group commit in the WAL metrics (writer thread; a few µs per group)."""
    done = time.monotonic()
    nbytes = 0
    messages = 0
    for chunk in group:
        WAL_APPEND_SECONDS.observe(done - chunk.handed)
        nbytes += chunk_bytes(chunk)
        for entry_group in chunk.groups:
            messages += len(entry_group[1])
    WAL_APPENDED_BYTES.inc(nbytes)
    WAL_GROUP_BYTES.observe(nbytes)
    WAL_GROUP_MESSAGES.observe(messages)


class LogSink(Protocol):
    """What a backend reports to (the sequencer); every call is made on ``loop``'s thread."""

    @property
    def region(self) -> str:
        """The region's name (for logs and thread names)."""
        ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the sequencer runs on."""
        ...

    def chunks_written(self, chunks: list[Chunk], sealed: tuple[int, int] | None) -> None:
        """``chunks`` (in submit order, following every chunk reported before) are durable;
        ``sealed`` is ``(seq, size)`` of a segment sealed before the first of them."""
        ...

    def chunks_failed(self, exc: BaseException, chunks: list[Chunk]) -> None:
        """``chunks`` will never be durable: the log is failed from now on."""
        ...


DurableCallback = Callable[[list[Group]], None]
"""Called with the groups of a commit once they are durable, in offset order."""


class Backend(Protocol):
    """Where a region's framed bytes are stored. See the module docstring for the contract."""

    async def recover(self, index_interval: int) -> RegionState:
        """What earlier tenures stored (an empty state if nothing survives a restart), the
        sparse index every ``index_interval`` bytes. Called once, before ``start``."""
        ...

    def start(self, sink: LogSink) -> None:
        """Start taking chunks; report them to ``sink``."""
        ...

    def submit(self, chunk: Chunk) -> None:
        """Store ``chunk`` after every chunk submitted before it (event loop thread; must not
        block). Reported durable later through the sink, never from inside this call; a
        backend that has failed already may report the chunk failed at once."""
        ...

    async def read(self, seq: int, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of segment ``seq``, which were reported durable."""
        ...

    def delete(self, seq: int) -> asyncio.Future[None]:
        """Remove sealed segment ``seq``, the oldest one left. Done once the removal is
        durable (or with its error; the segment is then removed again with the next one)."""
        ...

    async def removed(self) -> None:
        """Return once every removal under way is done."""
        ...

    async def snapshot(self, snapshot: Snapshot) -> None:
        """Record ``snapshot`` durably, after every removal under way (``OSError`` if it could
        not be: the log goes on, snapshots only shorten recovery)."""
        ...

    async def close(self) -> None:
        """Store what was submitted, report it, and stop. Reads are not served afterwards."""
        ...
