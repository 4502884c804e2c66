"""Topic deletion, as the admin CLI runs it against etcd (``danube-ingest topics delete``).

The owning broker is not called: the first transaction deletes the topic's record and its
owner key together, which fences the owner (its ownership watch reports the loss; every later
fenced write of it fails), and no broker can acquire the topic again while the record is
absent (``Ownership.acquire(require_record=True)``). The owner, seeing its topic lost and the
record gone, drops the topic from its WAL with a durable DROP frame (``TopicManager``).

Guarantees:

* After ``delete_topic`` returns: the topic's record, owner key, offset reservation,
  takeover record,
  subscriptions and cursors, client registrations and their name index, schema
  configuration, manifest entries, ingest clock, retained floor, retention policy and prune
  marks are gone. Each removed
  manifest entry's object gets a retirement record in the same transaction that removes the
  entry, so the orphan collector deletes the object after its grace period, once no other
  topic's entry names it (a segment object shared with other topics stays while they need it).
* Kept: the epoch counter ``topics/{ns}/{topic}/epoch`` (one small integer, so that no owner of
  a later incarnation ever holds an epoch an owner of the deleted one held) and the Parquet
  table records ``tables/{ns}/{topic}/...`` (out of scope: the analytics tables have their own
  lifecycle).
* Every step after the first compares that the record is still absent: a topic created
  again meanwhile is never touched; ``TopicRecreatedError`` says so and the call may be run
  again after deleting the new incarnation.
* Idempotent: running it again finishes an interrupted deletion (``existed`` is then False).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from danube_ingest.broker.errors import BrokerError
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV, Compare, Delete, TxnOp
from danube_ingest.metadata.manifest import ObjectRange, retire_ops
from danube_ingest.metadata.records import Records
from danube_ingest.schema.registry import topic_config_key

log = logging.getLogger(__name__)

#: Ops per transaction after the first: etcd's default ``--max-txn-ops`` is 128 (each manifest
#: entry costs a delete and at most one retirement put).
_CHUNK_OPS = 120


class TopicRecreatedError(BrokerError):
    """The topic was created again while its deletion ran; the new incarnation was left alone.

    Delete it again to finish (what is left of the old one goes with it)."""


@dataclass
class DeletionReport:
    """What ``delete_topic`` removed."""

    topic: str
    existed: bool
    """Whether the topic's record existed (False: nothing to fence, leftovers cleaned)."""
    subscriptions: int = 0
    clients: int = 0
    manifest_entries: int = 0
    retired_objects: int = 0
    prune_marks: int = 0


async def delete_topic(kv: KV, keys: Keys, topic: str) -> DeletionReport:
    """Delete ``topic``'s metadata (see the module docstring for what goes and what stays)."""
    ns, name = split_topic(topic)
    records = Records(kv, keys)
    record_key = keys.topic(topic)
    subs = await records.list_subscriptions(topic)
    fence = await kv.txn(
        [],
        [
            Delete(record_key),
            Delete(keys.topic_owner(topic)),
            Delete(keys.topic_offsets(topic)),
            Delete(keys.topic_unload(topic)),
            Delete(keys.handover(topic)),
            Delete(keys.subscriptions_prefix(topic), prefix=True),
            Delete(keys.schemas_prefix() + topic_config_key(topic)),
        ],
    )
    report = DeletionReport(topic, existed=fence.responses[0].deleted > 0)
    report.subscriptions = len(subs)
    log.info("topic deletion fenced topic=%s existed=%s", topic, report.existed)
    absent = Compare.absent(record_key)

    async def run(ops: Sequence[TxnOp]) -> None:
        for start in range(0, len(ops), _CHUNK_OPS):
            result = await kv.txn([absent], ops[start : start + _CHUNK_OPS])
            if not result.succeeded:
                raise TopicRecreatedError(
                    f"topic {topic} was created again while it was being deleted; its new "
                    "incarnation was left alone: delete it again to finish"
                )

    # Clients (a scan: registrations are keyed by id) and their name index.
    clients = [c for c in await records.list_clients() if c.topic == topic]
    report.clients = len(clients)
    await run(
        [Delete(keys.client(c.client_id)) for c in clients]
        + [Delete(f"{keys.prefix}/client-names/{ns}/{name}/", prefix=True)]
    )
    # Manifest entries with their retirement records, in the same transaction per chunk.
    head = keys.storage_objects_prefix(topic)
    entries = [
        (stored.key, ObjectRange.decode(stored.value, stored.key))
        for stored in await kv.get_prefix(head)
    ]
    per_chunk = _CHUNK_OPS // 2
    for start in range(0, len(entries), per_chunk):
        chunk = entries[start : start + per_chunk]
        retire = retire_ops(keys, [rng.object_key for _, rng in chunk])
        await run([*(Delete(key) for key, _ in chunk), *retire])
        report.manifest_entries += len(chunk)
        report.retired_objects += len(retire)
    # The rest of the cold path's keys (clock, retained floor, anything else under the topic's
    # storage prefix), its retention policy, and every broker region's prune mark.
    suffix = f"/floor/{ns}/{name}"
    marks = [s.key for s in await kv.get_prefix(f"{keys.prefix}/wal/") if s.key.endswith(suffix)]
    report.prune_marks = len(marks)
    await run(
        [
            Delete(keys.storage_topic_prefix(topic), prefix=True),
            Delete(keys.policy(topic)),
            *(Delete(key) for key in marks),
        ]
    )
    log.info(
        "topic deleted topic=%s subscriptions=%d clients=%d manifest_entries=%d "
        "retired_objects=%d prune_marks=%d",
        topic,
        report.subscriptions,
        report.clients,
        report.manifest_entries,
        report.retired_objects,
        report.prune_marks,
    )
    return report
