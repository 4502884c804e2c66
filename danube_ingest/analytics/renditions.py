"""Tables and their renditions: creation, activation (the handover), reader holds, collection.

A rendition is one complete conversion of a table (``r1``, ``r2``, ...: a converter version and
a decode schema). Guarantees:

* ``activate`` hands readers over in one etcd transaction: the table's ``active`` rendition and
  ``upper`` change together (the new rendition must have reached the table's ``upper``, so the
  frontier never moves back), the new rendition becomes ``active``, the old one ``draining``.
* ``hold`` gives a reader a lease-backed hold on a rendition for as long as it reads; a hold is
  taken only on a rendition that is not collected, and it bumps the rendition record, so
* ``collect_rendition`` deletes a rendition's files and records only if it is not active and
  no hold exists, checked inside the transaction that marks it ``collected``: a hold taken
  meanwhile makes that transaction fail (``RenditionHeldError``), and the hold wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import replace

from danube_ingest.analytics.errors import RenditionError, RenditionHeldError
from danube_ingest.analytics.layout import (
    DEFAULT_WIDTH_S,
    check_width,
    dead_letters_of,
    parse_rendition,
    partition_start,
    rendition_name,
    topic_prefix,
)
from danube_ingest.analytics.records import HoldRecord, RenditionRecord, TableKeys, TableRecord
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Delete, Get, Put
from danube_ingest.objects.store import ObjectStore

__all__ = [
    "activate",
    "collect_rendition",
    "create_rendition",
    "create_table",
    "hold",
    "read_rendition",
    "read_table",
]

log = logging.getLogger(__name__)

#: Lease TTL of a reader hold: a crashed reader's hold is gone this long after its last
#: keepalive, and its rendition becomes collectable.
HOLD_TTL_S = 30


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def read_table(kv: KV, keys: Keys, topic: str) -> TableRecord | None:
    """The topic's table record, ``None`` if it has none."""
    key = TableKeys(keys, topic).table()
    stored = await kv.get(key)
    return None if stored is None else TableRecord.decode(stored.value, key)


async def read_rendition(kv: KV, keys: Keys, topic: str, rendition: str) -> RenditionRecord | None:
    """A rendition's record, ``None`` if it does not exist."""
    key = TableKeys(keys, topic).rendition(rendition)
    stored = await kv.get(key)
    return None if stored is None else RenditionRecord.decode(stored.value, key)


async def create_table(
    kv: KV,
    keys: Keys,
    topic: str,
    *,
    since_ms: int,
    width_s: int = DEFAULT_WIDTH_S,
    now_ms: int | None = None,
) -> TableRecord:
    """Create the topic's table (idempotent): partitions of ``width_s`` from the partition of
    ``since_ms`` on. An existing table is returned as is if its width matches, else
    ``RenditionError``."""
    check_width(width_s)
    tables = TableKeys(keys, topic)
    start = partition_start(since_ms, width_s)
    record = TableRecord(width_s, None, start, start, _now_ms() if now_ms is None else now_ms)
    result = await kv.txn(
        [Compare.absent(tables.table())],
        [Put(tables.table(), record.encode())],
        [Get(tables.table())],
    )
    if result.succeeded:
        log.info("table created topic=%s width_s=%d since_ms=%d", topic, width_s, start)
        return record
    stored = result.kv(0)
    assert stored is not None
    existing = TableRecord.decode(stored.value, stored.key)
    if existing.width_s != width_s:
        raise RenditionError(
            f"table of {topic} exists with partitions of {existing.width_s} s, not {width_s} s; "
            "a table's width cannot change"
        )
    return existing


