"""The key-value contract the metadata layer is written against, and ``MemoryKV``.

The model is etcd v3's, so ``EtcdKV`` maps onto it one to one:

* Keys are ``str`` (UTF-8 on the wire), values are ``bytes``. Every write bumps one global
  ``revision``; all writes of one transaction share a revision. A key records the revision that
  created it (``create_revision``), the one that last changed it (``mod_revision``) and how often
  it was written since it was created (``version``). An absent key has all three equal to 0.
* ``txn(compares, success, failure)`` is atomic and serializable: if every compare holds, the
  ``success`` ops run, else the ``failure`` ops, as one step no other client can interleave with.
  Ops run in order, so a ``Get`` sees the ``Put`` before it. One transaction may not put the
  same key twice, nor put a key it also deletes.
* A ``"value"`` compare on an absent key is always false, whatever the operator (etcd cannot
  tell a missing value from an empty one). Compare ``"create" == 0`` to test for absence.
* Leases: keys put with a lease are deleted, in one revision, when the lease expires (nobody
  refreshed it for ``ttl`` seconds) or is revoked. Putting under a dead lease raises
  ``LeaseExpiredError`` and writes nothing.
* ``watch_prefix`` returns once the watch is registered: it then yields every later change
  below the prefix, in revision order (and op order within a revision), exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, Self

from danube_ingest.metadata.errors import (
    LeaseExpiredError,
    MetadataError,
    RevisionCompactedError,
)

Target = Literal["value", "version", "create", "mod"]
CompareOp = Literal["==", "!=", "<", ">"]
EventKind = Literal["put", "delete"]


class KeyValue(NamedTuple):
    """A key as stored, with its revisions."""

    key: str
    """The full key, prefix included."""
    value: bytes
    """The stored bytes (empty in a delete event)."""
    create_revision: int
    """Revision of the write that created the key (0 in a delete event)."""
    mod_revision: int
    """Revision of the last write to the key; in a delete event, the deletion's revision."""
    version: int
    """Number of writes since the key was created: 1 right after creation."""
    lease: int | None
    """The lease the key is attached to, ``None`` if none."""


class Compare(NamedTuple):
    """One condition of a transaction: ``target(key) op value``.

    ``value`` is ``bytes`` for the ``"value"`` target and an ``int`` for the others.
    """

    key: str
    """The key whose state is compared."""
    target: Target
    """What is compared: the value, the version, the create or the mod revision."""
    op: CompareOp
    """How it is compared."""
    value: bytes | int
    """What it is compared with."""

    @classmethod
    def absent(cls, key: str) -> Compare:
        """Holds when ``key`` does not exist."""
        return cls(key, "create", "==", 0)

    @classmethod
    def value_is(cls, key: str, value: bytes) -> Compare:
        """Holds when ``key`` exists and holds exactly ``value``."""
        return cls(key, "value", "==", value)

    @classmethod
    def unchanged(cls, key: str, seen: KeyValue | None) -> Compare:
        """Holds when ``key`` is as it was read (``seen``; ``None``: absent when read)."""
        return cls(key, "mod", "==", 0 if seen is None else seen.mod_revision)


class Put(NamedTuple):
    """Write ``value`` under ``key``, attached to ``lease`` if given."""

    key: str
    value: bytes
    lease: int | None = None


class Delete(NamedTuple):
    """Delete ``key``, or every key starting with ``key`` when ``prefix`` is set."""

    key: str
    prefix: bool = False


class Get(NamedTuple):
    """Read ``key``, or every key starting with ``key`` (in key order) when ``prefix`` is set."""

    key: str
    prefix: bool = False


TxnOp = Put | Delete | Get


class OpResult(NamedTuple):
    """What one op of a transaction returned."""

    kvs: tuple[KeyValue, ...] = ()
    """The keys a ``Get`` found, in key order (empty for ``Put`` and ``Delete``)."""
    deleted: int = 0
    """How many keys a ``Delete`` removed (0 for ``Put`` and ``Get``)."""


class TxnResult(NamedTuple):
    """The outcome of a transaction."""

    succeeded: bool
    """Whether every compare held (so the ``success`` ops ran, else the ``failure`` ops)."""
    responses: tuple[OpResult, ...]
    """One result per op that ran, in op order."""

    def kv(self, index: int) -> KeyValue | None:
        """The first key found by the ``Get`` at ``index``, ``None`` if it found nothing."""
        kvs = self.responses[index].kvs
        return kvs[0] if kvs else None


