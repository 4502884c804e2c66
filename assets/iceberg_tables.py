"""``iceberg_tables``: every topic's Apache Iceberg table, one asset for all of them.

Downstream of ``parquet_partitions`` (``topics`` -> ``object_manifest`` ->
``parquet_partitions`` -> ``iceberg_tables``). Materializing it publishes every table
(:func:`danube_ingest.analytics.iceberg.publish`, what ``danube-ingest tables publish`` does
for each topic: the table made to hold exactly its active rendition's committed files and
tail; ``unchanged`` when it already does) and records, per table, its current snapshot, the
frontier it shows, the topic clock, the lag, and the data files and rows its snapshot summary
counts. A table whose publish fails is named in the run's failure, after the others are
published. With ``iceberg.catalog: off`` there are no tables and the run says so.

Runs are rarely needed: every conversion publishes its table, and ``iceberg_tail_sensor``
(``assets/tails.py``) publishes each table whose tail moved and then reports a runless
materialization of this asset with the same per-table metadata (:func:`table_metadata`), so the
asset's last materialization says when a table last changed. One asset for every table, as for
the Parquet tables: asset definitions are fixed when the code location loads.
"""

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetKey,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)

from assets.parquet import _run_etcd, parquet_partitions
from danube_ingest.analytics.iceberg import (
    IcebergPublishError,
    IcebergTarget,
    PublishResult,
    freshness,
    identifier,
    publish,
)
from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.records import Records
from pipelines.resources import EtcdResource, ObjectStoreResource

ICEBERG_TABLES = AssetKey("iceberg_tables")
#: Tables listed in the metadata's markdown table (the totals always cover every table).
MAX_LISTED = 200
#: What the asset records when ``iceberg.catalog`` is ``off`` (or the store is ``memory``).
CATALOG_OFF = (
    "no Iceberg tables: iceberg.catalog is off, or the object store is memory (no other "
    "process could read its files)"
)


@dataclass(frozen=True, slots=True)
class TableState:
    """What one topic's Iceberg table shows (``table_states``)."""

    topic: str
    table: str
    """``catalog.namespace.name``."""
    snapshot_id: int | None
    """The current snapshot (None: the table has none, or does not exist)."""
    frontier_ms: int | None
    """``iceberg.Freshness.frontier_ms``: entries with an ingest time below it are in it."""
    clock_ms: int | None
    lag_ms: int | None
    data_files: int | None
    """``total-data-files`` of the current snapshot's summary (None: no snapshot)."""
    rows: int | None
    """``total-records`` of the current snapshot's summary."""


def _snapshot_sync(target: IcebergTarget, topic: str) -> tuple[int | None, int | None, int | None]:
    """``(snapshot id, data files, rows)`` of the table's current snapshot (its summary's
    totals: no manifest is read)."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        table = target.catalog().load_table(identifier(topic))
    except NoSuchTableError:
        return None, None, None
    snapshot = table.current_snapshot()
    if snapshot is None:
        return None, None, None
    summary = snapshot.summary

    def total(name: str) -> int | None:
        value = None if summary is None else summary.get(name)
        return int(value) if value is not None and value.isdigit() else None

    return snapshot.snapshot_id, total("total-data-files"), total("total-records")


async def table_states(
    kv: KV, keys: Keys, target: IcebergTarget, topics: Iterable[str]
) -> list[TableState]:
    """The state of each of ``topics``' tables (``iceberg.freshness`` and the current snapshot's
    summary, read one after the other); topics without an active table are left out."""
    states = []
    for topic in topics:
        fresh = await freshness(kv, keys, topic, target)
        if fresh is None:
            continue
        snapshot_id, files, rows = await asyncio.to_thread(_snapshot_sync, target, topic)
        states.append(
            TableState(
                topic,
                fresh.table,
                snapshot_id,
                fresh.frontier_ms,
                fresh.clock_ms,
                fresh.lag_ms,
                files,
                rows,
            )
        )
    return states


def _when(ms: int | None) -> str:
    return "-" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _text(value: object) -> str:
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def table_metadata(
    states: list[TableState], notes: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A materialization's metadata for ``states``: totals, and ``tables_detail``, one row per
    table (table, current snapshot id, frontier, topic clock, lag, data files, rows, and the
    ``notes`` of its topic: what this publish did)."""
    notes = notes or {}
    header = (
        "| table | snapshot | frontier | topic clock | lag s | data files | rows | this time |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {s.table} | {_text(s.snapshot_id)} | {_when(s.frontier_ms)} | {_when(s.clock_ms)} | "
        f"{'-' if s.lag_ms is None else f'{s.lag_ms / 1000:.0f}'} | {_text(s.data_files)} | "
        f"{_text(s.rows)} | {_text(notes.get(s.topic))} |"
        for s in states[:MAX_LISTED]
    ]
    more = len(states) - MAX_LISTED
    lags = [s.lag_ms for s in states if s.lag_ms is not None]
    return {
        "tables": len(states),
        "data_files": sum(s.data_files or 0 for s in states),
        "rows": sum(s.rows or 0 for s in states),
        "max_lag_s": max(lags, default=0) / 1000,
        "tables_detail": MetadataValue.md(
            "\n".join([header, *rows, *([f"\n({more} more)"] if more > 0 else [])])
            if rows
            else "none"
        ),
    }