async def create_rendition(
    kv: KV,
    keys: Keys,
    topic: str,
    converter_version: str,
    schema_ref: str = "",
    *,
    now_ms: int | None = None,
    dead_letters: bool = False,
) -> str:
    """Create the next rendition (``r{N+1}``) of the topic's table, state ``building``, its
    frontier at the table's ``since`` (``dead_letters``: rows that do not decode go to
    dead-letter files); returns its name."""
    tables = TableKeys(keys, topic)
    while True:
        read = await kv.txn([], [Get(tables.table()), Get(tables.renditions_prefix(), True)])
        table_kv = read.kv(0)
        if table_kv is None:
            raise RenditionError(f"{topic} has no table: create it first")
        table = TableRecord.decode(table_kv.value, table_kv.key)
        numbers = [
            parse_rendition(e.key[len(tables.renditions_prefix()) :])
            for e in read.responses[1].kvs
            if tables.is_rendition(e.key)
        ]
        name = rendition_name(max(numbers, default=0) + 1)
        record = RenditionRecord(
            converter_version,
            schema_ref,
            _now_ms() if now_ms is None else now_ms,
            "building",
            table.since_ms,
            dead_letters=dead_letters,
        )
        result = await kv.txn(
            [Compare.absent(tables.rendition(name))], [Put(tables.rendition(name), record.encode())]
        )
        if result.succeeded:
            log.info(
                "rendition created topic=%s rendition=%s converter=%s schema=%s",
                topic,
                name,
                converter_version,
                schema_ref,
            )
            return name


async def activate(kv: KV, keys: Keys, topic: str, rendition: str) -> TableRecord:
    """Hand readers over to ``rendition`` in one transaction (see the module docstring).

    ``RenditionError`` if it does not exist, is collected, or is behind the table's ``upper``
    (readers would lose partitions: convert it further first).
    """
    tables = TableKeys(keys, topic)
    while True:
        read = await kv.txn([], [Get(tables.table()), Get(tables.renditions_prefix(), True)])
        table_kv = read.kv(0)
        if table_kv is None:
            raise RenditionError(f"{topic} has no table: create it first")
        table = TableRecord.decode(table_kv.value, table_kv.key)
        found = {e.key: e for e in read.responses[1].kvs if tables.is_rendition(e.key)}
        new_kv = found.get(tables.rendition(rendition))
        if new_kv is None:
            raise RenditionError(f"{topic} has no rendition {rendition}")
        new = RenditionRecord.decode(new_kv.value, new_kv.key)
        if table.active == rendition:
            return table
        if new.state == "collected":
            raise RenditionError(f"rendition {rendition} of {topic} was collected")
        upper = max(new.upper_ms, table.since_ms)
        if upper < table.upper_ms:
            raise RenditionError(
                f"rendition {rendition} of {topic} is complete up to {upper}, behind the "
                f"table's upper {table.upper_ms}: convert it up to there before activating it"
            )
        compares = [
            Compare.unchanged(tables.table(), table_kv),
            Compare.unchanged(new_kv.key, new_kv),
        ]
        moved = replace(table, active=rendition, upper_ms=upper)
        puts = [
            Put(tables.table(), moved.encode()),
            Put(new_kv.key, replace(new, state="active").encode()),
        ]
        if table.active is not None:
            old_kv = found.get(tables.rendition(table.active))
            if old_kv is not None:
                old = RenditionRecord.decode(old_kv.value, old_kv.key)
                compares.append(Compare.unchanged(old_kv.key, old_kv))
                puts.append(Put(old_kv.key, replace(old, state="draining").encode()))
        result = await kv.txn(compares, puts)
        if result.succeeded:
            log.info(
                "rendition activated topic=%s rendition=%s previous=%s upper_ms=%d",
                topic,
                rendition,
                table.active,
                upper,
            )
            return moved


@contextlib.asynccontextmanager
async def hold(
    kv: KV,
    keys: Keys,
    topic: str,
    rendition: str | None = None,
    *,
    ttl: int = HOLD_TTL_S,
    holder: str = "",
) -> AsyncIterator[str]:
    """Hold ``rendition`` (default: the active one) while the block runs; yields its name.

    The hold is a key under a lease kept alive until the block exits (then revoked), so the
    rendition's files stay readable for the block's whole duration. ``RenditionError`` if the
    rendition is collected or there is none.
    """
    tables = TableKeys(keys, topic)
    hold_key = tables.hold(uuid.uuid4().hex)
    lease = await kv.grant_lease(ttl)
    try:
        name = await _take_hold(kv, tables, rendition, hold_key, lease, holder)
    except BaseException:
        with contextlib.suppress(DanubeIngestError):
            await kv.revoke_lease(lease)
        raise
    keepalive = asyncio.create_task(_keep(kv, lease, ttl, hold_key))
    try:
        yield name
    finally:
        keepalive.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keepalive
        with contextlib.suppress(DanubeIngestError):
            await kv.revoke_lease(lease)