class WatchEvent(NamedTuple):
    """One change seen by a watch."""

    kind: EventKind
    """``"put"`` (created or updated) or ``"delete"`` (deleted, also by lease expiry)."""
    kv: KeyValue
    """The key after a put; after a delete, the key with ``mod_revision`` = the deletion's."""


class WatchStream(AsyncIterator[WatchEvent]):
    """Changes below a prefix, as an async iterator; ``cancel()`` (or ``async with``) ends it.

    Iteration stops (``StopAsyncIteration``) once cancelled or when the store is closed; it
    raises ``MetadataUnavailableError`` if the store's connection is lost (re-read, then watch
    again from the revision of that read).
    """

    def __aiter__(self) -> Self:
        return self

    @abstractmethod
    async def __anext__(self) -> WatchEvent:
        """The next change, in revision order."""

    @abstractmethod
    async def cancel(self) -> None:
        """Stop the watch. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cancel()


class KV(Protocol):
    """The metadata store: etcd (``EtcdKV``) or in memory (``MemoryKV``).

    Both implementations pass the same contract suite (``tests/metadata/test_kv_contract.py``).
    Errors: ``MetadataUnavailableError`` when the store does not answer, ``CommitStateUnknownError``
    when a write's outcome is unknown, ``LeaseExpiredError`` for a dead lease.
    """

    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` if it does not exist. Linearizable."""
        ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key starting with ``prefix``, in key order, read at one revision."""
        ...

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Write one key; returns the revision of the write."""
        ...

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete one key (or a prefix) in one revision; returns how many keys were deleted."""
        ...

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Run ``success`` if every compare holds, else ``failure``, atomically."""
        ...

    async def grant_lease(self, ttl: int) -> int:
        """A new lease that expires ``ttl`` seconds from now unless refreshed; returns its id."""
        ...

    async def refresh_lease(self, lease_id: int) -> int:
        """Restart the lease's countdown; returns its TTL. ``LeaseExpiredError`` if it is gone."""
        ...

    async def revoke_lease(self, lease_id: int) -> None:
        """End the lease now, deleting its keys. A lease that is already gone is ignored."""
        ...

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> WatchStream:
        """Watch every key starting with ``prefix``.

        Returns once the watch is registered. With ``start_revision``, first replays every
        change since that revision (``RevisionCompactedError`` if it is no longer kept).
        """
        ...

    async def compact(self, revision: int) -> None:
        """Drop the history of changes before ``revision`` (etcd's ``compact``): a watch from
        an older revision then raises ``RevisionCompactedError``; current values are kept.
        ``RevisionCompactedError`` if history was already compacted at or past ``revision``,
        ``MetadataError`` if ``revision`` is in the future."""
        ...

    async def db_size(self) -> int | None:
        """The store's database size in bytes, ``None`` where it has none (in memory)."""
        ...

    async def identity(self, key: str) -> str:
        """Which store this is, the same for its whole life and different for another:
        ``etcd cluster <hex id>`` for etcd (whatever endpoint answers), ``memory`` for a
        store in memory (each one is gone with its process). ``key``: a key the caller may
        read (it is read, and need not exist)."""
        ...

    async def close(self) -> None:
        """Release connections and end every watch. Idempotent."""
        ...


def check_compare(compare: Compare) -> None:
    """Raise ``MetadataError`` unless ``compare`` is well formed (shared by both stores)."""
    if compare.op not in ("==", "!=", "<", ">"):
        raise MetadataError(f"compare on {compare.key}: unknown operator {compare.op!r}")
    if compare.target == "value":
        if not isinstance(compare.value, bytes):
            raise MetadataError(f"compare on {compare.key}: a value compare needs bytes")
    elif compare.target in ("version", "create", "mod"):
        if not isinstance(compare.value, int):
            raise MetadataError(f"compare on {compare.key}: a {compare.target} compare needs int")
    else:
        raise MetadataError(f"compare on {compare.key}: unknown target {compare.target!r}")


