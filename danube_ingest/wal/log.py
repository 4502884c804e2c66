"""RegionLog: the write-ahead log shared by every topic of a region, with group commit.

Guarantees:

* ``stage``/``stage_batch`` assign offsets at once (per topic: consecutive, never reused, also
  across restarts) and return a future that completes once the entries are durable: written and
  fdatasync'ed with ``fsync="always"``, written (in the page cache) with ``fsync="never"``.
* Entries become visible to ``on_durable`` in offset order, before their future completes.
* Staged entries are framed and handed to the backend as one chunk on the next event loop
  iteration after the first of them was staged (or at once, after ``CHUNK_ENTRIES``). The file
  backend's one writer thread takes every chunk handed to it, issues one write (``writev``) and
  one ``fdatasync`` for all of them, and completes all their waiters with one wake-up of the
  event loop, picking them up as soon as it is idle, except that while small chunks stream in
  quickly it waits up to ``linger_us`` for more to share the sync (a lone append never waits;
  see ``FileBackend._linger_for_more`` in :mod:`danube_ingest.wal.local.writer`), and always
  lingers ``fsync_interval_ms`` if that is configured.
* An entry the frame cannot hold (``framing.entry_size``), or a topic name too long for a TOPIC
  frame, is refused by ``stage``/``stage_batch`` with ``InvalidEntryError`` before it gets an
  offset: nothing is stored, no offset is used, the log goes on.
* A failed write or fsync fails every pending append and poisons the log (``WalFailedError``);
  reopening runs recovery against what really is on disk. So does anything else that stops the
  sequencer's framing or kills the writer thread: every waiter gets the error at once, none hangs.

Division of labour: this module is the sequencer, on the event loop thread. It assigns offsets,
frames entries, decides rotation and so knows every frame's segment and byte position (the
sparse index) before the bytes reach the backend. The backend (the contract:
:mod:`danube_ingest.wal.backend`) only stores bytes in order and reports them durable:
:class:`~danube_ingest.wal.local.FileBackend` in segment files (a region directory),
:class:`~danube_ingest.wal.memory.MemoryBackend` in ``bytearray`` objects (``region_dir=None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from danube_ingest.errors import (
    DuplicateSequenceError,
    InvalidEntryError,
    PayloadTooLargeError,
    SequenceGapError,
    WalClosedError,
    WalFailedError,
    WalStalledError,
)
from danube_ingest.wal.backend import Backend, Chunk
from danube_ingest.wal.backend import DurableCallback as DurableCallback
from danube_ingest.wal.backend import FsyncMode as FsyncMode
from danube_ingest.wal.backend import Group as Group
from danube_ingest.wal.block import BlockEntries, EntryBlock
from danube_ingest.wal.completion import Completion
from danube_ingest.wal.framing import (
    MAX_ENTRY_BODY,
    Entry,
    Kind,
    check_topic_name,
    checkpoint_frame,
    drop_frame,
    entry_size,
    frame_pieces,
    messages_frame,
    time_frame,
    topic_frame,
)
from danube_ingest.wal.kafka import KafkaBackend, KafkaWal
from danube_ingest.wal.local import FileBackend
from danube_ingest.wal.memory import MemoryBackend
from danube_ingest.wal.meta import ProducerBatch, Snapshot, TopicMeta
from danube_ingest.wal.recovery import RegionState
from danube_ingest.wal.segment import segment_path
from danube_ingest.wal.space import DiskFree, disk_free

log = logging.getLogger(__name__)

#: Entries of one topic staged in one tick are cut into frames of about this many payload
#: bytes: small enough that a catch-up reader decodes little it does not need, large enough
#: that the per-frame CRC and header cost nothing.
FRAME_TARGET_BYTES = 1024 * 1024
#: Default size at which the active segment is sealed (``storage.wal.segment_bytes``).
DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024
#: Seals closer together than this share one snapshot: a snapshot only bounds how much
#: recovery scans, and under a fast stream of large appends (a seal every few milliseconds)
#: one per seal would compete with the log itself for fsyncs.
SNAPSHOT_MIN_INTERVAL = 1.0
#: A chunk is handed to the writer once this many entries are staged, without waiting for the
#: end of the event loop iteration, so the writer syncs one chunk while the next is staged.
CHUNK_ENTRIES = 256
#: Default most time (µs) the writer waits for more appends to join a group of small ones (the
#: adaptive linger, ``FileBackend._linger_for_more``).
DEFAULT_LINGER_US = 1000


@dataclass(frozen=True, slots=True)
class StagedBlock:
    """What ``stage_block`` did with a block: its offsets, and whether it was a retry."""

    future: Awaitable[None]
    """Completes once the block's frame is durable."""
    offsets: range
    """The block's offsets (those of its first storage, for a duplicate)."""
    duplicate: bool
    """True when the producer's sequence was stored before: nothing was staged."""