async def _take_hold(
    kv: KV, tables: TableKeys, rendition: str | None, hold_key: str, lease: int, holder: str
) -> str:
    topic = tables.topic
    while True:
        name = rendition
        if name is None:
            table_kv = await kv.get(tables.table())
            table = None if table_kv is None else TableRecord.decode(table_kv.value, table_kv.key)
            if table is None or table.active is None:
                raise RenditionError(f"{topic} has no active rendition to read")
            name = table.active
        key = tables.rendition(name)
        seen = await kv.get(key)
        record = None if seen is None else RenditionRecord.decode(seen.value, key)
        if seen is None or record is None or record.state == "collected":
            raise RenditionError(f"rendition {name} of {topic} is collected or does not exist")
        bumped = replace(record, holds=record.holds + 1)
        result = await kv.txn(
            [Compare.unchanged(key, seen)],
            [
                Put(key, bumped.encode()),
                Put(hold_key, HoldRecord(name, _now_ms(), holder).encode(), lease),
            ],
        )
        if result.succeeded:
            log.info("rendition hold taken topic=%s rendition=%s hold=%s", topic, name, hold_key)
            return name


async def _keep(kv: KV, lease: int, ttl: int, what: str) -> None:
    while True:
        await asyncio.sleep(max(ttl / 3, 0.2))
        try:
            await kv.refresh_lease(lease)
        except MetadataError as exc:
            log.warning("hold keepalive failed hold=%s error=%s", what, exc)


async def collect_rendition(
    kv: KV,
    keys: Keys,
    topic: str,
    rendition: str,
    store: ObjectStore,
    root: str,
    *,
    keep: Collection[str] = (),
) -> int:
    """Delete a non-active rendition's files and partition records, leaving its record with
    state ``collected``; returns how many files were deleted. Files in ``keep`` (keys an
    Iceberg snapshot still holds: ``iceberg.held_keys``) stay, for ``iceberg.maintain`` to
    delete once no snapshot holds them. Idempotent.

    ``RenditionHeldError`` (retriable) while a reader holds it, ``RenditionError`` if it is the
    active one.
    """
    tables = TableKeys(keys, topic)
    key = tables.rendition(rendition)
    while True:
        read = await kv.txn([], [Get(tables.table()), Get(key), Get(tables.holds_prefix(), True)])
        table_kv, seen = read.kv(0), read.kv(1)
        if seen is None:
            raise RenditionError(f"{topic} has no rendition {rendition}")
        record = RenditionRecord.decode(seen.value, key)
        if record.state == "collected":
            break
        if (
            table_kv is not None
            and TableRecord.decode(table_kv.value, table_kv.key).active == rendition
        ):
            raise RenditionError(
                f"rendition {rendition} of {topic} is active: activate another one first"
            )
        holders = [
            e.key
            for e in read.responses[2].kvs
            if HoldRecord.decode(e.value, e.key).rendition == rendition
        ]
        if holders:
            raise RenditionHeldError(
                f"rendition {rendition} of {topic} is held by {len(holders)} reader(s) "
                f"({holders[0]}...); collect it after they finish"
            )
        compares = [Compare.unchanged(key, seen), Compare.unchanged(tables.table(), table_kv)]
        result = await kv.txn(compares, [Put(key, replace(record, state="collected").encode())])
        if result.succeeded:
            break
    # No commit, no hold can be added now (both check the record), so deleting is safe.
    deleted = 0
    prefix = topic_prefix(root, rendition, topic)
    listed = await store.list(prefix) + await store.list(dead_letters_of(root, prefix))
    for path in listed:
        if path in keep:
            continue
        await store.delete(path)
        deleted += 1
    await kv.txn([], [Delete(tables.parts_prefix(rendition), True)])
    log.info("rendition collected topic=%s rendition=%s files=%d", topic, rendition, deleted)
    return deleted