def _holds(actual: bytes | int, op: CompareOp, expected: bytes | int) -> bool:
    if op == "==":
        return actual == expected
    if op == "!=":
        return actual != expected
    if isinstance(actual, bytes) and isinstance(expected, bytes):
        return actual < expected if op == "<" else actual > expected
    if isinstance(actual, int) and isinstance(expected, int):
        return actual < expected if op == "<" else actual > expected
    return False


class _MemoryWatch(WatchStream):
    def __init__(self, owner: MemoryKV, prefix: str) -> None:
        self.prefix = prefix
        self._owner = owner
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._ended = False

    def push(self, event: WatchEvent) -> None:
        if not self._ended:
            self._queue.put_nowait(event)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._queue.put_nowait(None)

    async def __anext__(self) -> WatchEvent:
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # later calls end too
            raise StopAsyncIteration
        return event

    async def cancel(self) -> None:
        self._owner._watches.discard(self)
        self.end()


@dataclass
class _Lease:
    ttl: int
    timer: asyncio.TimerHandle
    keys: set[str] = field(default_factory=set)


class MemoryKV:
    """An in-memory ``KV`` with etcd's semantics, for tests and single-process development.

    Leases expire on the running event loop's clock. Watches can replay the last ``history``
    events; older start revisions raise ``RevisionCompactedError``. Use from one event loop.
    """

    def __init__(self, *, history: int = 10_000) -> None:
        self._data: dict[str, KeyValue] = {}
        # etcd's revision starts at 1 on an empty store; the first write makes it 2.
        self._revision = 1
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x6A00_0001)
        self._watches: set[_MemoryWatch] = set()
        self._history: deque[tuple[int, WatchEvent]] = deque(maxlen=history)
        self._compacted_through = 0
        self._compact_revision = 0
        self._closed = False

    async def get(self, key: str) -> KeyValue | None:
        """See ``KV.get``."""
        self._check_open()
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """See ``KV.get_prefix``."""
        self._check_open()
        return [self._data[k] for k in self._matching(prefix, True)]

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """See ``KV.put``."""
        await self.txn([], [Put(key, value, lease)])
        return self._revision

    async def delete(self, key: str, *, prefix: bool = False) -> int:
        """See ``KV.delete``."""
        result = await self.txn([], [Delete(key, prefix)])
        return result.responses[0].deleted

    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[TxnOp],
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """See ``KV.txn``."""
        self._check_open()
        for compare in compares:
            check_compare(compare)
        succeeded = all(self._evaluate(c) for c in compares)
        ops = success if succeeded else failure
        self._check_ops(ops)
        return TxnResult(succeeded, self._execute(ops))

    async def grant_lease(self, ttl: int) -> int:
        """See ``KV.grant_lease``."""
        self._check_open()
        if ttl < 1:
            raise MetadataError(f"lease TTL must be at least 1 second, got {ttl}")
        lease_id = next(self._lease_ids)
        timer = asyncio.get_running_loop().call_later(ttl, self._end_lease, lease_id)
        self._leases[lease_id] = _Lease(ttl, timer)
        return lease_id

    async def refresh_lease(self, lease_id: int) -> int:
        """See ``KV.refresh_lease``."""
        self._check_open()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpiredError(f"lease {lease_id:x} has expired or was revoked")
        lease.timer.cancel()
        lease.timer = asyncio.get_running_loop().call_later(lease.ttl, self._end_lease, lease_id)
        return lease.ttl

    async def revoke_lease(self, lease_id: int) -> None:
        """See ``KV.revoke_lease``."""
        self._check_open()
        self._end_lease(lease_id)

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> WatchStream:
        """See ``KV.watch_prefix``."""
        self._check_open()
        watch = _MemoryWatch(self, prefix)
        if start_revision is not None:
            if start_revision <= self._compacted_through:
                raise RevisionCompactedError(
                    f"cannot watch {prefix} from revision {start_revision}: history starts at "
                    f"{self._compacted_through + 1}",
                    self._compacted_through + 1,
                )
            for revision, event in self._history:
                if revision >= start_revision and event.kv.key.startswith(prefix):
                    watch.push(event)
        self._watches.add(watch)
        return watch

    async def compact(self, revision: int) -> None:
        """See ``KV.compact``."""
        self._check_open()
        if revision <= self._compact_revision:
            raise RevisionCompactedError(
                f"cannot compact at revision {revision}: already compacted at "
                f"{self._compact_revision}",
                self._compact_revision,
            )
        if revision > self._revision:
            raise MetadataError(
                f"cannot compact at revision {revision}: the store is at {self._revision}"
            )
        self._compact_revision = revision
        self._compacted_through = max(self._compacted_through, revision - 1)
        while self._history and self._history[0][0] < revision:
            self._history.popleft()

    async def db_size(self) -> int | None:
        """See ``KV.db_size``: ``None``, nothing is on disk."""
        self._check_open()
        return None

    async def identity(self, key: str) -> str:
        """See ``KV.identity``: ``memory``."""
        self._check_open()
        return "memory"

    async def close(self) -> None:
        """See ``KV.close``."""
        if self._closed:
            return
        self._closed = True
        for lease in self._leases.values():
            lease.timer.cancel()
        self._leases.clear()
        for watch in self._watches:
            watch.end()
        self._watches.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise MetadataError("the in-memory metadata store is closed")

    def _matching(self, key: str, prefix: bool) -> list[str]:
        if not prefix:
            return [key] if key in self._data else []
        return sorted(k for k in self._data if k.startswith(key))

    def _evaluate(self, compare: Compare) -> bool:
        current = self._data.get(compare.key)
        if compare.target == "value":
            return current is not None and _holds(current.value, compare.op, compare.value)
        if current is None:
            actual = 0
        elif compare.target == "version":
            actual = current.version
        elif compare.target == "create":
            actual = current.create_revision
        else:
            actual = current.mod_revision
        return _holds(actual, compare.op, compare.value)

    def _check_ops(self, ops: Sequence[TxnOp]) -> None:
        puts: set[str] = set()
        for op in ops:
            if isinstance(op, Put):
                if op.key in puts:
                    raise MetadataError(f"transaction puts {op.key} twice")
                puts.add(op.key)
                if op.lease is not None and op.lease not in self._leases:
                    raise LeaseExpiredError(
                        f"cannot put {op.key}: lease {op.lease:x} has expired or was revoked"
                    )
        for op in ops:
            if isinstance(op, Delete):
                hit = [k for k in puts if (k.startswith(op.key) if op.prefix else k == op.key)]
                if hit:
                    raise MetadataError(f"transaction both puts and deletes {hit[0]}")

    def _execute(self, ops: Sequence[TxnOp]) -> tuple[OpResult, ...]:
        revision = self._revision + 1
        events: list[WatchEvent] = []
        results: list[OpResult] = []
        for op in ops:
            if isinstance(op, Get):
                kvs = tuple(self._data[k] for k in self._matching(op.key, op.prefix))
                results.append(OpResult(kvs=kvs))
            elif isinstance(op, Put):
                events.append(self._put(op, revision))
                results.append(OpResult())
            else:
                removed = [self._remove(k, revision) for k in self._matching(op.key, op.prefix)]
                events.extend(removed)
                results.append(OpResult(deleted=len(removed)))
        if events:
            self._commit(revision, events)
        return tuple(results)

    def _put(self, op: Put, revision: int) -> WatchEvent:
        previous = self._data.get(op.key)
        if previous is not None and previous.lease in self._leases:
            self._leases[previous.lease].keys.discard(op.key)
        if op.lease is not None:
            self._leases[op.lease].keys.add(op.key)
        kv = KeyValue(
            key=op.key,
            value=bytes(op.value),
            create_revision=revision if previous is None else previous.create_revision,
            mod_revision=revision,
            version=1 if previous is None else previous.version + 1,
            lease=op.lease,
        )
        self._data[op.key] = kv
        return WatchEvent("put", kv)

    def _remove(self, key: str, revision: int) -> WatchEvent:
        previous = self._data.pop(key)
        if previous.lease in self._leases:
            self._leases[previous.lease].keys.discard(key)
        return WatchEvent("delete", KeyValue(key, b"", 0, revision, 0, None))

    def _commit(self, revision: int, events: list[WatchEvent]) -> None:
        self._revision = revision
        for event in events:
            if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
                self._compacted_through = self._history[0][0]
            self._history.append((revision, event))
            for watch in self._watches:
                if event.kv.key.startswith(watch.prefix):
                    watch.push(event)

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None or self._closed:
            return
        lease.timer.cancel()
        revision = self._revision + 1
        events = [self._remove(k, revision) for k in sorted(lease.keys) if k in self._data]
        if events:
            self._commit(revision, events)
