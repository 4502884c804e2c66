"""KafkaBackend: a region's WAL in Kafka, acknowledged only once Kafka holds it (``acks=all``).

The sequencer (:mod:`danube_ingest.wal.log`) is the same as for files: it frames entries and
places them in segments at byte positions. This backend stores each chunk as one or more Kafka
records in the region's data topic (key = segment seq and byte position, value = the bytes; see
:mod:`danube_ingest.wal.kafka.settings`), and also writes the bytes into a local cache of
segment files (never synced) that reads, the uploader and recovery's parser use. Kafka is the
durable copy; the cache can be deleted at any time.

Group commit: one writer thread takes every chunk handed to it, produces them in one Kafka
transaction, commits it, and reports them all durable. Transactions run one at a time, on the
region's two transactional producers in turn (``TRANSACTIONAL_PRODUCERS``): Kafka answers a
commit before its markers are written, and a new transaction of the same id started meanwhile
waits 20 ms in librdkafka (``CONCURRENT_TRANSACTIONS``); the other id has no such wait. A
committed transaction is on every in-sync replica (transactions imply ``acks=all`` and
idempotence), so an acknowledged entry survives the loss of the Kafka broker that led the
partition, when ``min.insync.replicas`` is at least 2.

Fencing: ``recover`` initialises the region's transactional producers (both ids, before
reading anything), which bumps their epochs: any earlier producer of this region (a paused
process, an older tenure) can no longer commit; its open transactions are aborted and their
records are never read (readers use ``read_committed``). Appends it made after that fail; it
acknowledges none of them.

Recovery: ``recover`` reads the meta topic's latest snapshot (and the lowest segment still kept),
then every committed data record from Kafka's low watermark, and rebuilds the cache directory
from them (what was there before is discarded: Kafka is the truth). The file backend's recovery
then parses that directory exactly as it parses its own.

Deletion in two steps: ``delete(seq)`` removes the cached file and marks the segment deleted;
the next ``snapshot`` records the new lowest kept segment in the meta topic, and only after
that snapshot is committed are the records below that segment's first Kafka offset removed
with DeleteRecords. A crash between the two leaves records that recovery skips (they are below
the snapshot's ``kept_from``) and that the next deletion removes.

Kafka slow or down: a commit that times out is committed again; a transaction Kafka aborted is
produced again; for as long as Kafka is away (the group's offsets are assigned: it is stored,
or the region fails). Once nothing was committed for ``delivery_timeout_ms``, ``refusal``
makes the sequencer refuse new appends (``WalStalledError``, before they get an offset) until
Kafka commits again: the broker resumes by itself. Only fencing or a fatal producer error fails
the region (``WalFailedError``). Nothing is reported durable that Kafka did not commit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from danube_ingest.wal.backend import Chunk, LogSink, observe_group
from danube_ingest.wal.kafka.settings import RECORD_BYTES, KafkaWal, RegionTopics
from danube_ingest.wal.kafka.topics import (
    DATA_KEY,
    KEPT_FROM,
    META_KEY,
    KafkaWalError,
    delete_below,
    ensure_topics,
    read_topic,
)
from danube_ingest.wal.local.files import SegmentReads
from danube_ingest.wal.meta import SNAPSHOT_NAME, Snapshot, write_atomic
from danube_ingest.wal.recovery import RegionState, recover_region
from danube_ingest.wal.segment import list_segments, segment_path

log = logging.getLogger(__name__)

#: Seconds between two tries of a transaction Kafka refused (doubling up to ``MAX_BACKOFF``).
RETRY_BACKOFF = 0.05
MAX_BACKOFF = 1.0
#: How long Kafka may be away before the region fails (records time out), and the transaction
#: timeout that must cover it (see ``_new_producer``).
MESSAGE_TIMEOUT_MS = 600_000
TRANSACTION_TIMEOUT_MS = 900_000
#: Seconds ``close`` lets a stalled commit go on trying before it gives up on the group.
CLOSE_WAIT = 10.0


class KafkaBackend:
    """Segments in a Kafka topic, cached in local files. See the module docstring."""

    def __init__(self, cache_dir: Path, settings: KafkaWal, region: str) -> None:
        self._dir = cache_dir
        self._settings = settings
        self._region = region
        self.topics: RegionTopics = settings.region(region)
        #: The region's transactional producers (one per id), used in turn, one at a time.
        self._producers: list[Producer] = []
        self._turn = 0
        self._queue: deque[Chunk] = deque()
        #: Meta records to commit with the next transaction, with who waits for them.
        self._metas: list[tuple[bytes, int, Future[None]]] = []
        self._cond = threading.Condition()
        self._snapshot_lock = threading.Lock()
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._log: LogSink | None = None
        self._active = -1
        self._active_fd = -1
        self._reads = SegmentReads(cache_dir)
        #: seq -> Kafka offset of its first record (for DeleteRecords).
        self._first_offset: dict[int, int] = {}
        #: Lowest segment not deleted (what the next snapshot records as ``kept_from``).
        self._kept_from = 0
        #: Segments below this have been removed from Kafka (DeleteRecords done).
        self._trimmed_from = 0
        #: Kafka transactions committed (what group commit shares; for tests and metrics).
        self.commits = 0
        #: When the commit under way first failed (monotonic), None while Kafka commits.
        self._stalled_since: float | None = None
        #: When the commit under way began (monotonic), None between commits: a commit older
        #: than ``delivery_timeout_ms`` makes ``refusal`` refuse new appends.
        self._commit_started: float | None = None

    # -- recovery --------------------------------------------------------------------------

    async def recover(self, index_interval: int) -> RegionState:
        return await asyncio.to_thread(self._recover, index_interval)

    def _recover(self, index_interval: int) -> RegionState:
        settings, names = self._settings, self.topics
        ensure_topics(settings, names)
        # Every id is taken (and its open transaction aborted) before anything is read, so
        # that no open transaction of an earlier owner holds back what read_committed sees.
        # (In parallel: each init_transactions waits on Kafka's coordinator.)
        with ThreadPoolExecutor(len(names.transactional_ids), "wal-kafka-init") as pool:
            self._producers = list(pool.map(self._new_producer, names.transactional_ids))
        snapshot, kept_from = self._read_meta()
        self._kept_from = self._trimmed_from = kept_from
        self._rebuild_cache(snapshot, kept_from)
        return recover_region(self._dir, index_interval)

    def _new_producer(self, transactional_id: str) -> Producer:
        """The region's transactional producer of ``transactional_id``, initialised: every
        earlier producer of that id is fenced from here on, and its open transaction
        aborted."""
        settings = self._settings
        producer = Producer(
            {
                **settings.common(),
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                # A record Kafka did not take within message.timeout.ms leaves the producer
                # in a state only a new epoch cures (a fatal error for us): long enough to
                # ride out an outage of Kafka. The transaction timeout must be at least that
                # (at most the brokers' transaction.max.timeout.ms, 15 min by default); an
                # open transaction of a dead owner never blocks a reader, whose
                # init_transactions aborts it first.
                "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
                "message.timeout.ms": MESSAGE_TIMEOUT_MS,
            }
        )
        try:
            producer.init_transactions(max(settings.delivery_timeout_ms / 1000.0, 30.0))
        except KafkaException as exc:
            raise KafkaWalError(
                f"could not take the WAL region {transactional_id} in Kafka: {exc.args[0]}"
            ) from exc
        return producer

    def _read_meta(self) -> tuple[bytes | None, int]:
        latest: bytes | None = None
        kept_from = 0
        for message in read_topic(self._settings, self.topics.meta, group="danube-wal-recovery"):
            value = message.value()
            if message.key() != META_KEY or not value:
                continue
            latest = value
            for key, header in message.headers() or []:
                if key == KEPT_FROM and header is not None:
                    kept_from = int(header.decode())
        return latest, kept_from

    def _rebuild_cache(self, snapshot: bytes | None, kept_from: int) -> None:
        if self._dir.exists():
            shutil.rmtree(self._dir)
        self._dir.mkdir(parents=True)
        sizes: dict[int, int] = {}
        fds: dict[int, int] = {}
        broken: set[int] = set()
        try:
            for message in read_topic(
                self._settings, self.topics.data, group="danube-wal-recovery"
            ):
                key, value = message.key(), message.value()
                if key is None or len(key) != DATA_KEY.size or value is None:
                    continue
                seq, position = DATA_KEY.unpack(key)
                if seq < kept_from or seq in broken:
                    continue
                self._first_offset.setdefault(seq, message.offset())
                size = sizes.get(seq, 0)
                if position != size:
                    # Never written so: records land in order. Keep what is contiguous; the
                    # parser truncates at the last whole frame.
                    log.error(
                        "kafka wal record out of place topic=%s seq=%d position=%d expected=%d",
                        self.topics.data,
                        seq,
                        position,
                        size,
                    )
                    broken.add(seq)
                    continue
                fd = fds.get(seq)
                if fd is None:
                    fd = fds[seq] = os.open(
                        segment_path(self._dir, seq), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
                    )
                os.pwrite(fd, value, position)
                sizes[seq] = size + len(value)
        finally:
            for fd in fds.values():
                os.close(fd)
        if snapshot is not None:
            write_atomic(self._dir / SNAPSHOT_NAME, snapshot)
        log.info(
            "kafka wal region read topic=%s segments=%d bytes=%d kept_from=%d",
            self.topics.data,
            len(sizes),
            sum(sizes.values()),
            kept_from,
        )

    # -- appending -------------------------------------------------------------------------

    def start(self, sink: LogSink) -> None:
        self._log = sink
        self._thread = threading.Thread(
            target=self._run, name=f"wal-kafka-{sink.region}", daemon=True
        )
        self._thread.start()

    def submit(self, chunk: Chunk) -> None:
        with self._cond:
            failure = self._failure
            if failure is None:
                self._queue.append(chunk)
                self._cond.notify()
        if failure is not None:
            assert self._log is not None
            self._log.chunks_failed(failure, [chunk])

    def _run(self) -> None:
        group: list[Chunk] = []
        metas: list[tuple[bytes, int, Future[None]]] = []
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._metas and not self._stopping:
                        self._cond.wait()
                    if not self._queue and not self._metas:
                        return
                    group = list(self._queue)
                    self._queue.clear()
                    metas, self._metas = self._metas, []
                reports = self._cache(group)
                self._commit(group, metas)
                self.commits += 1
                if group:
                    observe_group(group)
                for _payload, _kept, waiter in metas:
                    waiter.set_result(None)
                assert self._log is not None
                for chunks, sealed in reports:
                    self._log.loop.call_soon_threadsafe(self._log.chunks_written, chunks, sealed)
                group, metas = [], []
        except BaseException as exc:  # every waiter must hear of it
            self._die(exc, group, metas)

    def _die(
        self,
        exc: BaseException,
        group: list[Chunk],
        metas: list[tuple[bytes, int, Future[None]]],
    ) -> None:
        log.error("kafka wal region failed topic=%s error=%r", self.topics.data, exc)
        with self._cond:
            self._failure = exc
            failed = group + list(self._queue)
            self._queue.clear()
            metas = metas + self._metas
            self._metas = []
        for _payload, _kept, waiter in metas:
            if not waiter.done():
                waiter.set_exception(exc)
        if self._log is not None and failed:
            self._log.loop.call_soon_threadsafe(self._log.chunks_failed, exc, failed)

    def _cache(self, group: list[Chunk]) -> list[tuple[list[Chunk], tuple[int, int] | None]]:
        """Write the group's bytes into the cache files; the reports to make once durable
        (split where a chunk starts a new segment)."""
        reports: list[tuple[list[Chunk], tuple[int, int] | None]] = []
        current: list[Chunk] = []
        sealed: tuple[int, int] | None = None
        for chunk in group:
            if chunk.rotate_to is not None:
                if current or sealed is not None:
                    reports.append((current, sealed))
                    current = []
                sealed = None
                if self._active >= 0:
                    sealed = (self._active, os.fstat(self._active_fd).st_size)
                    os.close(self._active_fd)
                self._active = chunk.rotate_to
                self._active_fd = os.open(
                    segment_path(self._dir, self._active),
                    os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                    0o644,
                )
            for piece in chunk.pieces:
                os.write(self._active_fd, piece)
            current.append(chunk)
        if current or sealed is not None:
            reports.append((current, sealed))
        return reports

    def _records(self, group: list[Chunk]) -> list[tuple[int, int, bytes]]:
        """(seq, position, value) of every record the group becomes."""
        records: list[tuple[int, int, bytes]] = []
        for chunk in group:
            data = b"".join(chunk.pieces)
            start = chunk.end - len(data)
            for cut in range(0, len(data), RECORD_BYTES):
                records.append((chunk.seq, start + cut, data[cut : cut + RECORD_BYTES]))
        return records

    def _commit(self, group: list[Chunk], metas: list[tuple[bytes, int, Future[None]]]) -> None:
        """Produce the group (and meta records) in one transaction and commit it. While Kafka
        cannot commit, abort and try again (backing off up to ``MAX_BACKOFF``), for as long as
        it takes: the group's offsets are assigned, so it is stored or the region fails. Only
        fencing (another process took the region) or a fatal producer error fails it. While
        no commit succeeds for ``delivery_timeout_ms``, ``refusal`` says so: new appends are
        refused until Kafka commits again."""
        records = self._records(group)
        self._commit_started = time.monotonic()
        backoff = RETRY_BACKOFF
        producer = self._producers[self._turn]
        while True:
            reports = _Deliveries()
            try:
                producer.begin_transaction()
                for seq, position, value in records:
                    self._produce(
                        producer,
                        self.topics.data,
                        value,
                        DATA_KEY.pack(seq, position),
                        None,
                        reports.record(seq),
                    )
                for payload, kept_from, _waiter in metas:
                    self._produce(
                        producer,
                        self.topics.meta,
                        payload,
                        META_KEY,
                        [(KEPT_FROM, str(kept_from).encode())],
                        reports.record(-1),
                    )
            except KafkaException as exc:
                self._retry_or_raise(exc.args[0], exc)
                self._abort(producer)
                backoff = self._pause(backoff)
                continue
            if self._finish(producer):
                break
            self._abort(producer)
            backoff = self._pause(backoff)
        self._turn = (self._turn + 1) % len(self._producers)
        if reports.errors:  # committed means every record was delivered: never seen
            raise KafkaWalError(f"Kafka reported {reports.errors[0]} for a committed transaction")
        self._commit_started = None
        if self._stalled_since is not None:
            log.warning(
                "kafka wal commits again topic=%s after_seconds=%.1f",
                self.topics.data,
                time.monotonic() - self._stalled_since,
            )
            self._stalled_since = None
        for seq, offset in reports.first.items():
            self._first_offset.setdefault(seq, offset)

    def _finish(self, producer: Producer) -> bool:
        """Commit the transaction under way: True once committed, False if it must be aborted
        and produced again. A commit that timed out is committed again (librdkafka's rule:
        a retriable commit error is retried with the same call)."""
        backoff = RETRY_BACKOFF
        while True:
            try:
                producer.commit_transaction(self._settings.delivery_timeout_ms / 1000.0)
                return True
            except KafkaException as exc:
                error = exc.args[0]
                self._retry_or_raise(error, exc)
                if error.txn_requires_abort() or not error.retriable():
                    return False
                backoff = self._pause(backoff)

    def _retry_or_raise(self, error: KafkaError, exc: BaseException) -> None:
        """Raise ``KafkaWalError`` for an error no retry cures (fenced, fatal, or any while the
        region closes and Kafka has been away for ``CLOSE_WAIT``); otherwise note the stall."""
        if error.code() in _FENCED or error.fatal():
            # Never a new producer here: its init_transactions would fence whoever took the
            # region over, and commit what they did not see.
            why = (
                "fenced: another process took the region"
                if error.code() in _FENCED
                else "a fatal producer error"
            )
            raise KafkaWalError(
                f"Kafka refused the WAL's appends to {self.topics.data} for good ({why}): {error}"
            ) from exc
        if self._stalled_since is None:
            self._stalled_since = time.monotonic()
        if self._stopping and self._close_deadline_passed():
            raise KafkaWalError(
                f"Kafka did not commit the WAL's appends to {self.topics.data} before the "
                f"region was closed: {error}"
            ) from exc
        log.warning("kafka wal commit retried topic=%s error=%s", self.topics.data, error)

    @staticmethod
    def _pause(backoff: float) -> float:
        time.sleep(backoff)
        return min(backoff * 2, MAX_BACKOFF)

    def _abort(self, producer: Producer) -> None:
        """End ``producer``'s failed transaction, retrying while Kafka is away (no transaction
        under way is fine)."""
        backoff = RETRY_BACKOFF
        while True:
            try:
                producer.abort_transaction(self._settings.delivery_timeout_ms / 1000.0)
                return
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() == KafkaError._STATE:
                    return  # no transaction was begun
                self._retry_or_raise(error, exc)
                backoff = self._pause(backoff)

    def _close_deadline_passed(self) -> bool:
        since = self._stalled_since
        return since is not None and time.monotonic() - since > CLOSE_WAIT

    def refusal(self) -> str | None:
        """Why new appends are refused now (the commit under way began ``delivery_timeout_ms``
        ago or more: Kafka has committed nothing since), or None."""
        since = self._commit_started
        if since is None:
            return None
        waited = time.monotonic() - since
        if waited * 1000 < self._settings.delivery_timeout_ms:
            return None
        return (
            f"Kafka has committed none of the WAL's appends for {waited:.0f} s "
            f"({self.topics.data}); appends are refused until it does"
        )

    @staticmethod
    def _produce(
        producer: Producer,
        topic: str,
        value: bytes,
        key: bytes,
        headers: list[tuple[str, str | bytes | None]] | None,
        callback: Callable[[KafkaError | None, Message], None],
    ) -> None:
        while True:
            try:
                producer.produce(
                    topic, value, key, partition=0, headers=headers, on_delivery=callback
                )
                return
            except BufferError:  # librdkafka's queue is full: let it send some
                producer.poll(0.05)

    # -- reading, deleting, snapshots --------------------------------------------------------

    async def read(self, seq: int, start: int, size: int) -> bytes:
        return await self._reads.read(seq, start, size)

    def delete(self, seq: int) -> asyncio.Future[None]:
        self._reads.forget(seq)
        segment_path(self._dir, seq).unlink(missing_ok=True)
        # Kafka keeps the records until a snapshot records that the segment is gone.
        self._kept_from = max(self._kept_from, seq + 1)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def removed(self) -> None:
        return None

    async def snapshot(self, snapshot: Snapshot) -> None:
        kept_from = self._kept_from
        waiter: Future[None] = Future()
        meta = (snapshot.to_bytes(), kept_from, waiter)
        with self._cond:
            if self._failure is not None:
                raise OSError(f"the Kafka WAL failed: {self._failure}")
            writing = not self._stopping
            if writing:
                self._metas.append(meta)
                self._cond.notify()
        try:
            if writing:
                await asyncio.wrap_future(waiter)
            else:  # closing: once the writer is gone, the final snapshot is committed here
                if self._thread is not None:
                    await asyncio.to_thread(self._thread.join)
                await asyncio.to_thread(self._commit, [], [meta])
        except Exception as exc:
            raise OSError(f"the region snapshot was not stored in Kafka: {exc}") from exc
        # Also in the cache, so that its parser starts where the snapshot does.
        await asyncio.to_thread(self._cache_snapshot, meta[0])
        await self._trim(kept_from)

    def _cache_snapshot(self, data: bytes) -> None:
        with self._snapshot_lock:  # two snapshots may be recorded at once
            write_atomic(self._dir / SNAPSHOT_NAME, data)

    async def _trim(self, kept_from: int) -> None:
        """DeleteRecords below segment ``kept_from``, now that a committed snapshot says it
        is the lowest one kept."""
        if kept_from <= self._trimmed_from:
            return
        offset = self._first_offset.get(kept_from)
        if offset is None:
            return  # not written yet: the next snapshot trims
        try:
            await asyncio.to_thread(delete_below, self._settings, self.topics.data, offset)
        except KafkaWalError as exc:
            log.warning("kafka wal records kept for now error=%s", exc)
            return
        for seq in [s for s in self._first_offset if s < kept_from]:
            del self._first_offset[seq]
        self._trimmed_from = kept_from

    def cached_segments(self) -> list[int]:
        """The segment files in the cache (for tests)."""
        return list_segments(self._dir)

    async def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._active_fd >= 0:
            os.close(self._active_fd)
            self._active_fd = -1
        self._reads.close()
        for producer in self._producers:
            await asyncio.to_thread(producer.flush, 5.0)


class _Deliveries:
    """Delivery reports of one transaction's records: the first Kafka offset of each segment,
    and any error."""

    def __init__(self) -> None:
        self.first: dict[int, int] = {}
        self.errors: list[KafkaError] = []

    def record(self, seq: int) -> Callable[[KafkaError | None, Message], None]:
        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self.errors.append(err)
            elif seq >= 0:
                offset = msg.offset()
                if offset is not None:
                    self.first.setdefault(seq, offset)

        return delivered


_FENCED = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)
