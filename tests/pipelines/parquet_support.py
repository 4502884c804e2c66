"""Input and committed tables for the Parquet layer's tests: one topic whose offsets 0..1799
have ingest times spread over three complete hours of yesterday (600 an hour), real manifest
entries and clock in etcd, and conversions committed with the library's own run protocol
(``danube_ingest.analytics.commit``), as the Spark program commits them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import crc32c

from danube_ingest.analytics import layout
from danube_ingest.analytics.commit import advance_frontier, begin, commit_partition
from danube_ingest.analytics.parquet import write_partition
from danube_ingest.analytics.plan import plan_run
from danube_ingest.analytics.renditions import (
    activate,
    create_rendition,
    create_table,
    read_table,
)
from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.manifest import ObjectRange
from danube_ingest.metadata.records import Records, TopicRecord
from danube_ingest.objects.binfmt import BinWriter
from danube_ingest.objects.store import ObjectStore
from danube_ingest.wal.framing import Entry
from tests.analytics.tables_support import SCHEMA, object_range, rows

TOPIC = "/default/orders"
ROOT = "warehouse/"
HOUR = 3_600_000
#: 2026-11-23T10:00:00Z: a day before tables_support.T0, so its hours are past on any clock
#: these tests run on (Dagster shows only hours that have ended).
H0 = 1_795_428_000_000
PER_HOUR = 600
MINUTE = 60_000
#: A minute table made at 10:37 of the first hour, as ``tables convert --width-s 60`` makes it.
SINCE = H0 + 37 * MINUTE


def ingest_ms(offset: int) -> int:
    """600 offsets an hour from H0, one every 6 s."""
    return H0 + offset * 6_000


def payload(offset: int) -> bytes:
    """The payload of ``offset`` in the real objects."""
    return f"order-{offset}".encode()


def plain_entry(offset: int) -> Entry:
    """The entry of ``offset`` in the real objects (``payload``, no schema)."""
    return Entry(payload(offset), producer_name="p", publish_ms=ingest_ms(offset) - 5)


async def _write_object(
    store: ObjectStore,
    start: int,
    end: int,
    entry_of: Callable[[int], Entry] = plain_entry,
    topic: str = TOPIC,
) -> ObjectRange:
    """A real ``.bin`` object of ``topic`` holding offsets ``[start, end)``, and its manifest
    entry."""
    entries = []
    for offset in range(start, end):
        entry = entry_of(offset)
        entry.offset, entry.ingest_ms = offset, ingest_ms(offset)
        entries.append(entry)
    writer = BinWriter("zstd", frame_target_bytes=4096)
    writer.add_entries(topic, entries)
    data = writer.finish()
    span = writer.footer.topics[topic]
    key = f"topics{topic}/{start:020d}.bin"
    await store.put(key, data)
    return replace(
        object_range(start, end, ingest_ms),
        topic=topic,
        object_key=key,
        byte_start=span.position,
        byte_length=span.length,
        object_size=len(data),
        object_crc=crc32c.crc32c(data),
        kind="topic",
    )


async def publish_topic(
    kv: KV,
    keys: Keys,
    hours: int = 3,
    *,
    extra_ms: int = 0,
    objects: ObjectStore | None = None,
    entry_of: Callable[[int], Entry] = plain_entry,
    topic: str = TOPIC,
) -> None:
    """The record of ``topic`` (TOPIC by default), ``hours`` hours of manifest ranges (two per
    hour) and a clock at the end of the last one plus ``extra_ms``; with ``objects``, the
    ranges' real ``.bin`` objects written there (else the manifest names objects that do not
    exist), each offset's entry made by ``entry_of``."""
    await Records(kv, keys).create_topic_if_absent(TopicRecord(topic))
    step = PER_HOUR // 2
    for start in range(0, hours * PER_HOUR, step):
        if objects is None:
            entry = replace(object_range(start, start + step, ingest_ms), topic=topic)
        else:
            entry = await _write_object(objects, start, start + step, entry_of, topic)
        await kv.put(keys.storage_object(topic, start), entry.encode())
    end = hours * PER_HOUR
    clock = TopicClock(offset=end, ingest_ms=H0 + hours * HOUR + extra_ms, broker="b1", epoch=1)
    await kv.put(keys.topic_clock(topic), clock.encode())


async def ensure_table(kv: KV, keys: Keys, topic: str, width_s: int) -> str:
    """The active rendition of ``topic``'s table, creating both if absent."""
    table = await read_table(kv, keys, topic)
    if table is None:
        await create_table(kv, keys, topic, since_ms=H0, width_s=width_s)
        table = await read_table(kv, keys, topic)
    assert table is not None
    if table.active is None:
        await activate(kv, keys, topic, await create_rendition(kv, keys, topic, "test-1"))
        table = await read_table(kv, keys, topic)
        assert table is not None and table.active is not None
    return table.active


async def convert(
    kv: KV,
    keys: Keys,
    store: ObjectStore,
    starts: Sequence[int] | None = None,
    *,
    width_s: int = 3600,
) -> list[tuple[int, int, int, int, list[str]]]:
    """Convert the complete partitions of ``starts`` (None: all complete ones) of TOPIC (its
    table created ``width_s`` wide if absent) with
    the run protocol; ``(start, rows, first, last, final paths)`` of each partition as
    committed."""
    rendition = await ensure_table(kv, keys, TOPIC, width_s)
    plan = await plan_run(kv, keys, TOPIC, rendition)
    chosen = [p for p in plan.partitions if starts is None or p.start_ms in starts]
    done = []
    intent = await begin(
        kv, keys, TOPIC, rendition, [p.start_ms for p in chosen], plan.input_revision
    )
    async with intent:
        for p in chosen:
            offsets = [
                o
                for o in range(p.min_offset, p.end_offset)
                if p.start_ms <= ingest_ms(o) < p.end_ms
            ]
            final = f"{ROOT}{layout.partition_dir(rendition, TOPIC, p.start_ms, plan.width_s)}"
            batches = [rows(offsets, ingest_ms)] if offsets else []
            files = await write_partition(store, intent.staging_path(ROOT, final), batches, SCHEMA)
            outcome = await commit_partition(
                intent, store, ROOT, p.start_ms, plan.width_s, files, "test-1"
            )
            record = outcome.record
            done.append(
                (
                    p.start_ms,
                    record.rows,
                    record.first_offset,
                    record.last_offset,
                    [f.path for f in record.files],
                )
            )
    await advance_frontier(kv, keys, TOPIC, rendition)
    return done


async def minute_table(kv: KV, keys: Keys) -> None:
    """A 60 s table of TOPIC whose since is SINCE, with an active rendition."""
    await create_table(kv, keys, TOPIC, since_ms=SINCE, width_s=60)
    await activate(kv, keys, TOPIC, await create_rendition(kv, keys, TOPIC, "test-1"))


async def publish_clock(kv: KV, keys: Keys, ingest_ms: int) -> None:
    """Move TOPIC's clock to ``ingest_ms`` (its offset stays past every published entry)."""
    found = await kv.get(keys.topic_clock(TOPIC))
    assert found is not None
    clock = TopicClock.decode(found.value, found.key)
    moved = TopicClock(offset=clock.offset, ingest_ms=ingest_ms, broker="b1", epoch=1)
    await kv.put(keys.topic_clock(TOPIC), moved.encode())
