"""FileBackend: a region's segment files, written by one thread with group commit.

The sequencer hands over chunks (:mod:`danube_ingest.wal.backend`); one writer thread takes
every chunk queued, issues one write (``writev``) and one ``fdatasync`` for all of them, and
reports them durable to the event loop with one wake-up. While small chunks stream in quickly
it waits up to ``linger`` for more to share the sync (a lone append never waits; see
``FileBackend._linger_for_more``), and always lingers ``fsync_interval`` if that is set. A
chunk that starts a new segment syncs and closes the active file first (the seal); the next
segment's file is created ahead in the background, its blocks reserved while
``min_free_bytes`` stay free. A failed write or fdatasync cuts the active segment back to what
was acknowledged, fails every pending chunk and every later one: the log must be reopened,
which runs recovery (:mod:`danube_ingest.wal.recovery`) against what really is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from danube_ingest.observability.metrics import WAL_FSYNC_SECONDS
from danube_ingest.wal.backend import Chunk, FsyncMode, LogSink, chunk_bytes, observe_group
from danube_ingest.wal.local.files import (
    SegmentReads,
    precreate_segment,
    remove_segments,
    spare_seq,
)
from danube_ingest.wal.meta import Snapshot, fsync_dir, write_snapshot
from danube_ingest.wal.recovery import RegionState, recover_region
from danube_ingest.wal.segment import segment_path
from danube_ingest.wal.space import DiskFree, disk_free
from danube_ingest.wal.synclog import open_sync_log

log = logging.getLogger(__name__)

#: Adaptive linger (``linger_us``): the writer waits for more chunks only while the group it
#: is about to write is smaller than this (a bigger write amortises its fdatasync already) ...
LINGER_TARGET_BYTES = 64 * 1024
#: ... and only while chunks arrive at least this many times faster than the linger lasts.
LINGER_MIN_ARRIVALS = 2
#: Weight of the newest gap between two handed-over chunks in their moving average.
_GAP_WEIGHT = 0.25
#: Gaps are counted as at most this long (seconds), so the average recovers quickly from idleness.
_GAP_CAP = 0.1
#: Least time (seconds) the lingering writer sleeps between two looks at the queue, so that a
#: tiny average gap cannot turn the wait into a busy loop.
_QUIET_FLOOR = 50e-6
#: Fewer iovecs than this are written with writev (no copy); more are joined first, which is
#: cheaper than many tiny iovecs and keeps under IOV_MAX.
_WRITEV_MAX_PIECES = 64


class FileBackend:
    """Segment files written by one thread: one write and one fdatasync per group of chunks."""

    def __init__(
        self,
        region_dir: Path,
        *,
        fsync: FsyncMode,
        fsync_interval: float,
        max_batch_bytes: int,
        reserve_bytes: int = 0,
        linger: float = 0.0,
        min_free_bytes: int = 0,
        free_space: DiskFree = disk_free,
    ) -> None:
        self._dir = region_dir
        self._reserve = reserve_bytes
        self._min_free = min_free_bytes
        self._free_space = free_space
        self._fsync = fsync == "always"
        self._interval = fsync_interval
        self._linger = linger
        # Moving average of the time between two chunks handed over (seconds), and when the
        # last one was: how soon the next one is likely (see ``_linger_for_more``).
        self._gap = _GAP_CAP
        self._last_submit = 0.0
        # Chunks handed over while the writer wrote and synced a group (before it announced
        # the group durable): their appenders did not wait for that sync.
        self._in_io = False
        self._arrived_during_io = 0
        self._max_batch = max_batch_bytes
        self._queue: deque[Chunk] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._failure: BaseException | None = None
        self._fd = -1
        self._active = -1
        self._active_size = 0
        # Bytes of the active segment announced durable (synced, or written with fsync
        # "never"): what a failed write or fdatasync cuts the segment back to.
        self._acked_size = 0
        self._thread: threading.Thread | None = None
        self._log: LogSink | None = None
        self._snapshot_lock = threading.Lock()
        self._reads = SegmentReads(region_dir)
        #: Segment removals under way in worker threads (delete()).
        self._removals: set[asyncio.Future[None]] = set()
        #: Deleted segments whose file is not known to be removed yet.
        self._unremoved: set[int] = set()
        self._spare: Future[int | None] | None = None
        #: One thread that creates the next segment ahead and removes deleted ones.
        self._file_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wal-files")
        # Fault tests only (DANUBE_TEST_SYNC_LOG): the synced length of each segment.
        self._sync_log = open_sync_log()

    async def recover(self, index_interval: int) -> RegionState:
        """Recover the region directory (created if missing) in a worker thread."""
        self._dir.mkdir(parents=True, exist_ok=True)
        return await asyncio.to_thread(recover_region, self._dir, index_interval)

    def start(self, sink: LogSink) -> None:
        self._log = sink
        self._thread = threading.Thread(
            target=self._run, name=f"wal-writer-{sink.region}", daemon=True
        )
        self._thread.start()

    def submit(self, chunk: Chunk) -> None:
        with self._cond:
            failure = self._failure
            if failure is None:
                self._queue.append(chunk)
                if len(self._queue) == 1:
                    self._cond.notify()
                if self._linger > 0:  # what _linger_for_more decides by
                    if self._in_io:
                        self._arrived_during_io += 1
                    now = time.monotonic()
                    gap = now - self._last_submit
                    self._last_submit = now
                    self._gap += ((gap if gap < _GAP_CAP else _GAP_CAP) - self._gap) * _GAP_WEIGHT
        if failure is not None:
            assert self._log is not None
            self._log.chunks_failed(failure, [chunk])

    def _take(self) -> list[Chunk] | None:
        """Wait for chunks; return a group that fits ``max_batch_bytes`` (at least one)."""
        with self._cond:
            # Chunks arrived while the previous group was written and synced (the count stops
            # when _run announces it), from appenders that did not wait for it: more are likely
            # to follow (see ``_linger_for_more``).
            streaming = self._arrived_during_io > 0
            while not self._queue:
                if self._stopping:
                    return None
                self._cond.wait()
            if self._interval > 0 and not self._stopping:
                deadline = time.monotonic() + self._interval
                while not self._stopping:
                    pending = sum(chunk_bytes(c) for c in self._queue)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or pending >= self._max_batch:
                        break
                    self._cond.wait(remaining)
            elif streaming and self._linger > 0 and not self._stopping:
                self._linger_for_more()
            queue = self._queue
            size = chunk_bytes(queue[0])  # before popping: a chunk is never only held here
            group = [queue.popleft()]
            while queue and queue[0].rotate_to is None:
                nxt = chunk_bytes(queue[0])
                if size + nxt > self._max_batch:
                    break
                group.append(queue.popleft())
                size += nxt
            self._arrived_during_io = 0
            self._in_io = True
            return group

    def _linger_for_more(self) -> None:
        """Wait (holding ``_cond``) while more chunks are about to join a small group.

        Each write + fdatasync costs the same CPU (here ~80 µs in the kernel, plus waking this
        thread and the event loop) whether it carries one message or a hundred, so under a
        stream of small appends it pays to wait a little for the next ones. A lone append must
        not wait, though, nor appenders that each wait for the previous sync before appending
        again (they would only wait longer): the writer lingers only when chunks arrived while
        it wrote and synced the previous group (the caller checks that) and chunks have been
        arriving at least ``LINGER_MIN_ARRIVALS`` times per ``linger`` on average; it stops as
        soon as no chunk arrives within twice the average gap (the stream paused: what is in
        flight probably waits for this very sync), once the group reaches
        ``LINGER_TARGET_BYTES``, and after ``linger`` at most.
        """
        gap = self._gap
        if gap * LINGER_MIN_ARRIVALS > self._linger:
            return
        queue = self._queue
        deadline = time.monotonic() + self._linger
        quiet = max(2 * gap, _QUIET_FLOOR)
        count = len(queue)
        pending = 0
        for chunk in queue:
            pending += chunk_bytes(chunk)
        while pending < LINGER_TARGET_BYTES and not self._stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(quiet if quiet < remaining else remaining)
            if len(queue) == count:
                return
            for i in range(count, len(queue)):
                pending += chunk_bytes(queue[i])
            count = len(queue)

    def _run(self) -> None:
        """The writer thread. Should it die of anything but a failed write (which
        ``_write_loop`` handles the same way), every queued chunk fails and the log is marked
        failed: no waiter hangs, and ``close`` still returns."""
        try:
            self._write_loop()
        except BaseException as exc:
            log.exception("wal writer died")
            self._die(exc, [])
            with contextlib.suppress(Exception):
                self._close_active()

    def _die(self, exc: BaseException, group: list[Chunk]) -> None:
        """Stop taking chunks; fail ``group`` and everything queued, on the event loop."""
        wal = self._log
        assert wal is not None
        with self._cond:
            rest = list(self._queue)
            self._queue.clear()
            self._stopping = True
            self._failure = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            wal.loop.call_soon_threadsafe(wal.chunks_failed, exc, group + rest)

    def _write_loop(self) -> None:
        log = self._log
        assert log is not None
        loop = log.loop
        while True:
            group = self._take()
            if group is None:
                break
            try:
                sealed = None
                if group[0].rotate_to is not None:
                    sealed = self._open_segment(group[0].rotate_to)
                pieces: list[bytes] = []
                for chunk in group:
                    pieces.extend(chunk.pieces)
                self._write(pieces)
                if self._fsync:
                    synced = time.monotonic()
                    self._sync_active()
                    WAL_FSYNC_SECONDS.observe(time.monotonic() - synced)
            except BaseException as exc:
                self._cut_back_to_acknowledged(exc)
                self._die(exc, group)
                break
            self._acked_size = self._active_size
            observe_group(group)
            # Before the group is announced: what arrives from now on may be its own appenders'
            # next appends, which waited for it, and must not count as a stream.
            self._in_io = False
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(log.chunks_written, group, sealed)
        self._close_active()

    def _open_segment(self, seq: int) -> tuple[int, int] | None:
        """Seal the active file (sync + close) and create segment ``seq``."""
        sealed = None
        if self._fd >= 0:
            self._sync_active()
            self._close_fd()
            sealed = (self._active, self._active_size)
        path = segment_path(self._dir, seq)
        spare, self._spare = self._spare, None
        if spare is not None and spare_seq(spare) == seq:
            # Created (and its directory entry made durable) in the background already.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            # The new file's directory entry must be durable before anything in it is
            # acknowledged.
            fsync_dir(self._dir)
        self._active = seq
        self._active_size = self._acked_size = 0
        # Create the next segment now, off the commit path: a seal then costs no directory
        # fsync (about 2 ms here), which matters when large appends seal every few ms.
        self._spare = self._file_pool.submit(self._precreate_next, seq + 1)
        return sealed

    def _precreate_next(self, seq: int) -> int | None:
        """Pre-create segment ``seq``, reserving its blocks only if ``min_free_bytes`` stay
        free afterwards (a reservation must never be what fills the disk)."""
        reserve = self._reserve
        if reserve > 0 and self._min_free > 0:
            try:
                free = self._free_space(self._dir)
            except OSError:
                free = 0
            if free - reserve < self._min_free:
                log.info(
                    "wal segment blocks not reserved dir=%s seq=%d free=%d min_free_bytes=%d",
                    self._dir,
                    seq,
                    free,
                    self._min_free,
                )
                reserve = 0
        return precreate_segment(self._dir, seq, reserve)

    def _write(self, pieces: list[bytes]) -> None:
        fd = self._fd
        if len(pieces) > _WRITEV_MAX_PIECES:
            pieces = [b"".join(pieces)]
        total = 0
        for piece in pieces:
            total += len(piece)
        written = os.writev(fd, pieces)
        self._active_size += written
        if written == total:
            return
        # Short write (rare on regular files): finish the remainder piece by piece.
        view = memoryview(b"".join(pieces))[written:]
        while view:
            n = os.write(fd, view)
            self._active_size += n
            view = view[n:]

    def _cut_back_to_acknowledged(self, exc: BaseException) -> None:
        """After a failed write or fdatasync: truncate the active segment to the bytes
        already announced durable, so that no later process trusts what this group left.

        After a failed ``fdatasync`` Linux may mark the pages clean while they keep the data
        ("fsyncgate"): a restarted daemon would read the group back, and its own appends' syncs
        would not write those pages, leaving acknowledged data behind bytes that never reach
        the disk. The truncation is not synced (the log fails anyway; never retry an fsync that
        failed): a crash before it reaches the disk leaves a tail that recovery cuts as torn.
        """
        if not isinstance(exc, OSError) or self._fd < 0:
            return
        try:
            if os.fstat(self._fd).st_size > self._acked_size:
                os.ftruncate(self._fd, self._acked_size)
                log.warning(
                    "wal segment cut back after a failed write path=%s length=%d error=%s",
                    segment_path(self._dir, self._active),
                    self._acked_size,
                    exc,
                )
        except OSError as cut:
            log.error(
                "wal segment not cut back after a failed write path=%s length=%d error=%s",
                segment_path(self._dir, self._active),
                self._acked_size,
                cut,
            )

    def _release_reserve(self) -> None:
        """Free the blocks reserved past the data (a segment sealed early, by age, would
        otherwise keep a whole segment's worth of disk)."""
        if self._reserve > 0:
            with contextlib.suppress(OSError):
                # To its own size (not a byte less, whatever the bookkeeping says).
                os.ftruncate(self._fd, os.fstat(self._fd).st_size)

    def _sync_active(self) -> None:
        """fdatasync the active segment, and record it in the sync log (tests) once done."""
        os.fdatasync(self._fd)
        if self._sync_log is not None:
            self._sync_log.synced(segment_path(self._dir, self._active), self._active_size)

    def _close_fd(self) -> None:
        """Close the active segment's file, giving its unused reserved blocks back first."""
        self._release_reserve()
        os.close(self._fd)
        self._fd = -1

    def _close_active(self) -> None:
        if self._fd >= 0:
            if self._failure is None:  # never again after a failure (see _cut_back_...)
                with contextlib.suppress(OSError):
                    self._sync_active()
            self._close_fd()
        if self._sync_log is not None:
            self._sync_log.close()
            self._sync_log = None
        spare, self._spare = self._spare, None
        if spare is not None:
            seq = spare_seq(spare)
            if seq is not None:
                # Never written: remove it (recovery would remove an empty newest one too).
                with contextlib.suppress(OSError):
                    remove_segments(self._dir, [seq])
        self._file_pool.shutdown(wait=True)

    async def read(self, seq: int, start: int, size: int) -> bytes:
        return await self._reads.read(seq, start, size)

    def delete(self, seq: int) -> asyncio.Future[None]:
        self._reads.forget(seq)
        # Unlinking frees the file's blocks and the directory sync waits for a journal commit:
        # milliseconds each, a segment at a time under full load, so not on the event loop
        # (nor in the default executor, where it would queue behind reads). close() waits for
        # it, so no removal outlives the log (nor its data-dir lock), and so does a snapshot
        # (removed()). A removal that failed is tried again with the next one.
        self._unremoved.add(seq)
        seqs = sorted(self._unremoved)
        removal = asyncio.get_running_loop().run_in_executor(
            self._file_pool, remove_segments, self._dir, seqs
        )
        self._removals.add(removal)

        def done(removal: asyncio.Future[None]) -> None:
            self._removals.discard(removal)
            if not removal.cancelled() and removal.exception() is None:
                self._unremoved.difference_update(seqs)

        removal.add_done_callback(done)
        # Shielded: a caller that stops waiting does not make close() forget the removal.
        return asyncio.shield(removal)

    async def removed(self) -> None:
        if self._removals:
            await asyncio.wait(list(self._removals))

    async def snapshot(self, snapshot: Snapshot) -> None:
        region_dir = self._dir

        def write() -> None:
            with self._snapshot_lock:
                write_snapshot(region_dir, snapshot)

        # A snapshot that no longer lists a deleted segment must not be durable before the
        # segment's removal is: a restart would find its file with nothing pointing into it.
        await self.removed()
        await asyncio.to_thread(write)

    async def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await self.removed()
        self._reads.close()
