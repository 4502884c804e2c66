"""``ProgressUpdater``: batches per-topic progress (cursors, marks) into fenced etcd writes.

Guarantees:

* ``set`` is synchronous and costs no I/O; only the newest value of each key is kept.
* A change is written within ``interval`` seconds, or as soon as ``max_pending`` distinct keys
  are waiting, whichever comes first (while etcd is reachable); a change made while a write
  is in flight waits for the next round, ``interval`` after that write began. So changes cost
  one write round per ``interval`` however often they come (not one per etcd round trip).
  After a crash, at most that window of progress is lost, which means redelivery, never loss
  of messages.
* Every write is a fenced transaction of the topic (``Ownership.fenced``): a broker that lost
  the topic never overwrites its new owner's progress. Its pending values are dropped then (the
  loss is reported through ``Ownership.on_lost``).
* Writes are serialized, so a key's stored value never goes back to an older one.
* A write that fails for another reason (etcd unreachable, outcome unknown) is retried with the
  newest value after another ``interval``; rewriting a value is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from danube_ingest.aio import wait_event
from danube_ingest.metadata.errors import FencedError, MetadataError
from danube_ingest.metadata.kv import Put
from danube_ingest.metadata.ownership import Ownership

log = logging.getLogger(__name__)

#: Puts per transaction, below etcd's default limit of 128 ops per transaction.
_OPS_PER_TXN = 100


class ProgressUpdater:
    """Batched, fenced progress writes for the topics of one ``Ownership``. One event loop."""

    def __init__(
        self, ownership: Ownership, *, interval: float = 1.0, max_pending: int = 1000
    ) -> None:
        if interval <= 0 or max_pending < 1:
            raise MetadataError(
                f"progress interval must be > 0 and max_pending >= 1, got {interval}, {max_pending}"
            )
        self._ownership = ownership
        self._interval = interval
        self._max_pending = max_pending
        self._pending: dict[str, dict[str, bytes]] = {}
        self._count = 0
        self._in_flight = 0
        self._first_at: float | None = None
        self._wake = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        ownership.on_lost(self._drop)

    @property
    def pending(self) -> int:
        """How many values are waiting to be written (queued or being written)."""
        return self._count + self._in_flight

    def set(self, topic: str, key: str, value: bytes) -> None:
        """Remember ``value`` as the newest value of ``key``, a key of ``topic``'s progress.

        Must be called from the event loop. Raises ``MetadataError`` after :meth:`close`.
        """
        if self._closed:
            raise MetadataError(f"progress updater is closed: cannot set {key}")
        values = self._pending.setdefault(topic, {})
        if key not in values:
            self._count += 1
        values[key] = value
        if self._first_at is None:
            self._first_at = time.monotonic()
            self._wake.set()
        if self._count >= self._max_pending:
            self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="progress-updater"
            )

    async def flush(self, topic: str | None = None) -> None:
        """Write every pending value now (only ``topic``'s if given).

        Values of topics this broker no longer owns are dropped. Raises the first other
        ``MetadataError``; the values it concerns stay pending.
        """
        async with self._write_lock:
            started = time.monotonic()
            topics = list(self._pending) if topic is None else [topic]
            errors: list[MetadataError] = []
            for name in topics:
                values = self._pending.pop(name, None)
                if not values:
                    continue
                self._count -= len(values)
                self._in_flight += len(values)
                try:
                    await self._write(name, values)
                except FencedError as exc:
                    log.warning("progress dropped topic=%s keys=%s: %s", name, len(values), exc)
                except MetadataError as exc:
                    self._requeue(name, values)
                    errors.append(exc)
                finally:
                    self._in_flight -= len(values)
            if not self._pending:
                self._first_at = None
            elif errors:
                self._first_at = time.monotonic()
            elif topic is None or self._first_at is None:
                # What is pending was set while this flush wrote: due an interval after it
                # began (keeping the old due time wrote back to back under steady acks).
                self._first_at = started
            if errors:
                raise errors[0]

    async def close(self) -> None:
        """Stop the background task and flush what is pending. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _write(self, topic: str, values: dict[str, bytes]) -> None:
        items = list(values.items())
        for start in range(0, len(items), _OPS_PER_TXN):
            chunk = items[start : start + _OPS_PER_TXN]
            await self._ownership.fenced(topic, [Put(key, value) for key, value in chunk])

    def _requeue(self, topic: str, values: dict[str, bytes]) -> None:
        current = self._pending.setdefault(topic, {})
        for key, value in values.items():
            if key not in current:  # a newer value set meanwhile wins
                current[key] = value
                self._count += 1

    def _drop(self, topic: str) -> None:
        values = self._pending.pop(topic, None)
        if values:
            self._count -= len(values)
            log.warning("progress dropped topic=%s keys=%s: ownership lost", topic, len(values))

    async def _run(self) -> None:
        # Not ``while True``: Python 3.11's ``asyncio.wait_for`` swallows a cancel that comes as
        # the wait completes (cpython gh-86296); ``close`` sets ``_closed`` first.
        while not self._closed:
            if self._first_at is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            due = self._first_at + self._interval - time.monotonic()
            if self._count < self._max_pending and due > 0:
                self._wake.clear()
                await wait_event(self._wake, due)
                continue
            try:
                await self.flush()
            except MetadataError as exc:
                log.warning("progress flush failed, retrying error=%s", exc)
                await asyncio.sleep(self._interval)
