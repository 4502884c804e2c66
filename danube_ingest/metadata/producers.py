"""Idempotent producer tables handed from a topic's old owner to its new one.

An idempotent batch producer's sequences are checked against the topic's producer table in the
owner's WAL (``wal.meta``). When the topic changes owner, the old owner writes its table to
``storage/topics/{ns}/{topic}/producers`` as part of the hand-over, and the new owner loads it
into its own WAL before it assigns any offset: a batch the old owner stored and the client sends
again to the new owner is then answered ``duplicate`` with its original offsets.

Value (bytes, little-endian)::

    "DNPT1" | u64 end | u64 epoch | u16 broker_len | broker (utf-8) | u32 producers
    then per producer: u64 producer_id | u16 batches
                       then per batch: u64 sequence | u64 base_offset | u32 count

``end`` is the offset the new owner continues at: the table describes every batch below it.
A value whose ``end`` is not where the new owner continues is stale (a later owner assigned
offsets and its table was lost with it) and is ignored. ``epoch`` is the ownership epoch it
was written under.

Bound: at most ``HANDOVER_MAX_PRODUCERS`` producers (the most recently used; older ones are
not handed over) with at most ``PRODUCER_WINDOW`` (32) batches each: 1,000 x (10 + 32 x 20)
bytes = 650,000 bytes plus the header, under half of etcd's default 1.5 MiB request limit.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Delete, KeyValue, Put, TxnOp

log = logging.getLogger(__name__)

#: Producers handed over per topic (the most recently used): keeps the value at most
#: ~650 KB (see the module docstring). A producer beyond it is unknown to the new owner,
#: which then accepts any sequence from it (a re-sent batch may be stored again).
HANDOVER_MAX_PRODUCERS = 1_000
#: Batches per producer (``wal.meta.PRODUCER_WINDOW``; a u16 count in the value).
HANDOVER_WINDOW = 32

MAGIC = b"DNPT1"
_HEAD = struct.Struct("<QQH")
_COUNT = struct.Struct("<I")
_PRODUCER = struct.Struct("<QH")
_BATCH = struct.Struct("<QQI")

#: producer id -> [(sequence, base offset, count), ...], oldest batch first; least recently
#: used producer first.
ProducerTable = dict[int, list[tuple[int, int, int]]]


@dataclass(frozen=True, slots=True)
class HandedProducers:
    """A topic's producer table as its previous owner handed it over."""

    end: int
    """The offset the next owner continues at; every batch of the table lies below it."""
    epoch: int
    """The ownership epoch it was written under."""
    broker: str
    """The broker that wrote it."""
    producers: ProducerTable

    def encode(self) -> bytes:
        """The stored value, keeping the ``HANDOVER_MAX_PRODUCERS`` most recently used
        producers and each one's last ``HANDOVER_WINDOW`` batches."""
        broker = self.broker.encode()
        kept = list(self.producers.items())[-HANDOVER_MAX_PRODUCERS:]
        parts = [MAGIC, _HEAD.pack(self.end, self.epoch, len(broker)), broker]
        parts.append(_COUNT.pack(len(kept)))
        for producer_id, batches in kept:
            window = batches[-HANDOVER_WINDOW:]
            parts.append(_PRODUCER.pack(producer_id, len(window)))
            parts.extend(_BATCH.pack(*batch) for batch in window)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes, key: str) -> HandedProducers:
        """Parse the value stored at ``key``; ``MetadataError`` naming ``key`` if malformed."""
        try:
            if not data.startswith(MAGIC):
                raise ValueError("bad magic")
            at = len(MAGIC)
            end, epoch, broker_len = _HEAD.unpack_from(data, at)
            at += _HEAD.size
            broker = data[at : at + broker_len].decode()
            at += broker_len
            (count,) = _COUNT.unpack_from(data, at)
            at += _COUNT.size
            producers: ProducerTable = {}
            for _ in range(count):
                producer_id, batches = _PRODUCER.unpack_from(data, at)
                at += _PRODUCER.size
                window = [_BATCH.unpack_from(data, at + i * _BATCH.size) for i in range(batches)]
                at += batches * _BATCH.size
                producers[producer_id] = window
            if at != len(data):
                raise ValueError(f"{len(data) - at} bytes after the table")
        except (ValueError, struct.error) as exc:
            raise MetadataError(
                f"malformed producer table at {key}: {exc} (delete the key: the topic's next "
                "owner then starts with no producer table)"
            ) from exc
        return cls(end, epoch, broker, producers)


def handover_ops(keys: Keys, topic: str, handed: HandedProducers) -> list[TxnOp]:
    """The ops that hand ``handed`` over with the topic (in the hand-over's transaction): a
    put, or a delete of any older value when the table is empty."""
    key = keys.producers(topic)
    log.info(
        "producer table in the hand-over topic=%s end=%d producers=%d epoch=%d broker=%s",
        topic,
        handed.end,
        len(handed.producers),
        handed.epoch,
        handed.broker,
    )
    if not handed.producers:
        return [Delete(key)]
    return [Put(key, handed.encode())]


async def read_handed_producers(
    kv: KV, keys: Keys, topic: str
) -> tuple[HandedProducers, KeyValue] | None:
    """The topic's handed-over producer table and its stored key-value (None: there is none)."""
    stored = await kv.get(keys.producers(topic))
    if stored is None:
        return None
    return HandedProducers.decode(stored.value, stored.key), stored


__all__ = [
    "HANDOVER_MAX_PRODUCERS",
    "HANDOVER_WINDOW",
    "HandedProducers",
    "ProducerTable",
    "handover_ops",
    "read_handed_producers",
]