@dataclass(frozen=True, slots=True)
class Sealed:
    """A segment that will never change again (announced to ``on_sealed``)."""

    region: str
    seq: int
    size: int
    path: str | None
    """The file, or None in memory mode."""


class RegionLog:
    """A region's write-ahead log. Create with :meth:`open`; use from one event loop."""

    def __init__(
        self,
        region: str,
        backend: Backend,
        state: RegionState,
        *,
        region_dir: Path | None,
        segment_bytes: int,
        segment_seconds: float,
        index_interval: int,
        max_entry_bytes: int,
        snapshot_on_seal: bool = True,
    ) -> None:
        self.region = region
        self.region_dir = region_dir
        self._backend = backend
        self._segment_bytes = segment_bytes
        self._segment_seconds = segment_seconds
        self._index_interval = index_interval
        self._max_entry_bytes = max_entry_bytes
        self._snapshot_on_seal = snapshot_on_seal and region_dir is not None
        self._last_snapshot = float("-inf")
        self._topics: dict[str, TopicMeta] = state.topics
        self._next_topic_id = state.next_topic_id
        self.uploaded: set[int] = set(state.uploaded)
        #: Dropped topic id -> a seq at or after its DROP frame's segment: segments up to that
        #: seq may hold its frames, which the uploader must skip (see ``drop_topic``).
        self.dropped: dict[int, int] = dict(state.dropped)
        self._pending_drops: list[TopicMeta] = []
        #: seq -> bytes durable in that segment. The active segment grows; sealed ones do not.
        self.segment_sizes: dict[int, int] = dict(state.segments)
        self._disk_bytes = sum(self.segment_sizes.values())
        self.sealed: set[int] = set(state.segments)
        self.on_durable: DurableCallback | None = None
        self.on_sealed: Callable[[Sealed], None] | None = None
        self._loop = asyncio.get_running_loop()
        self._pending: dict[TopicMeta, list[Entry]] = {}
        self._pending_bytes = 0
        self._pending_markers: list[TopicMeta] = []
        self._pending_future: Completion | None = None
        self._handoff_handle: asyncio.Handle | None = None
        self._batch_ms = 0
        self._pending_count = 0
        self._rotate_requested = False
        self._error: BaseException | None = None
        self._closed = False
        self._seq = state.next_seq - 1
        self._position = 0
        self._registered: set[int] = set()
        self._segment_started = time.monotonic()
        self._segment_has_data = False
        self._age_timer: asyncio.TimerHandle | None = None
        self._snapshot_tasks: set[asyncio.Future[None]] = set()
        #: Waiters for a snapshot at the next seal, whatever SNAPSHOT_MIN_INTERVAL says.
        self._snapshot_waiters: list[asyncio.Future[None]] = []
        self._recovered = state
        #: Why appends are refused now, from backends that can stall (Kafka unreachable).
        self._refusal: Callable[[], str | None] | None = getattr(backend, "refusal", None)

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        region_dir: Path | None,
        *,
        region: str = "r0",
        fsync: FsyncMode = "always",
        fsync_interval_ms: int = 0,
        linger_us: int = DEFAULT_LINGER_US,
        max_batch_bytes: int = 4 * 1024 * 1024,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        segment_seconds: float = 10.0,
        index_interval: int = 64 * 1024,
        max_entry_bytes: int = 64 * 1024 * 1024,
        snapshot_on_seal: bool = True,
        min_free_bytes: int = 0,
        free_space: DiskFree = disk_free,
        kafka: KafkaWal | None = None,
    ) -> RegionLog:
        """Recover (file mode) or create (``region_dir=None``: memory mode) a region log.

        With ``kafka`` the region's log is in Kafka (:class:`KafkaBackend`) and ``region_dir``
        only caches it: recovery rebuilds that directory from Kafka.

        Recovery runs in a worker thread. The previously active segment is sealed as it is and
        appends go to a new segment. A segment's blocks are preallocated only while that leaves
        ``min_free_bytes`` free (as ``free_space`` measures; see :mod:`danube_ingest.wal.space`).
        """
        backend: Backend
        if region_dir is None:
            backend = MemoryBackend()
        elif kafka is not None:
            backend = KafkaBackend(region_dir, kafka, region)
        else:
            backend = FileBackend(
                region_dir,
                fsync=fsync,
                fsync_interval=fsync_interval_ms / 1000.0,
                max_batch_bytes=max_batch_bytes,
                reserve_bytes=segment_bytes,
                linger=linger_us / 1e6,
                min_free_bytes=min_free_bytes,
                free_space=free_space,
            )
        state = await backend.recover(index_interval)
        wal = cls(
            region,
            backend,
            state,
            region_dir=region_dir,
            segment_bytes=segment_bytes,
            segment_seconds=segment_seconds,
            index_interval=index_interval,
            max_entry_bytes=max_entry_bytes,
            snapshot_on_seal=snapshot_on_seal,
        )
        backend.start(wal)
        first = Chunk(None)
        wal._rotate(first)
        first.seq = wal._seq
        first.end = wal._position
        backend.submit(first)
        wal._schedule_age_check()
        return wal

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this log runs on (and reports completions on)."""
        return self._loop

    @property
    def recovered(self) -> RegionState:
        """What recovery found when this log was opened (truncated tails, bytes scanned)."""
        return self._recovered

    # -- topics ----------------------------------------------------------------------------

    def topic(self, name: str) -> TopicMeta | None:
        return self._topics.get(name)

    def topics(self) -> list[TopicMeta]:
        return list(self._topics.values())

    def ensure_topic(self, name: str) -> TopicMeta:
        """The topic's state, registering a new topic (``InvalidEntryError`` for a name that
        does not fit a TOPIC frame)."""
        topic = self._topics.get(name)
        if topic is None:
            check_topic_name(name)
            topic = TopicMeta(name, self._next_topic_id)
            self._next_topic_id += 1
            self._topics[name] = topic
        return topic

    def drop_topic(self, name: str) -> Completion | None:
        """Forget the topic (it was deleted); ``None`` if the region does not know it.

        From the call on, the name is a new, empty topic (the next entry of it gets offset 0
        under a new topic id) and the dropped incarnation's offsets are no longer readable; its
        frames no longer keep any segment (the cleaner may delete them once uploaded) and the
        uploader skips them. The returned future completes once the DROP frame is durable:
        only then does a restart forget the incarnation too.
        """
        topic = self._topics.pop(name, None)
        if topic is None:
            return None
        batch = self._future()
        # A seq at or after the segment the DROP frame will be framed in.
        self.dropped[topic.topic_id] = self._seq + 1
        self._pending_drops.append(topic)
        log.info(
            "wal topic dropped region=%s topic=%s topic_id=%d next_offset=%d",
            self.region,
            name,
            topic.topic_id,
            topic.next_offset,
        )
        return batch

    async def adopt_producers(self, name: str, producers: dict[int, list[ProducerBatch]]) -> None:
        """Replace the topic's idempotent producer table with ``producers`` (handed over by
        its previous owner), durably before returning: a restart of this log recovers it.

        Call before the topic gets an offset from this log's owner. Durable through a region
        snapshot taken at a seal made for it (a WAL in memory keeps it in memory only); a
        snapshot that is later unreadable loses the adopted table (recovery then rebuilds the
        table from the segments alone). Raises ``WalFailedError`` if it could not be written.
        """
        self._check_open()
        topic = self.ensure_topic(name)
        topic.producers = dict(producers)
        if self.region_dir is None:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._snapshot_waiters.append(waiter)
        self._rotate_requested = True
        await self._future()
        await waiter

    async def snapshot_now(self) -> None:
        """Seal the active segment and record a region snapshot at that seal, whatever
        ``SNAPSHOT_MIN_INTERVAL`` says; return once it is recorded. With the Kafka backend this
        is also what lets Kafka drop the records of deleted segments (``KafkaBackend``)."""
        self._check_open()
        if self.region_dir is None:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._snapshot_waiters.append(waiter)
        self._rotate_requested = True
        await self._future()
        await waiter

    # -- appending -------------------------------------------------------------------------

    def _check_refusal(self) -> None:
        assert self._refusal is not None
        reason = self._refusal()
        if reason is not None:
            raise WalStalledError(f"region {self.region}: {reason}")

    def _check_open(self) -> None:
        if self._error is not None:
            raise WalFailedError(f"region {self.region} failed: {self._error}") from self._error
        if self._closed:
            raise WalClosedError(f"region {self.region} is closed")

    def _future(self) -> Completion:
        fut = self._pending_future
        if fut is None:
            self._check_open()
            fut = self._pending_future = Completion(self._loop)
            # Entries staged in one event loop iteration share an ingest time: the moment their
            # batch opened (microseconds apart; it saves a clock read per entry).
            self._batch_ms = int(time.time() * 1000)
            self._handoff_handle = self._loop.call_soon(self._handoff)
        return fut

    def _check_entry(self, name: str, entry: Entry) -> int:
        """The entry's encoded size; raises (before any offset is assigned) for an entry over
        ``max_entry_bytes`` or one the frame cannot hold."""
        size = len(entry.payload)
        if size > self._max_entry_bytes:
            raise PayloadTooLargeError(
                f"entry of {size} bytes for topic {name} exceeds {self._max_entry_bytes}"
            )
        try:
            return entry_size(entry)
        except InvalidEntryError as exc:
            raise InvalidEntryError(f"entry for topic {name} cannot be stored: {exc}") from None

    def stage(self, name: str, entry: Entry) -> Completion:
        """Assign ``entry`` its offset and ingest time; the future completes once it is durable.

        Raises ``PayloadTooLargeError`` or ``InvalidEntryError`` (the entry gets no offset),
        ``WalStalledError`` while the backend cannot store anything (``Backend.refusal``).
        """
        if self._refusal is not None:
            self._check_refusal()
        batch = self._pending_future
        if batch is None:
            batch = self._future()
        size = self._check_entry(name, entry)
        topic = self._topics.get(name)
        if topic is None:
            topic = self.ensure_topic(name)
        offset = topic.next_offset
        topic.next_offset = offset + 1
        entry.offset = offset
        now = self._batch_ms
        if now < topic.last_ingest_ms:
            now = topic.last_ingest_ms
        else:
            topic.last_ingest_ms = now
        entry.ingest_ms = now
        entry._batch = batch
        pending = self._pending.get(topic)
        if pending is None:
            self._pending[topic] = [entry]
        else:
            pending.append(entry)
        self._pending_bytes += size
        self._pending_count += 1
        if self._pending_count >= CHUNK_ENTRIES:
            self._handoff_now()
        return batch

    def _handoff_now(self) -> None:
        handle = self._handoff_handle
        if handle is not None:
            handle.cancel()
        self._handoff()

    def stage_batch(self, name: str, entries: Sequence[Entry]) -> Completion:
        """Stage several entries of one topic; one future for all of them.

        All or nothing: if one entry is refused (``PayloadTooLargeError``,
        ``InvalidEntryError``, ``WalStalledError``), none gets an offset.
        """
        if self._refusal is not None:
            self._check_refusal()
        batch = self._future()
        if not entries:
            return batch  # an empty MESSAGES frame cannot be encoded
        total = 0
        for entry in entries:
            total += self._check_entry(name, entry)
        topic = self.ensure_topic(name)
        offset = topic.next_offset
        now = self._batch_ms
        if now < topic.last_ingest_ms:
            now = topic.last_ingest_ms
        topic.last_ingest_ms = now
        for entry in entries:
            entry.offset = offset
            entry.ingest_ms = now
            entry._batch = batch
            offset += 1
        topic.next_offset = offset
        pending = self._pending.get(topic)
        if pending is None:
            self._pending[topic] = list(entries)
        else:
            pending.extend(entries)
        self._pending_bytes += total
        return batch

    def stage_block(
        self, name: str, block: EntryBlock, producer_id: int = 0, sequence: int = 0
    ) -> StagedBlock:
        """Stage a checked entry block as one MESSAGES frame of its own.

        The block's entries get consecutive offsets and one ingest time, and are stamped with
        ``producer_id`` and ``sequence`` (as each entry's producer and request id). With a
        ``producer_id`` (idempotent), ``sequence`` must follow the topic's record of that
        producer: the next one (or any, for a producer the topic does not know) is staged; one
        already stored is not staged again and is answered with its first offsets (its future
        completes when that storage is durable); a gap raises ``SequenceGapError``, a sequence
        older than the remembered window ``DuplicateSequenceError``. Nothing is staged when an
        error is raised (``WalStalledError`` as for ``stage``).
        """
        self._check_open()
        if self._refusal is not None:
            self._check_refusal()
        topic = self.ensure_topic(name)
        if producer_id:
            known = topic.producers.get(producer_id)
            if known:
                duplicate = _known_sequence(name, producer_id, sequence, known, self._loop)
                if duplicate is not None:
                    return duplicate
        if self._pending_future is not None:
            self._handoff_now()  # entries staged before this block are framed before it
        batch = Completion(self._loop)
        now = max(int(time.time() * 1000), topic.last_ingest_ms)
        topic.last_ingest_ms = now
        offset = topic.next_offset
        offsets = range(offset, offset + block.count)
        block.stamp(now, producer_id, sequence)
        topic.next_offset = offsets.stop
        chunk = Chunk(batch)
        try:
            self._frame_block(chunk, topic, BlockEntries(block, offset), now)
        except Exception as exc:
            log.exception("wal framing failed region=%s", self.region)
            self.chunks_failed(exc, [chunk])
            return StagedBlock(batch, offsets, False)
        if producer_id:
            topic.note_producer_batch(
                producer_id, ProducerBatch(sequence, offset, block.count, batch)
            )
        self._backend.submit(chunk)
        return StagedBlock(batch, offsets, False)

    def stage_time_marker(
        self, name: str, *, min_next_offset: int = 0, min_ingest_ms: int = 0
    ) -> Completion:
        """Durably record that ``name`` will get no entry with an ingest time below now (nor
        below ``min_ingest_ms``: a floor a previous owner's clock set).

        With ``min_next_offset`` above the topic's next offset, the topic's offsets also jump
        there (a new owner continuing a topic whose earlier offsets live elsewhere): the skipped
        offsets never exist, readers pass over them.
        """
        batch = self._future()
        topic = self.ensure_topic(name)
        topic.last_ingest_ms = max(topic.last_ingest_ms, self._batch_ms, min_ingest_ms)
        if min_next_offset > topic.next_offset:
            topic.next_offset = min_next_offset
            if not topic.spans and topic.hwm == topic.first_offset:
                topic.first_offset = min_next_offset
        self._pending_markers.append(topic)
        return batch

    # -- sequencer (event loop side) -------------------------------------------------------

    def _handoff(self) -> None:
        """Frame everything staged since the last handoff and pass it to the writer.

        Framing cannot fail on entries ``stage`` accepted; should it fail anyway, the log is
        marked failed and every waiter of the chunk gets the error (an offset was assigned
        that will never be written: nothing after it may be).
        """
        chunk = Chunk(self._pending_future)
        pending = self._pending
        markers = self._pending_markers
        drops = self._pending_drops
        pending_bytes = self._pending_bytes
        self._pending = {}
        self._pending_markers = []
        self._pending_drops = []
        self._pending_bytes = 0
        self._pending_future = None
        self._handoff_handle = None
        self._pending_count = 0
        if self._error is not None:
            self._fail_chunks([chunk], self._error)
            return
        try:
            self._frame_chunk(chunk, pending, markers, pending_bytes, drops)
        except Exception as exc:
            log.exception("wal framing failed region=%s", self.region)
            self.chunks_failed(exc, [chunk])
            return
        self._backend.submit(chunk)

    def _frame_chunk(
        self,
        chunk: Chunk,
        pending: dict[TopicMeta, list[Entry]],
        markers: list[TopicMeta],
        pending_bytes: int,
        drops: Sequence[TopicMeta] = (),
    ) -> None:
        """Frame the staged entries and markers into ``chunk`` (the sequencer's bookkeeping
        of positions, spans and registrations follows)."""
        if self._position >= self._segment_bytes or self._rotate_requested:
            self._rotate(chunk, pending)
        pieces = chunk.pieces
        position = self._position
        seq = self._seq
        registered = self._registered
        interval = self._index_interval
        out_groups = chunk.groups
        for topic, entries in pending.items():
            if topic.topic_id not in registered:
                frame = topic_frame(topic.topic_id, topic.name)
                pieces.append(frame)
                position += len(frame)
                registered.add(topic.topic_id)
            groups = (
                _split(entries, FRAME_TARGET_BYTES)
                if pending_bytes > FRAME_TARGET_BYTES and len(entries) > 1
                else (entries,)
            )
            for group in groups:
                first = group[0]
                frame_pieces = messages_frame(topic.topic_id, first.offset, group)
                topic.note_frame(
                    seq,
                    position,
                    first.offset,
                    len(group),
                    first.ingest_ms,
                    group[-1].ingest_ms,
                    interval,
                )
                size = 0
                for piece in frame_pieces:
                    size += len(piece)
                position += size
                pieces.extend(frame_pieces)
                out_groups.append((topic, group, size, frame_pieces[1:]))
        for topic in markers:
            if topic.topic_id not in registered:
                frame = topic_frame(topic.topic_id, topic.name)
                pieces.append(frame)
                position += len(frame)
                registered.add(topic.topic_id)
            frame = time_frame(topic.topic_id, topic.next_offset, topic.last_ingest_ms)
            pieces.append(frame)
            position += len(frame)
            out_groups.append((topic, [], topic.next_offset, None))
        for topic in drops:
            # After the topic's own staged frames above: those belong to the dropped
            # incarnation too.
            frame = drop_frame(topic.topic_id, topic.next_offset)
            pieces.append(frame)
            position += len(frame)
        if pending or markers or drops:
            self._segment_has_data = True
        chunk.seq = seq
        chunk.end = position
        self._position = position

    def _frame_block(
        self, chunk: Chunk, topic: TopicMeta, entries: BlockEntries, ingest_ms: int
    ) -> None:
        """Frame one staged block into ``chunk``: a MESSAGES frame whose body is the batch
        header and the block as it is (no entry is re-encoded)."""
        if self._position >= self._segment_bytes or self._rotate_requested:
            self._rotate(chunk, {topic: entries})
        pieces = chunk.pieces
        position = self._position
        if topic.topic_id not in self._registered:
            frame = topic_frame(topic.topic_id, topic.name)
            pieces.append(frame)
            position += len(frame)
            self._registered.add(topic.topic_id)
        block = entries.block
        header = block.header(topic.topic_id, entries.base_offset, ingest_ms)
        # (The block's bytearray is never changed once stamped: it is written as it is.)
        framed = frame_pieces(Kind.MESSAGES, (header, cast(bytes, block.data)))
        topic.note_frame(
            self._seq,
            position,
            entries.base_offset,
            block.count,
            ingest_ms,
            ingest_ms,
            self._index_interval,
        )
        size = 0
        for piece in framed:
            size += len(piece)
        position += size
        pieces.extend(framed)
        chunk.groups.append((topic, entries, size, framed[1:]))
        self._segment_has_data = True
        chunk.seq = self._seq
        chunk.end = position
        self._position = position

    def _rotate(
        self, chunk: Chunk, unframed: Mapping[TopicMeta, Sequence[Entry]] | None = None
    ) -> None:
        """Seal the active segment (if any) and start the next one with ``chunk``."""
        now = time.monotonic()
        if self._snapshot_waiters or (
            self._seq >= 0
            and self._snapshot_on_seal
            and now - self._last_snapshot >= SNAPSHOT_MIN_INTERVAL
        ):
            chunk.seal = self._snapshot(self._seq + 1, unframed)
            chunk.seal_waiters, self._snapshot_waiters = self._snapshot_waiters, []
            self._last_snapshot = now
        self._seq += 1
        self._registered = set()
        frame = checkpoint_frame(self._seq, int(time.time() * 1000), self.region)
        chunk.pieces.append(frame)
        chunk.rotate_to = self._seq
        self._position = len(frame)
        self._segment_started = time.monotonic()
        self._segment_has_data = False
        self._rotate_requested = False

    def _snapshot(
        self, next_seq: int, unframed: Mapping[TopicMeta, Sequence[Entry]] | None = None
    ) -> Snapshot:
        topics = []
        for topic in self._topics.values():
            data = topic.to_json()
            # Entries staged but not yet framed land in the next segment, not in this snapshot.
            # (Not the last span's end: an offset jump after it must survive a restart.)
            staged = unframed.get(topic) if unframed else None
            if staged:
                first = staged.base_offset if isinstance(staged, BlockEntries) else staged[0].offset
                data["next_offset"] = first
            topics.append(data)
        return Snapshot(
            region=self.region,
            next_seq=next_seq,
            next_topic_id=self._next_topic_id,
            topics=topics,
            uploaded=sorted(self.uploaded),
            dropped=dict(self.dropped),
        )

    def _schedule_age_check(self) -> None:
        self._age_timer = self._loop.call_later(
            max(self._segment_seconds / 4, 0.01), self._age_check
        )

    def _age_check(self) -> None:
        """Rotate a segment older than ``segment_seconds`` that holds data, even when idle."""
        if self._closed or self._error is not None:
            return
        age = time.monotonic() - self._segment_started
        if age >= self._segment_seconds and self._segment_has_data:
            self.rotate()
        self._schedule_age_check()

    def rotate(self) -> None:
        """Seal the active segment now; the next frames go to a new one."""
        self._check_open()
        self._rotate_requested = True
        self._future()

    # -- completion (event loop side, called by the backend) -------------------------------

    def chunks_written(self, chunks: list[Chunk], sealed: tuple[int, int] | None) -> None:
        """The backend's report: ``chunks`` are durable (``sealed``: a segment sealed before
        them). Records their sizes, moves each topic's high watermark, calls ``on_durable``
        and completes the chunks' waiters, in offset order."""
        if sealed is not None:
            self._sealed(*sealed)
        snapshot = chunks[0].seal
        if snapshot is not None and self.region_dir is not None:
            # Everything before this chunk's segment is durable: the snapshot now tells the truth.
            task = asyncio.ensure_future(self._write_snapshot(snapshot, chunks[0].seal_waiters))
            self._snapshot_tasks.add(task)
            task.add_done_callback(self._snapshot_tasks.discard)
        on_durable = self.on_durable
        sizes = self.segment_sizes
        for chunk in chunks:
            self._disk_bytes += chunk.end - sizes.get(chunk.seq, 0)
            sizes[chunk.seq] = chunk.end
            groups = chunk.groups
            for topic, entries, size, _body in groups:
                if isinstance(entries, BlockEntries):
                    topic.hwm = entries.end_offset  # (without decoding the block)
                elif entries:
                    topic.hwm = entries[-1].offset + 1
                elif size > topic.hwm:
                    topic.hwm = size  # a TIME marker: the group carries the topic's next offset
            if on_durable is not None and groups:
                on_durable(groups)
            future = chunk.future
            if future is not None:
                future.complete()

    def _sealed(self, seq: int, size: int) -> None:
        self.sealed.add(seq)
        self._disk_bytes += size - self.segment_sizes.get(seq, 0)
        self.segment_sizes[seq] = size
        if self.on_sealed is not None:
            path = str(segment_path(self.region_dir, seq)) if self.region_dir else None
            self.on_sealed(Sealed(self.region, seq, size, path))

    async def _write_snapshot(
        self, snapshot: Snapshot, waiters: Sequence[asyncio.Future[None]] = ()
    ) -> None:
        try:
            await self._backend.snapshot(snapshot)
        except OSError as exc:
            # The snapshot only shortens recovery; segments remain the source of truth
            # (except for adopted producer tables: their waiters get the error).
            log.warning("wal snapshot failed region=%s error=%s", self.region, exc)
            error = WalFailedError(f"region {self.region}: snapshot not written: {exc}")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            return
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def chunks_failed(self, exc: BaseException, chunks: list[Chunk]) -> None:
        """Mark the log failed (the first failure is kept) and fail ``chunks``' waiters."""
        if self._error is None:
            self._error = exc
            log.error("wal failed region=%s error=%r", self.region, exc)
        self._fail_chunks(chunks, exc)

    def _fail_chunks(self, chunks: list[Chunk], exc: BaseException) -> None:
        error = WalFailedError(f"region {self.region}: write failed: {exc}")
        for chunk in chunks:
            for waiter in chunk.seal_waiters:
                waiter.cancel()  # its adopt_producers fails on the chunk's future
            future = chunk.future
            if future is not None:
                # Via the loop: this can run inside a task (close(), a full chunk handed over
                # by stage()), and a Completion must not wake its waiters from inside a task.
                self._loop.call_soon(future.complete, error)

    # -- reading ---------------------------------------------------------------------------

    async def read(self, seq: int, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of segment ``seq`` (clipped to what is durable)."""
        durable = self.segment_sizes.get(seq, 0)
        size = min(size, durable - start)
        if size <= 0:
            return b""
        return await self._backend.read(seq, start, size)

    # -- housekeeping ----------------------------------------------------------------------

    def delete_segment(self, seq: int) -> asyncio.Future[None]:
        """Remove the oldest sealed segment and every index entry pointing into it.

        Segments go oldest first, so every topic's retained offsets stay one contiguous run.
        The index and the byte count forget the segment before this returns (no read reaches
        it afterwards). Its file is unlinked and the directory synced in the log's file thread,
        off the event loop: the future returned is done once that is durable, or has the
        removal's error (the segment is forgotten either way, and its file is tried again with
        the next removal). ``close()`` and the next snapshot wait for removals under way, so
        no snapshot that leaves a segment out is durable before its file's removal is.
        """
        if seq not in self.sealed:
            raise ValueError(f"segment {seq} of region {self.region} is not sealed")
        if seq != min(self.sealed):
            raise ValueError(
                f"segment {seq} of region {self.region} is not the oldest ({min(self.sealed)})"
            )
        for topic in self._topics.values():
            spans = topic.spans
            if spans and spans[0].seq == seq:
                spans.pop(0)
                topic.first_offset = spans[0].first_offset if spans else topic.hwm
        self.sealed.discard(seq)
        self._disk_bytes -= self.segment_sizes.pop(seq, 0)
        self.uploaded.discard(seq)
        # Segments go oldest first: none at or below ``seq`` is left.
        for topic_id in [tid for tid, last in self.dropped.items() if last <= seq]:
            del self.dropped[topic_id]
        return self._backend.delete(seq)

    def mark_uploaded(self, seq: int) -> None:
        """Record that sealed segment ``seq`` is stored as an object and every topic range in
        it is committed to the manifest: from now on the cleaner may delete it. Persisted with
        the next snapshot (a mark lost in a crash only makes the uploader repeat itself)."""
        if seq not in self.sealed:
            raise ValueError(f"segment {seq} of region {self.region} is not sealed")
        self.uploaded.add(seq)

    @property
    def disk_bytes(self) -> int:
        """Bytes of segment data this region holds (durable bytes, sealed and active)."""
        return self._disk_bytes

    @property
    def unwritten_bytes(self) -> int:
        """About how many bytes staged appends will still add to the disk: payloads not yet
        framed plus frames of the active segment not yet durable."""
        framed = self._position - self.segment_sizes.get(self._seq, 0)
        return self._pending_bytes + (framed if framed > 0 else 0)

    @property
    def active_seq(self) -> int:
        return self._seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> BaseException | None:
        """The write failure that poisoned the log (every append fails until it is reopened
        and recovered), or None."""
        return self._error

    async def close(self) -> None:
        """Write out everything staged, sync it, and stop the writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._handoff_handle is not None:
            self._handoff_handle.cancel()
            fut = self._pending_future
            self._handoff()
            if fut is not None:
                with contextlib.suppress(WalFailedError):
                    await fut
        if self._age_timer is not None:
            self._age_timer.cancel()
        await self._backend.close()
        if self._snapshot_tasks:
            await asyncio.gather(*self._snapshot_tasks, return_exceptions=True)
        if self.region_dir is not None and self._error is None:
            snapshot = self._snapshot(self._seq + 1)
            await self._write_snapshot(snapshot)


def _known_sequence(
    topic: str,
    producer_id: int,
    sequence: int,
    known: list[ProducerBatch],
    loop: asyncio.AbstractEventLoop,
) -> StagedBlock | None:
    """None when ``sequence`` is the producer's next; the first storage of a sequence it
    already stored; raises for a gap or a sequence older than the remembered batches."""
    last = known[-1].sequence
    if sequence == last + 1:
        return None
    if sequence > last:
        raise SequenceGapError(
            f"producer {producer_id:#x} on topic {topic}: batch sequence {sequence} after "
            f"{last}; resend sequence {last + 1} and the ones after it in order",
            expected=last + 1,
        )
    for stored in known:
        if stored.sequence == sequence:
            future = stored.future
            if future is None or future.done():
                future = loop.create_future()
                future.set_result(None)
            offsets = range(stored.base_offset, stored.base_offset + stored.count)
            return StagedBlock(future, offsets, True)
    raise DuplicateSequenceError(
        f"producer {producer_id:#x} on topic {topic}: batch sequence {sequence} was stored "
        f"before (the topic remembers sequences {known[0].sequence}..{last}, its offsets are "
        f"no longer known); it is not stored again",
        expected=last + 1,
    )


def _split(entries: list[Entry], target: int) -> list[list[Entry]]:
    """Cut entries into groups of about ``target`` encoded bytes, none over a frame's limit."""
    groups: list[list[Entry]] = []
    group: list[Entry] = []
    size = 0
    for entry in entries:
        esize = entry_size(entry)
        if group and size + esize > MAX_ENTRY_BODY:
            groups.append(group)
            group = []
            size = 0
        group.append(entry)
        size += esize
        if size >= target:
            groups.append(group)
            group = []
            size = 0
    if group:
        groups.append(group)
    return groups
