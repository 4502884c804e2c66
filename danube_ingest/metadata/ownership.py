"""``Ownership``: which broker serves a topic, with epochs and fencing.

A topic's owner key ``topics/{ns}/{topic}/owner`` = ``{broker, url, epoch}`` lives under the
owner's session lease, so it disappears when that broker dies or is partitioned away for a TTL.
``topics/{ns}/{topic}/epoch`` (no lease) remembers the last epoch handed out.

Guarantees:

* ``acquire`` takes a free topic in one transaction that checks the owner key is absent and the
  epoch key is unchanged, and writes the owner key and epoch + 1 together: every acquisition
  gets a fresh epoch, and no two brokers ever hold the same epoch of a topic.
* ``fenced`` writes only while the owner key still holds exactly this broker's value (which
  includes the epoch). A broker that lost the topic, even one that has not noticed yet (paused,
  partitioned), cannot write: etcd rejects the transaction and ``FencedError`` is raised. This,
  not the lease or the watch, is what prevents split brain; etcd locks alone do not (Jepsen,
  etcd 3.4.3). ``fenced_many`` makes the same check for several topics in one transaction
  (one manifest commit per sealed segment covers many topics).
* Loss is reported once per acquisition through ``on_lost(topic)``: when a fenced write is
  rejected, when a watch sees the owner key change or vanish, or when the broker session is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import (
    FencedError,
    LeaseExpiredError,
    MetadataError,
    TopicDeletedError,
)
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import (
    KV,
    Compare,
    Delete,
    Get,
    KeyValue,
    OpResult,
    Put,
    TxnOp,
    TxnResult,
    WatchEvent,
    WatchStream,
)
from danube_ingest.metadata.session import BrokerSession

log = logging.getLogger(__name__)

TopicLostCallback = Callable[[str], None]

#: Acquisition gives up after this many conflicting transactions in a row (each conflict means
#: another broker changed the topic's owner or epoch in between: heavy contention).
_ACQUIRE_ATTEMPTS = 8
#: Delay before re-establishing a broken ownership watch.
_WATCH_RETRY_SECONDS = 0.5


class FencedManyResult(NamedTuple):
    """The outcome of ``Ownership.fenced_many``."""

    succeeded: bool
    """Whether every topic was still owned and every compare held, so the ops ran."""
    fenced: tuple[str, ...]
    """Topics this broker does not own (any more); when not empty, nothing was written."""
    responses: tuple[OpResult, ...]
    """The ops' results on success, the ``failure`` ops' results when the transaction failed,
    empty when no transaction was sent."""

    def kv(self, index: int) -> KeyValue | None:
        """The first key found by the ``Get`` at ``index``, ``None`` if it found nothing."""
        kvs = self.responses[index].kvs
        return kvs[0] if kvs else None


class Owner(NamedTuple):
    """Who owns a topic, stored as the owner key's JSON value."""

    broker_id: str
    """The owning broker's id."""
    url: str
    """Where clients reach the owner (its advertised URL)."""
    epoch: int
    """The acquisition's epoch: increases by one with every acquisition of the topic."""

    def encode(self) -> bytes:
        """The owner key's value."""
        return json.dumps({"broker": self.broker_id, "url": self.url, "epoch": self.epoch}).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> Owner:
        """Parse an owner key's value; ``MetadataError`` naming ``key`` if it is malformed."""
        try:
            raw = values.loads(data)
            return cls(str(raw["broker"]), str(raw["url"]), int(raw["epoch"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed owner record at {key}: {data!r}") from exc


@dataclass
class _Held:
    owner: Owner
    key: str
    value: bytes
    mod_revision: int
    releasing: bool = False


class Ownership:
    """Topic ownership for one broker session. Use from one event loop."""

    def __init__(self, kv: KV, keys: Keys, session: BrokerSession) -> None:
        self.kv = kv
        self.keys = keys
        self.session = session
        self._held: dict[str, _Held] = {}
        self._topic_by_key: dict[str, str] = {}
        self._callbacks: list[TopicLostCallback] = []
        self._unload_callbacks: list[TopicLostCallback] = []
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_lock = asyncio.Lock()
        self._closed = False
        session.on_lost(self._session_lost)

    def on_lost(self, callback: TopicLostCallback) -> None:
        """Call ``callback(topic)`` when this broker loses a topic it had acquired."""
        self._callbacks.append(callback)

    def on_unload(self, callback: TopicLostCallback) -> None:
        """Call ``callback(topic)`` when an unload request (``Keys.topic_unload``) naming this
        broker appears for a topic it holds."""
        self._unload_callbacks.append(callback)

    def is_owner(self, topic: str) -> bool:
        """Whether this broker holds the topic, as far as it knows (no I/O).

        Only ``fenced`` writes are safe against a stale answer.
        """
        return topic in self._held and self.session.alive

    def owned(self, topic: str) -> Owner | None:
        """This broker's ``Owner`` record for the topic if it holds it, else ``None`` (no I/O)."""
        held = self._held.get(topic)
        return held.owner if held is not None and self.session.alive else None

    def owned_topics(self) -> list[str]:
        """Every topic this broker holds (no I/O)."""
        return sorted(self._held) if self.session.alive else []

    async def owner_of(self, topic: str) -> Owner | None:
        """The topic's current owner as stored in etcd, ``None`` if nobody owns it."""
        key = self.keys.topic_owner(topic)
        current = await self.kv.get(key)
        return None if current is None else Owner.decode(current.value, key)

    async def acquire(self, topic: str, *, require_record: bool = False) -> Owner:
        """Become the topic's owner if nobody is; return whoever owns it now.

        The result is this broker's ``Owner`` (a fresh epoch, or the current one if it already
        held the topic) or another live broker's, to which clients must be redirected. Raises
        ``LeaseExpiredError`` if the broker session is not alive. With ``require_record`` the
        acquisition also compares, in its transaction, that the topic's record exists, and
        raises ``TopicDeletedError`` if it does not: a deleted topic is never taken again.
        """
        if self._closed:
            raise MetadataError(f"ownership of broker {self.session.broker_id} was closed")
        lease_id = self.session.lease_id
        if not self.session.alive or lease_id is None:
            raise LeaseExpiredError(
                f"broker {self.session.broker_id} has no live session: cannot acquire {topic}"
            )
        await self._ensure_watch()
        owner_key = self.keys.topic_owner(topic)
        epoch_key = self.keys.topic_epoch(topic)
        for _ in range(_ACQUIRE_ATTEMPTS):
            read = await self.kv.txn([], [Get(owner_key), Get(epoch_key)])
            current, epoch_kv = read.kv(0), read.kv(1)
            compares = [Compare.unchanged(epoch_key, epoch_kv)]
            if current is not None:
                holder = Owner.decode(current.value, owner_key)
                if current.lease == lease_id:
                    self._hold(topic, _Held(holder, owner_key, current.value, current.mod_revision))
                    return holder
                if holder.broker_id != self.session.broker_id:
                    return holder
                # This broker's id under a lease it no longer holds: a leftover of its own
                # previous session. Replace it, but only if it is still exactly that leftover.
                compares.append(Compare.unchanged(owner_key, current))
            else:
                compares.append(Compare.absent(owner_key))
            record_key = self.keys.topic(topic)
            if require_record:
                compares.append(Compare(record_key, "create", ">", 0))
            last_epoch = 0 if epoch_kv is None else _decode_int(epoch_kv.value, epoch_key)
            mine = Owner(self.session.broker_id, self.session.advertised_url, last_epoch + 1)
            value = mine.encode()
            result = await self.kv.txn(
                compares,
                [
                    Put(owner_key, value, lease_id),
                    Put(epoch_key, str(mine.epoch).encode()),
                    Get(owner_key),
                ],
                [Get(record_key)],
            )
            if not result.succeeded and require_record and result.kv(0) is None:
                raise TopicDeletedError(topic, f"topic {topic} does not exist: not acquired")
            written = result.kv(2) if result.succeeded else None
            if written is not None:
                self._hold(topic, _Held(mine, owner_key, value, written.mod_revision))
                log.info(
                    "topic acquired topic=%s broker=%s epoch=%s",
                    topic,
                    mine.broker_id,
                    mine.epoch,
                )
                return mine
        raise MetadataError(
            f"could not acquire {topic}: its owner changed {_ACQUIRE_ATTEMPTS} times while "
            "trying; try again"
        )

    async def fenced(
        self,
        topic: str,
        ops: Sequence[TxnOp],
        compares: Sequence[Compare] = (),
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Run ``ops`` only while this broker still owns the topic (and ``compares`` hold).

        Raises ``FencedError`` (and reports the loss through ``on_lost``) when the topic's owner
        key no longer holds this broker's value; nothing was written then. When only one of
        ``compares`` fails, returns ``TxnResult(succeeded=False)`` with the ``failure`` ops'
        results.
        """
        held = self._require(topic)
        result, lost = await self._fenced_txn([(topic, held)], ops, compares, failure)
        if lost:
            _, _, current = lost[0]
            now = "nobody" if current is None else current.value.decode(errors="replace")
            raise FencedError(
                topic,
                f"write to {topic} rejected: broker {self.session.broker_id} lost ownership "
                f"(epoch {held.owner.epoch}); the owner is now {now}",
            )
        return result

    async def fenced_many(
        self,
        topics: Sequence[str],
        ops: Sequence[TxnOp],
        compares: Sequence[Compare] = (),
        failure: Sequence[TxnOp] = (),
    ) -> FencedManyResult:
        """Run ``ops`` in one transaction only while this broker owns every one of ``topics``.

        The transaction compares each topic's owner key with this broker's value (as ``fenced``
        does), plus ``compares``. Outcomes:

        * all held: ``succeeded``, with the ops' results;
        * some topic is not held by this broker at call time: nothing is sent, those topics are
          returned in ``fenced`` (no ``on_lost``: there is nothing left to lose);
        * some owner key changed: nothing was written; those topics are returned in ``fenced``
          and their loss is reported through ``on_lost``;
        * only ``compares`` failed: ``fenced`` is empty.

        Whenever the transaction ran and failed, ``responses`` holds the ``failure`` ops'
        results, read in the same round trip. The caller decides what to retry without the
        fenced topics. One compare and one failure ``Get`` per topic is added to the caller's,
        so keep ``len(topics) + len(compares)`` and ``len(topics) + len(failure)`` within the
        store's limit (etcd: 128 by default).
        """
        unique = list(dict.fromkeys(topics))
        held: list[tuple[str, _Held]] = []
        not_held: list[str] = []
        for topic in unique:
            entry = self._held.get(topic)
            if entry is None or not self.session.alive:
                not_held.append(topic)
            else:
                held.append((topic, entry))
        if not_held:
            return FencedManyResult(False, tuple(not_held), ())
        result, lost = await self._fenced_txn(held, ops, compares, failure)
        return FencedManyResult(
            result.succeeded, tuple(topic for topic, _, _ in lost), result.responses
        )

    async def release(self, topic: str) -> None:
        """Give the topic up (delete the owner key if it is still ours). Idempotent.

        Does not call ``on_lost``. Flush the topic's progress before releasing it.
        """
        held = self._held.get(topic)
        if held is None:
            return
        held.releasing = True  # the watch will see the delete: that is no loss
        try:
            await self.kv.txn([Compare.value_is(held.key, held.value)], [Delete(held.key)])
        except BaseException:
            held.releasing = False
            raise
        if self._held.get(topic) is held:
            self._drop(topic)
            log.info("topic released topic=%s epoch=%s", topic, held.owner.epoch)

    async def close(self) -> None:
        """Release every held topic (best effort) and stop watching. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for topic in list(self._held):
            try:
                await self.release(topic)
            except MetadataError as exc:
                log.warning("topic release failed topic=%s error=%s", topic, exc)
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task

    async def _fenced_txn(
        self,
        held: Sequence[tuple[str, _Held]],
        ops: Sequence[TxnOp],
        compares: Sequence[Compare],
        failure: Sequence[TxnOp],
    ) -> tuple[TxnResult, list[tuple[str, _Held, KeyValue | None]]]:
        """One transaction guarded by the owner keys of ``held``.

        Returns the result (on failure: only the ``failure`` ops' results) and the topics
        whose owner key no longer holds this broker's value, each with the key as it is now;
        their loss is reported.
        """
        result = await self.kv.txn(
            [*(Compare.value_is(h.key, h.value) for _, h in held), *compares],
            ops,
            [*failure, *(Get(h.key) for _, h in held)],
        )
        if result.succeeded:
            return result, []
        lost: list[tuple[str, _Held, KeyValue | None]] = []
        for index, (topic, h) in enumerate(held):
            current = result.kv(len(failure) + index)
            if current is None or current.value != h.value:
                self._lose(topic, h, "a fenced write was rejected")
                lost.append((topic, h, current))
        return TxnResult(False, result.responses[: len(failure)]), lost

    def _require(self, topic: str) -> _Held:
        held = self._held.get(topic)
        if held is None or not self.session.alive:
            raise FencedError(topic, f"broker {self.session.broker_id} does not own {topic}")
        return held

    def _hold(self, topic: str, held: _Held) -> None:
        self._held[topic] = held
        self._topic_by_key[held.key] = topic

    def _drop(self, topic: str) -> None:
        held = self._held.pop(topic)
        self._topic_by_key.pop(held.key, None)

    def _lose(self, topic: str, held: _Held, reason: str) -> None:
        if self._held.get(topic) is not held or held.releasing:
            return  # already reported, re-acquired since, or being given up
        self._drop(topic)
        log.warning(
            "topic ownership lost topic=%s broker=%s epoch=%s reason=%s",
            topic,
            held.owner.broker_id,
            held.owner.epoch,
            reason,
        )
        for callback in list(self._callbacks):
            try:
                callback(topic)
            except Exception:
                log.exception("ownership on_lost callback failed topic=%s", topic)

    def _session_lost(self) -> None:
        for topic, held in list(self._held.items()):
            self._lose(topic, held, "the broker session was lost")

    async def _ensure_watch(self) -> None:
        async with self._watch_lock:
            if self._watch_task is None:
                stream = await self.kv.watch_prefix(self.keys.topics_prefix())
                self._watch_task = asyncio.create_task(
                    self._watch(stream), name=f"ownership-watch-{self.session.broker_id}"
                )

    async def _watch(self, stream: WatchStream) -> None:
        """Report owner keys that change or vanish; after a broken watch, re-check them all."""
        while True:
            try:
                async with stream:
                    async for event in stream:
                        self._on_event(event)
                return  # the store was closed
            except MetadataError as exc:
                log.warning("ownership watch broke; re-checking held topics error=%s", exc)
            while True:
                await asyncio.sleep(_WATCH_RETRY_SECONDS)
                try:
                    stream = await self.kv.watch_prefix(self.keys.topics_prefix())
                except MetadataError as exc:
                    log.warning("ownership watch restart failed error=%s", exc)
                    continue
                await self._verify_held()
                break

    def _on_event(self, event: WatchEvent) -> None:
        if event.kind == "put" and event.kv.key.endswith("/unload"):
            self._on_unload_event(event)
            return
        topic = self._topic_by_key.get(event.kv.key)
        held = None if topic is None else self._held.get(topic)
        if topic is None or held is None or event.kv.mod_revision <= held.mod_revision:
            return
        what = "deleted" if event.kind == "delete" else "overwritten"
        self._lose(topic, held, f"the owner key was {what}")

    def _on_unload_event(self, event: WatchEvent) -> None:
        owner_key = event.kv.key.removesuffix("unload") + "owner"
        topic = self._topic_by_key.get(owner_key)
        if topic is None or topic not in self._held:
            return
        try:
            broker = json.loads(event.kv.value)["broker"]
        except (ValueError, TypeError, KeyError):
            log.warning("malformed unload request key=%s value=%r", event.kv.key, event.kv.value)
            return
        if broker != self.session.broker_id:
            return
        log.info("topic unload requested topic=%s broker=%s", topic, broker)
        for callback in list(self._unload_callbacks):
            try:
                callback(topic)
            except Exception:
                log.exception("ownership on_unload callback failed topic=%s", topic)

    async def _verify_held(self) -> None:
        for topic, held in list(self._held.items()):
            try:
                current = await self.kv.get(held.key)
            except MetadataError as exc:
                log.warning("ownership check failed topic=%s error=%s", topic, exc)
                continue
            if current is None or current.value != held.value:
                self._lose(topic, held, "the owner key changed while the watch was down")


def _decode_int(data: bytes, key: str) -> int:
    try:
        return int(values.loads(data))
    except (ValueError, TypeError) as exc:
        raise MetadataError(f"malformed integer at {key}: {data!r}") from exc
