"""Topics as Iceberg tables (``analytics/iceberg.py``): the three topics danube-client produced
into the real daemon (``daemon_support``) converted on a real etcd into an fs warehouse with a
SQLite catalog, then read by name through pyiceberg and through Spark SQL (Iceberg's JDBC
catalog over the same file), and compared with what the producers sent."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from danube_ingest.analytics import catalog_session
from danube_ingest.analytics.commit import advance_since
from danube_ingest.analytics.convert import convert
from danube_ingest.analytics.iceberg import IcebergTarget, identifier, publish
from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.metadata import EtcdKV
from danube_ingest.objects.store import ObjectStore
from tests.analytics.daemon_support import PLAIN, TOPICS, WIDTH_S, Produced, clone
from tests.analytics.tables_support import lose_first_commit_answer
from tests.analytics.test_convert import check_rows

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(400)]


def config_for(base: Path, warehouse: Path) -> BrokerConfig:
    """A broker with ``broker.data_dir: base`` and its fs objects at ``warehouse``."""
    return load_config(None, {"broker.data_dir": str(base), "storage.cloud.root": str(warehouse)})


def target_for(base: Path, warehouse: Path) -> IcebergTarget:
    target = IcebergTarget.from_config(config_for(base, warehouse))
    assert target is not None
    return target


@pytest.fixture
async def kv(produced: Produced) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    yield store
    await store.close()


@pytest.fixture(scope="module")
def spark_factory() -> Iterator[Any]:
    """A Spark session made on first use by ``catalog_session`` (one per module: its jars and
    catalog settings are fixed when the JVM starts)."""
    made: list[Any] = []

    def make(config: BrokerConfig) -> Any:
        if not made:
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            made.append(
                catalog_session(
                    "iceberg-test",
                    master="local[2]",
                    config={"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC"},
                    broker_config=config,
                )
            )
        return made[0]

    yield make
    if made:
        made[0].stop()


async def _convert_all(
    produced: Produced, kv: EtcdKV, warehouse_dir: Path, target: IcebergTarget
) -> Any:
    keys = await clone(kv, produced.prefix)
    objects = ObjectStore("fs", options={"root": str(produced.objects)})
    warehouse = ObjectStore("fs", options={"root": str(warehouse_dir)})
    try:
        for topic in TOPICS:
            await convert(
                kv=kv, keys=keys, objects=objects, warehouse=warehouse, topic=topic,
                width_s=WIDTH_S, iceberg=target,
            )  # fmt: skip
    finally:
        await objects.close()
        await warehouse.close()
    return keys


async def test_topics_read_by_name_as_sent(
    produced: Produced, kv: EtcdKV, tmp_path: Path, spark_factory: Any
) -> None:
    warehouse_dir = tmp_path / "objects"
    target = target_for(tmp_path, warehouse_dir)
    keys = await _convert_all(produced, kv, warehouse_dir, target)
    catalog = target.catalog()
    for topic in TOPICS:
        table = catalog.load_table(identifier(topic))
        rows = table.scan().to_arrow().sort_by("offset").to_pylist()
        check_rows(topic, rows, range(produced.sent[topic]))
        snapshots = table.snapshots()
        assert len(snapshots) == 1
        summary = table.current_snapshot().summary
        assert summary["danube.topic"] == topic and summary["danube.rendition"] == "r1"
        assert summary["danube.first-offset"] == "0"
        assert summary["danube.last-offset"] == str(produced.sent[topic] - 1)
        assert int(summary["danube.frontier-ms"]) > produced.last_minute
        assert summary["added-records"] == str(produced.sent[topic])
        # Files are the table's Parquet where it is, not copies.
        paths = {t.file.file_path for t in table.scan().plan_files()}
        assert paths and all(p.startswith((warehouse_dir / "warehouse/r1").as_uri()) for p in paths)
        assert [f.name for f in table.spec().fields] == ["ingest_hour"]

    # Publishing again commits nothing.
    for topic in TOPICS:
        again = await publish(kv, keys, topic, target)
        assert again is not None and again.snapshot_id is None and again.added == 0

    spark = spark_factory(config_for(tmp_path, warehouse_dir))
    counts = spark.sql(
        "SELECT count(*) AS n, count(DISTINCT offset) AS d, min(offset) AS lo, max(offset) AS hi "
        "FROM danube.default.plain"
    ).collect()[0]
    n = produced.sent[PLAIN]
    assert (counts.n, counts.d, counts.lo, counts.hi) == (n, n, 0, n - 1)
    payloads = spark.sql(
        "SELECT offset, payload, attributes FROM danube.default.json_orders ORDER BY offset"
    ).collect()
    check_rows(
        "/default/json_orders",
        [{**r.asDict(), **_decoded(catalog, "json_orders", r.offset)} for r in payloads],
        range(produced.sent["/default/json_orders"]),
    )
    snapshot = catalog.load_table(("default", "plain")).current_snapshot()
    assert snapshot is not None
    pinned = spark.sql(
        f"SELECT count(*) AS n FROM danube.default.plain VERSION AS OF {snapshot.snapshot_id}"
    ).collect()[0]
    assert pinned.n == n

    # Time travel: the table's first partition leaves it (since moves); a query by name sees
    # the new snapshot at once (the session does not cache tables), and the older snapshot
    # stays readable by id and by time.
    assert snapshot.summary is not None
    since = int(snapshot.summary["danube.since-ms"]) + WIDTH_S * 1000
    await advance_since(kv, keys, PLAIN, since)
    moved = await publish(kv, keys, PLAIN, target)
    assert moved is not None and moved.removed == 1 and moved.snapshot_id is not None
    left = produced.sent[PLAIN] - sum(
        1
        for row in catalog.load_table(identifier(PLAIN)).scan(snapshot_id=snapshot.snapshot_id)
        .to_arrow().column("ingest_time").to_pylist()
        if row.timestamp() * 1000 < since
    )  # fmt: skip
    assert 0 < left < n
    now = spark.sql("SELECT count(*) AS n, min(ingest_time) AS t FROM danube.default.plain")
    row = now.collect()[0]
    assert row.n == left and row.t.timestamp() * 1000 >= since
    stamp = datetime.fromtimestamp(snapshot.timestamp_ms / 1000, UTC).strftime(
        "%Y-%m-%d %H:%M:%S.%f"
    )
    for clause in (f"VERSION AS OF {snapshot.snapshot_id}", f"TIMESTAMP AS OF '{stamp}'"):
        old = spark.sql(f"SELECT count(*) AS n FROM danube.default.plain {clause}")
        assert old.collect()[0].n == n, clause


def _decoded(catalog: Any, table: str, offset: int) -> dict[str, Any]:
    """The decoded columns and ``decode_error`` of one row, read through pyiceberg."""
    from pyiceberg.expressions import EqualTo

    rows = catalog.load_table(("default", table)).scan(row_filter=EqualTo("offset", offset))
    found = rows.to_arrow().to_pylist()
    assert len(found) == 1
    row = found[0]
    return {k: v for k, v in row.items() if k not in ("offset", "payload", "attributes")}


async def test_an_ambiguous_commit_adds_nothing_twice(
    produced: Produced, kv: EtcdKV, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The catalog applies the commit, then the client sees an error (the answer was lost): the
    publish reads the table again and finds its files there."""
    lost = lose_first_commit_answer(monkeypatch)
    warehouse_dir = tmp_path / "objects"
    target = target_for(tmp_path, warehouse_dir)
    await _convert_all(produced, kv, warehouse_dir, target)
    assert lost == [1]
    catalog = target.catalog()
    for topic in TOPICS:
        table = catalog.load_table(identifier(topic))
        assert len(table.snapshots()) == 1, topic
        offsets = table.scan().to_arrow().column("offset").to_pylist()
        assert sorted(offsets) == list(range(produced.sent[topic])), topic
