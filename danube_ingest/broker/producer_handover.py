"""Idempotent producer tables across a change of owner (``metadata.producers``).

The old owner hands its table over with the topic: with the exact end of a clean unload or
shutdown (``handover_ops``, in the reservation's fenced transaction), or when its tail is
recovered after a takeover (``TailHandover``, in the transaction that resolves the record).
The new owner, before it assigns any offset, adopts the table into its WAL
(``adopt_handed_producers``) when it continues exactly at the table's end; a stale table is
ignored, and the stored value is deleted once read. A re-sent batch the old owner stored is
then answered ``duplicate`` with its original offsets.

A tail declared lost (``brokers forget``, a wiped WAL) hands no table over: the new owner starts
with an empty table, so a batch re-sent then may be stored again (after the recorded jump).
"""

from __future__ import annotations

import logging

from danube_ingest.metadata.kv import Compare, Delete, TxnOp
from danube_ingest.metadata.ownership import Ownership
from danube_ingest.metadata.producers import HandedProducers, handover_ops, read_handed_producers
from danube_ingest.store.topic_store import TopicStore

log = logging.getLogger(__name__)


def handed_table(
    store: TopicStore, ownership: Ownership, topic: str, end: int, epoch: int | None = None
) -> list[TxnOp]:
    """The ops handing the topic's producer table (its batches below ``end``) to whoever
    continues at ``end``, written under ``epoch`` (None: this broker's current epoch of the
    topic; the ops then go in a transaction fenced by it)."""
    if epoch is None:
        owner = ownership.owned(topic)
        epoch = 0 if owner is None else owner.epoch  # not owned: the fenced write fails
    broker = ownership.session.broker_id
    handed = HandedProducers(end, epoch, broker, store.producer_table(topic, end))
    return handover_ops(ownership.keys, topic, handed)


async def adopt_handed_producers(
    store: TopicStore, ownership: Ownership, topic: str, start: int, local_next: int | None
) -> None:
    """Before the topic (owned here) assigns an offset from ``start``: adopt the producer
    table its previous owner handed over at ``start`` into this broker's WAL, durably.

    ``local_next`` is the topic's next offset in this WAL before the load (None: unknown).
    Without a table for ``start``, a table this WAL holds from an earlier ownership is
    cleared when another owner assigned offsets since (it would misjudge sequences). The
    stored value is deleted once read (fenced; a newer value is left). Raises
    ``MetadataError`` for a malformed value, ``WalFailedError`` if the WAL cannot keep it.
    """
    kv, keys = ownership.kv, ownership.keys
    found = await read_handed_producers(kv, keys, topic)
    owner = ownership.owned(topic)
    epoch = 0 if owner is None else owner.epoch
    if found is not None and found[0].end == start and found[0].epoch <= epoch:
        handed = found[0]
        await store.adopt_producers(topic, handed.producers)
        log.info(
            "producer table adopted topic=%s end=%d producers=%d from=%s from_epoch=%d epoch=%d",
            topic,
            start,
            len(handed.producers),
            handed.broker,
            handed.epoch,
            epoch,
        )
    else:
        if found is not None:
            log.warning(
                "stale producer table ignored topic=%s table_end=%d start=%d from=%s "
                "from_epoch=%d epoch=%d",
                topic,
                found[0].end,
                start,
                found[0].broker,
                found[0].epoch,
                epoch,
            )
        if local_next != start and store.producer_table(topic, start):
            await store.adopt_producers(topic, {})
            log.info("producer table of an earlier ownership cleared topic=%s", topic)
    if found is not None:
        stored = found[1]
        await ownership.fenced(
            topic, [Delete(stored.key)], compares=[Compare.value_is(stored.key, stored.value)]
        )


__all__ = ["adopt_handed_producers", "handed_table"]