def _note(result: PublishResult) -> str:
    if result.snapshot_id is None:
        return "unchanged"
    return f"snapshot {result.snapshot_id} (+{result.added} -{result.removed} files)"


@asset(
    deps=[parquet_partitions],
    group_name="analytics",
    kinds={"iceberg"},
    description=(
        "Every topic's Apache Iceberg table (catalog.namespace.topic): materializing publishes "
        "each one (iceberg.publish, as `danube-ingest tables publish`); the metadata show each "
        "table's current snapshot, frontier, topic clock, lag, data files and rows. "
        "iceberg_tail_sensor records a runless materialization whenever it moved a table's tail."
    ),
)
def iceberg_tables(
    context: AssetExecutionContext, etcd: EtcdResource, objects: ObjectStoreResource
) -> MaterializeResult[None]:
    """``iceberg.publish`` of every topic, then each table's state as metadata. ``Failure``
    naming each table whose publish failed, once the others are published."""
    target = IcebergTarget.from_config(objects.broker_config())
    if target is None:
        context.log.info(CATALOG_OFF)
        return MaterializeResult(metadata={"tables": 0, "note": CATALOG_OFF})

    async def work(kv: KV, keys: Keys) -> tuple[list[TableState], dict[str, str], dict[str, str]]:
        notes: dict[str, str] = {}
        failed: dict[str, str] = {}
        for topic in sorted(r.name for r in await Records(kv, keys).list_topics()):
            try:
                result = await publish(kv, keys, topic, target)
            except IcebergPublishError as exc:
                failed[topic] = str(exc)
                continue
            if result is not None:
                notes[topic] = _note(result)
        return await table_states(kv, keys, target, notes), notes, failed

    states, notes, failed = _run_etcd(etcd, work)
    for s in states:
        context.log.info(f"table={s.table} {notes[s.topic]} frontier_ms={s.frontier_ms}")
    metadata = {
        **table_metadata(states, notes),
        "published": sum(1 for n in notes.values() if n != "unchanged"),
        "unchanged": sum(1 for n in notes.values() if n == "unchanged"),
        "failed": len(failed),
    }
    if failed:
        names = {t: ".".join((target.name, *identifier(t))) for t in failed}
        for topic, error in failed.items():
            context.log.error(f"table={names[topic]} not published: {error}")
        raise Failure(
            f"{len(failed)} of {len(failed) + len(notes)} Iceberg tables could not be published "
            f"(the others are): {', '.join(names[t] for t in failed)}. "
            + " ".join(f"{names[t]}: {e}" for t, e in failed.items()),
            metadata={
                **metadata,
                "failed_tables": MetadataValue.md(
                    "| table | error |\n|---|---|\n"
                    + "\n".join(f"| {names[t]} | {_text(e)} |" for t, e in failed.items())
                ),
            },
        )
    return MaterializeResult(metadata=metadata)


__all__ = ["ICEBERG_TABLES", "TableState", "iceberg_tables", "table_metadata", "table_states"]
