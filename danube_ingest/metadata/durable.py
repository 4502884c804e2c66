"""Recorded durable ends: how far a broker's WAL held each of its topics, as of a recent instant.

``storage/topics/{ns}/{topic}/durable/{broker}`` = JSON ``{"end", "epoch", "at_ms"}`` says: at
``at_ms``, every offset of the topic below ``end`` that ``broker`` (its owner at ``epoch``) had
acknowledged was durable in that broker's WAL, and it had acknowledged none at or above
``end``.

Why: a takeover that is declared lost (``brokers forget``) skips the previous owner's whole
offset reservation ``[committed, reserved)``, which is 1.7-2.9x what it really acknowledged and
never uploaded. The reservation is the only strict bound; this record narrows it to
``end - committed`` as of ``at_ms``, plus whatever the broker acknowledged in its last interval
(it died before the next record).

Guarantees:

* ``DurableEndRecorder`` writes at most one etcd transaction per ``interval`` per broker, holding
  a put for each owned topic whose durable end moved since its last write, and none when nothing
  moved (an idle broker writes nothing). ``close`` writes a last one.
* Only the broker named in the key writes it (one key per broker and topic), so brokers never
  overwrite each other's records; a failed write is retried at the next interval, with
  everything that moved meanwhile.
* Deleting a topic removes its records with the rest of ``storage/topics/{ns}/{topic}/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Put

log = logging.getLogger(__name__)

#: Default seconds between two records: the uncertainty ``brokers forget`` reports beyond the
#: recorded end is what the broker acknowledged in at most this long.
DEFAULT_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class DurableEnd:
    """A broker's recorded durable end of one topic."""

    topic: str
    broker: str
    end: int
    """Every offset below it that the broker acknowledged was durable in its WAL at ``at_ms``."""
    epoch: int
    at_ms: int

    def encode(self) -> bytes:
        doc = {"end": self.end, "epoch": self.epoch, "at_ms": self.at_ms}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, topic: str, broker: str, data: bytes, key: str) -> DurableEnd:
        """Parse a record stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            raw = values.loads(data)
            record = cls(topic, broker, raw["end"], raw["epoch"], raw["at_ms"])
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"malformed durable end record at {key}: {exc}") from exc
        numbers = (record.end, record.epoch, record.at_ms)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise MetadataError(f"malformed durable end record at {key}: {data!r}")
        return record


async def read_durable_end(kv: KV, keys: Keys, topic: str, broker: str) -> DurableEnd | None:
    """``broker``'s last recorded durable end of ``topic`` (None: it recorded none)."""
    key = keys.storage_durable_end(topic, broker)
    stored = await kv.get(key)
    if stored is None:
        return None
    return DurableEnd.decode(topic, broker, stored.value, key)


#: What the recorder asks for each interval: topic -> (durable end, ownership epoch), for the
#: topics the broker owns now.
EndsSource = Callable[[], dict[str, tuple[int, int]]]


class DurableEndRecorder:
    """Records ``ends()`` in etcd every ``interval`` seconds, for the topics whose end moved."""

    def __init__(
        self,
        kv: KV,
        keys: Keys,
        broker_id: str,
        ends: EndsSource,
        *,
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._kv = kv
        self._keys = keys
        self._broker_id = broker_id
        self._ends = ends
        self._interval = interval
        self._clock = clock
        self._written: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        """Transactions written so far (one per interval at most)."""

    def start(self) -> None:
        """Begin recording every ``interval`` (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="durable-end-recorder")

    async def flush(self) -> int:
        """Write the ends that moved since their last write, in one transaction; returns how
        many topics it held (0: nothing moved, nothing written). ``MetadataError`` if etcd
        failed: the same ends are written again by the next call."""
        ends = self._ends()
        for topic in [t for t in self._written if t not in ends]:
            del self._written[topic]  # no longer owned: a later owner writes its own record
        moved = {t: e for t, e in ends.items() if self._written.get(t) != e[0]}
        if not moved:
            return 0
        at_ms = int(self._clock() * 1000)
        puts = [
            Put(
                self._keys.storage_durable_end(topic, self._broker_id),
                DurableEnd(topic, self._broker_id, end, epoch, at_ms).encode(),
            )
            for topic, (end, epoch) in moved.items()
        ]
        await self._kv.txn([], puts)
        self.writes += 1
        for topic, (end, _) in moved.items():
            self._written[topic] = end
        return len(moved)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
            except MetadataError as exc:
                log.warning(
                    "durable ends not recorded broker=%s error=%s (retried in %.1fs)",
                    self._broker_id,
                    exc,
                    self._interval,
                )

    async def close(self) -> None:
        """Stop recording after a last write (a failed one is logged, not raised)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        try:
            await self.flush()
        except MetadataError as exc:
            log.warning("durable ends not recorded broker=%s error=%s", self._broker_id, exc)


__all__ = [
    "DEFAULT_INTERVAL",
    "DurableEnd",
    "DurableEndRecorder",
    "EndsSource",
    "read_durable_end",
]
