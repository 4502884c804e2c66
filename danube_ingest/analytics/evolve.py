"""Schema evolution: the active rendition follows its topic's subject without a rewrite.

A rendition decodes payloads with one version of the topic's schema subject (its
``schema_ref``). When the subject gets a newer version whose columns *extend* the rendition's,
``evolve_schema`` moves the active rendition's ``schema_ref`` to it (one compare-and-swap on the
rendition record): partitions and tail pieces written from then on have the new columns, the
files already written stay as they are, and every reader sees one schema:

* the Iceberg table's schema gains the columns (and widened types) in the next publish
  (``union_by_name``); older files read the new columns as null;
* ``read_topic`` and the ``danube`` Spark source read every file with the rendition's current
  columns (absent ones null, narrower ones cast).

A newer version *extends* the current one when every current column is still there with the
same type, or widened: ``int`` to ``long``, ``float`` to ``double`` (Iceberg's promotions);
columns may be added. Anything else (a column removed, renamed, or of another type; another
subject) is not followed: the rendition keeps its version, ``SchemaEvolution.refused`` says
why, and a new rendition (``danube-ingest tables rendition``, then ``activate``) rewrites the
table with the new version. A topic converted before it had a decoding subject evolves to its
first version (every column is new).

Conversions of the active rendition and tail steps call it first, so a new version is
followed by the next of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import pyarrow as pa

from danube_ingest.analytics.decode import SchemaDecoder, load_decoder
from danube_ingest.analytics.records import RenditionRecord, TableKeys, TableRecord
from danube_ingest.metadata.errors import CommitStateUnknownError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Put
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore

__all__ = ["WIDENINGS", "SchemaEvolution", "evolve_schema", "extension_refusal"]

log = logging.getLogger(__name__)

#: (narrower, wider) Arrow types a column may be widened between without a rewrite.
WIDENINGS = ((pa.int32(), pa.int64()), (pa.float32(), pa.float64()))


@dataclass(frozen=True, slots=True)
class SchemaEvolution:
    """The outcome of one ``evolve_schema`` that found a newer version."""

    topic: str
    rendition: str
    old_ref: str
    new_ref: str
    added: tuple[str, ...]
    widened: tuple[str, ...]
    refused: str | None
    """Why the rendition keeps ``old_ref`` (None: it moved to ``new_ref``)."""
    record: RenditionRecord
    """The rendition record after the call."""


def _fields(decoder: SchemaDecoder | None) -> dict[str, pa.Field]:
    return {} if decoder is None else {c.field.name: c.field for c in decoder.columns}


def extension_refusal(
    current: SchemaDecoder | None, newer: SchemaDecoder
) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    """Why ``newer``'s columns do not extend ``current``'s (None when they do), with the
    columns it adds and the columns it widens."""
    if current is not None and current.subject != newer.subject:
        return (f"the subject changed from {current.subject!r} to {newer.subject!r}", (), ())
    if current is not None and current.decodes and not newer.decodes:
        return (f"version {newer.decode_version} does not decode payloads", (), ())
    old, new = _fields(current), _fields(newer)
    widened = []
    for name, field in old.items():
        other = new.get(name)
        if other is None:
            return (f"column {name!r} is gone in version {newer.decode_version}", (), ())
        if other.type == field.type:
            continue
        if (field.type, other.type) in WIDENINGS:
            widened.append(name)
            continue
        return (
            f"column {name!r} changes type from {field.type} to {other.type} in version "
            f"{newer.decode_version} (only int to long and float to double widen in place)",
            (),
            (),
        )
    added = tuple(name for name in new if name not in old)
    return None, added, tuple(widened)


async def evolve_schema(kv: KV, keys: Keys, topic: str) -> SchemaEvolution | None:
    """Move the active rendition of ``topic``'s table to its subject's latest version when
    that version extends the rendition's (module docstring). None when there is nothing
    newer (or no table, no active rendition, no subject, or a concurrent change of the
    rendition record won: the next call looks again)."""
    from danube_ingest.analytics.convert import rendition_decoder

    tables = TableKeys(keys, topic)
    table_kv = await kv.get(tables.table())
    if table_kv is None:
        return None
    active = TableRecord.decode(table_kv.value, table_kv.key).active
    if active is None:
        return None
    key = tables.rendition(active)
    stored = await kv.get(key)
    if stored is None:
        return None
    record = RenditionRecord.decode(stored.value, key)
    if record.state != "active":
        return None
    newest = await load_decoder(SchemaRegistry(KVSchemaStore(kv, keys)), topic)
    if newest is None:
        return None
    new_ref = f"{newest.subject}:{newest.decode_version}"
    if new_ref == record.schema_ref:
        return None
    current = await rendition_decoder(kv, keys, topic, record)
    if (
        current is not None
        and current.subject == newest.subject
        and current.decode_version >= newest.decode_version
    ):
        return None  # (the latest version was deleted: keep decoding with ours)
    refused, added, widened = extension_refusal(current, newest)
    if refused is not None:
        log.warning(
            "schema not followed topic=%s rendition=%s schema=%s newer=%s reason=%s",
            topic,
            active,
            record.schema_ref or "-",
            new_ref,
            refused,
        )
        return SchemaEvolution(topic, active, record.schema_ref, new_ref, (), (), refused, record)
    moved = replace(record, schema_ref=new_ref)
    try:
        result = await kv.txn([Compare.unchanged(key, stored)], [Put(key, moved.encode())])
    except CommitStateUnknownError:
        return None  # applied or not: the next call reads which
    if not result.succeeded:
        return None
    log.info(
        "schema evolved topic=%s rendition=%s from=%s to=%s added=%s widened=%s",
        topic,
        active,
        record.schema_ref or "-",
        new_ref,
        ",".join(added) or "-",
        ",".join(widened) or "-",
    )
    return SchemaEvolution(topic, active, record.schema_ref, new_ref, added, widened, None, moved)
