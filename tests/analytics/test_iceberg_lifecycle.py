"""The Iceberg table follows the table's lifecycle (``analytics/iceberg.py``): a rendition
handed over replaces the table's files in one snapshot, collection never removes files the
current snapshot names, a moved ``since`` leaves the table before its files go, and an
unreachable catalog is a clear, retriable error. Real etcd, an fs warehouse, a SQLite catalog."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from danube_ingest.analytics.commit import advance_since
from danube_ingest.analytics.errors import AnalyticsError
from danube_ingest.analytics.iceberg import (
    FRESHNESS_SLACK_S,
    IcebergPublishError,
    IcebergTarget,
    _publish_sync,
    _wanted,
    check_table,
    freshness,
    identifier,
    maintain,
    publish,
)
from danube_ingest.analytics.layout import topic_prefix
from danube_ingest.analytics.lifecycle import collect
from danube_ingest.analytics.renditions import activate, create_rendition, create_table
from danube_ingest.config import load_config
from danube_ingest.errors import ConfigError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import LocalPostgres, MotoServer

from .tables_support import (
    ROOT,
    T0,
    TOPIC,
    ingest_ms_of,
    lose_first_commit_answer,
    publish_input,
    run_conversion,
)

pytestmark = [pytest.mark.etcd]

TEN_MIN = 600_000
CLOCK = TopicClock(offset=300, ingest_ms=T0 + 3 * TEN_MIN, broker="b1", epoch=1)


def target(tmp_path: Path) -> IcebergTarget:
    config = load_config(
        None,
        {"broker.data_dir": str(tmp_path), "storage.cloud.root": str(tmp_path / "objects")},
    )
    found = IcebergTarget.from_config(config)
    assert found is not None
    return found


async def active_table(kv: EtcdKV, keys: Keys, store: ObjectStore) -> str:
    """TOPIC's table: 300 offsets over three 10-minute partitions, converted into ``store`` as
    the active rendition ``r1`` (not published)."""
    await publish_input(kv, keys, [120, 300], CLOCK)
    await create_table(kv, keys, TOPIC, since_ms=T0, width_s=600)
    rendition = await create_rendition(kv, keys, TOPIC, "v1")
    await run_conversion(kv, keys, store, rendition)
    await activate(kv, keys, TOPIC, rendition)
    return rendition


def offsets(found: IcebergTarget) -> list[int]:
    table = found.catalog().load_table(("default", "orders"))
    return sorted(table.scan().to_arrow().column("offset").to_pylist())


def file_paths(found: IcebergTarget) -> set[str]:
    table = found.catalog().load_table(("default", "orders"))
    return {task.file.file_path for task in table.scan().plan_files()}


@pytest.fixture(params=["fs", pytest.param("s3", marks=pytest.mark.s3)])
def placed(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[IcebergTarget, ObjectStore]:
    """The catalog target and the object store of a broker on fs, or on s3 (moto) with its
    credentials in the environment, as the docs tell users to give them."""
    if request.param == "fs":
        return target(tmp_path), ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    server: MotoServer = request.getfixturevalue("s3_server")
    bucket = server.create_bucket(f"ice-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_access_key)
    config = load_config(
        None,
        {
            "broker.data_dir": str(tmp_path),
            "storage.cloud": {
                "backend": "s3",
                "bucket": bucket,
                "root": "/cluster-a",
                "endpoint": server.endpoint,
                "region": server.region,
            },
        },
    )
    found = IcebergTarget.from_config(config)
    assert found is not None and found.location == f"s3://{bucket}/cluster-a/"
    return found, ObjectStore("s3", options=server.options(bucket, "/cluster-a"))


async def test_handover_collection_and_since(
    etcd_kv: EtcdKV, keys: Keys, placed: tuple[IcebergTarget, ObjectStore]
) -> None:
    found, store = placed
    r1 = await active_table(etcd_kv, keys, store)
    first = await publish(etcd_kv, keys, TOPIC, found)
    assert first is not None and (first.added, first.removed) == (3, 0)
    assert offsets(found) == list(range(300))

    # A new rendition built beside it: the Iceberg table does not see it before activation.
    r2 = await create_rendition(etcd_kv, keys, TOPIC, "v2")
    await run_conversion(etcd_kv, keys, store, r2, converter_version="v2")
    unchanged = await publish(etcd_kv, keys, TOPIC, found)
    assert unchanged is not None and unchanged.snapshot_id is None
    stale = await _wanted(etcd_kv, keys, TOPIC, found)  # a publisher's view before the handover
    assert stale is not None and stale.rendition == r1
    await activate(etcd_kv, keys, TOPIC, r2)
    # Collection publishes first: the draining r1's files leave the table, then go.
    result = await collect(etcd_kv, keys, store, topic=TOPIC, iceberg=found)
    assert result.collected == [(TOPIC, r1)]
    # The first snapshot still holds r1's files: collection leaves them, time travel reads
    # them (a query that began before the handover too); maintenance deletes them later.
    r1_keys = await store.list(topic_prefix(ROOT, r1, TOPIC))
    assert (result.files_deleted, result.files_kept) == (0, 3) and len(r1_keys) == 3
    before = found.catalog().load_table(("default", "orders")).scan(snapshot_id=first.snapshot_id)
    assert sorted(before.to_arrow().column("offset").to_pylist()) == list(range(300))
    table = found.catalog().load_table(("default", "orders"))
    snapshot = table.current_snapshot()
    assert snapshot is not None and snapshot.summary is not None
    assert snapshot.summary["danube.rendition"] == r2
    assert snapshot.summary["danube.converter"] == "v2"
    assert (snapshot.summary["deleted-data-files"], snapshot.summary["added-data-files"]) == (
        "3",
        "3",
    )
    assert len(table.snapshots()) == 2  # the handover is one snapshot
    assert all(f"/{r2}/" in path for path in file_paths(found))
    assert offsets(found) == list(range(300))
    # The slow publisher commits its older view only now: it must not bring r1 (whose files
    # are gone) back.
    late = await asyncio.to_thread(_publish_sync, found, TOPIC, stale, identifier(TOPIC))
    assert late.snapshot_id is None
    assert all(f"/{r2}/" in path for path in file_paths(found))
    assert offsets(found) == list(range(300))

    # since moves: the first partition leaves the table.
    await advance_since(etcd_kv, keys, TOPIC, T0 + TEN_MIN)
    moved = await publish(etcd_kv, keys, TOPIC, found)
    assert moved is not None and (moved.added, moved.removed) == (0, 1)
    assert offsets(found) == [o for o in range(300) if ingest_ms_of(o) >= T0 + TEN_MIN]

    # Once the snapshots holding r1's files expire, maintenance deletes them, and only them.
    r2_keys = await store.list(topic_prefix(ROOT, r2, TOPIC))
    later = int(time.time() * 1000) + 2 * 3600 * 1000
    tails = (etcd_kv, keys, ROOT)
    kept = await maintain(found, TOPIC, now_ms=later, tails=tails)
    assert kept is not None and await store.list(topic_prefix(ROOT, r1, TOPIC)) == r1_keys
    swept = await maintain(found, TOPIC, now_ms=later, tails=tails, max_snapshot_age_s=0)
    assert swept is not None and swept.files_deleted >= 3
    assert await store.list(topic_prefix(ROOT, r1, TOPIC)) == []
    assert await store.list(topic_prefix(ROOT, r2, TOPIC)) == r2_keys
    assert offsets(found) == [o for o in range(300) if ingest_ms_of(o) >= T0 + TEN_MIN]
    await store.close()


def metadata_files(found: IcebergTarget) -> set[str]:
    """Every file under the table's metadata directory (paths without the scheme)."""
    from pyarrow import fs as pafs
    from pyiceberg.io.pyarrow import PyArrowFileIO

    table = found.catalog().load_table(("default", "orders"))
    assert isinstance(table.io, PyArrowFileIO)
    scheme, netloc, root = PyArrowFileIO.parse_location(table.location())
    selector = pafs.FileSelector(f"{root}/metadata", recursive=True)
    infos = table.io.fs_by_scheme(scheme, netloc).get_file_info(selector)
    return {i.path for i in infos if i.type == pafs.FileType.File}


async def test_maintenance_expires_snapshots_and_deletes_only_orphan_metadata(
    etcd_kv: EtcdKV, keys: Keys, placed: tuple[IcebergTarget, ObjectStore]
) -> None:
    from danube_ingest.analytics.iceberg import _referenced

    found, store = placed
    await active_table(etcd_kv, keys, store)
    await publish(etcd_kv, keys, TOPIC, found)
    r2 = await create_rendition(etcd_kv, keys, TOPIC, "v2")
    await run_conversion(etcd_kv, keys, store, r2, converter_version="v2")
    await activate(etcd_kv, keys, TOPIC, r2)
    await publish(etcd_kv, keys, TOPIC, found)
    await advance_since(etcd_kv, keys, TOPIC, T0 + TEN_MIN)
    await publish(etcd_kv, keys, TOPIC, found)
    table = found.catalog().load_table(("default", "orders"))
    old = [s.snapshot_id for s in table.snapshots()]
    assert len(old) == 3
    current = table.current_snapshot()
    assert current is not None and current.snapshot_id == old[-1]
    # A crashed publisher's manifest: written, never committed.
    stray = f"{table.location()}/metadata/{uuid.uuid4()}-m0.avro"
    with table.io.new_output(stray).create() as out:
        out.write(b"never committed")
    before = metadata_files(found)
    wanted = [o for o in range(300) if ingest_ms_of(o) >= T0 + TEN_MIN]

    # Now: every snapshot but the current one is past a zero age; the stray file is young.
    first = await maintain(found, TOPIC, max_snapshot_age_s=0)
    assert first is not None
    assert (first.snapshots_expired, first.snapshots_kept) == (2, 1)
    table = found.catalog().load_table(("default", "orders"))
    assert [s.snapshot_id for s in table.snapshots()] == [old[-1]]
    assert all(table.snapshot_by_id(i) is None for i in old[:-1])  # time travel: gone
    assert any(path.endswith(stray.rsplit("/", 1)[1]) for path in metadata_files(found))
    assert offsets(found) == wanted

    # Two hours on: the expired snapshots' manifests and the stray file are past the grace.
    later = int(time.time() * 1000) + 2 * 3600 * 1000
    second = await maintain(found, TOPIC, now_ms=later)
    assert second is not None and second.files_deleted >= 3
    left = metadata_files(found)
    table = found.catalog().load_table(("default", "orders"))
    assert left == _referenced(table)  # nothing unreferenced is left, nothing referenced went
    assert not any(stray.endswith(p.rsplit("/", 1)[1]) for p in left)
    # (New metadata versions came with the expiry; manifests and manifest lists only went.)
    assert {p for p in left if p.endswith(".avro")} < {p for p in before if p.endswith(".avro")}
    assert offsets(found) == wanted  # data files are never maintenance's to delete
    assert table.properties["write.metadata.delete-after-commit.enabled"] == "true"
    assert await check_table(etcd_kv, keys, TOPIC, found) == []
    # Publishing goes on from the maintained table.
    await advance_since(etcd_kv, keys, TOPIC, T0 + 2 * TEN_MIN)
    moved = await publish(etcd_kv, keys, TOPIC, found)
    assert moved is not None and (moved.added, moved.removed) == (0, 1)
    await store.close()


async def test_freshness_is_the_clock_minus_what_the_table_shows(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    found = target(tmp_path)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    assert await freshness(etcd_kv, keys, TOPIC, found) is None  # no table yet
    await active_table(etcd_kv, keys, store)
    # Committed in etcd, not published: the table shows nothing.
    before = await freshness(etcd_kv, keys, TOPIC, found)
    assert before is not None and before.table == "danube.default.orders"
    assert (before.frontier_ms, before.published_ms) == (None, T0 + 3 * TEN_MIN)
    assert before.lag_ms is None and before.stale()
    await publish(etcd_kv, keys, TOPIC, found)
    fresh = await freshness(etcd_kv, keys, TOPIC, found)
    assert fresh is not None and fresh.frontier_ms == T0 + 3 * TEN_MIN == fresh.clock_ms
    assert fresh.lag_ms == 0 and not fresh.stale()
    # The clock runs on, no conversion: stale once a partition and the slack have passed.
    allowed = TEN_MIN + round(FRESHNESS_SLACK_S * 1000)
    for ahead, stale in ((allowed, False), (allowed + 1, True)):
        clock = TopicClock(offset=300, ingest_ms=T0 + 3 * TEN_MIN + ahead, broker="b1", epoch=1)
        await etcd_kv.put(keys.topic_clock(TOPIC), clock.encode())
        later = await freshness(etcd_kv, keys, TOPIC, found)
        assert later is not None and later.lag_ms == ahead and later.stale() is stale
    await store.close()


async def test_maintenance_refuses_bad_settings_and_skips_missing_tables(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    found = target(tmp_path)
    assert await maintain(found, TOPIC) is None
    with pytest.raises(ConfigError, match="min_snapshots"):
        await maintain(found, TOPIC, min_snapshots=0)


async def test_an_unreachable_catalog_is_a_clear_retriable_error(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await active_table(etcd_kv, keys, store)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the catalog's directory would be")
    config = load_config(
        None,
        {
            "broker.data_dir": str(tmp_path),
            "storage.cloud.root": str(tmp_path / "objects"),
            "iceberg.uri": f"sqlite:///{blocked}/catalog.db",
        },
    )
    found = IcebergTarget.from_config(config)
    assert found is not None
    with pytest.raises(IcebergPublishError, match="publishing /default/orders") as caught:
        await publish(etcd_kv, keys, TOPIC, found)
    assert caught.value.retriable
    assert isinstance(caught.value, AnalyticsError)
    # Nothing was lost: with a reachable catalog the same table publishes whole.
    good = target(tmp_path)
    done = await publish(etcd_kv, keys, TOPIC, good)
    assert done is not None and done.added == 3
    assert offsets(good) == list(range(300))
    await store.close()


async def test_the_check_finds_a_file_added_behind_its_back(
    etcd_kv: EtcdKV, keys: Keys, tmp_path: Path
) -> None:
    """A copy of a published file added to the table by someone else: the check names the
    offsets found twice and the file etcd does not know; publishing removes it again."""
    found = target(tmp_path)
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await active_table(etcd_kv, keys, store)
    await publish(etcd_kv, keys, TOPIC, found)
    assert await check_table(etcd_kv, keys, TOPIC, found) == []
    # Two more partitions complete, both empty (an idle topic): no snapshot for them.
    later = TopicClock(offset=300, ingest_ms=T0 + 5 * TEN_MIN, broker="b1", epoch=1)
    await etcd_kv.put(keys.topic_clock(TOPIC), later.encode())
    await run_conversion(etcd_kv, keys, store, "r1")
    idle = await publish(etcd_kv, keys, TOPIC, found)
    assert idle is not None and idle.snapshot_id is None and idle.frontier_ms == T0 + 5 * TEN_MIN
    assert len(found.catalog().load_table(("default", "orders")).snapshots()) == 1
    assert await check_table(etcd_kv, keys, TOPIC, found) == []

    original = sorted(file_paths(found))[0]
    copy = original.replace(".parquet", "-copy.parquet")
    Path(copy.removeprefix("file://")).write_bytes(
        Path(original.removeprefix("file://")).read_bytes()
    )
    table = found.catalog().load_table(("default", "orders"))
    table.add_files([copy])
    problems = [f.problem for f in await check_table(etcd_kv, keys, TOPIC, found)]
    assert any("are in two files" in p for p in problems), problems
    assert any("not the table's in etcd" in p for p in problems), problems
    fixed = await publish(etcd_kv, keys, TOPIC, found)
    assert fixed is not None and (fixed.added, fixed.removed) == (0, 1)
    assert await check_table(etcd_kv, keys, TOPIC, found) == []
    assert offsets(found) == list(range(300))
    await store.close()


SPARK_COUNT = """
import sys
from danube_ingest.analytics import catalog_session
from danube_ingest.config import load_config
from danube_ingest.errors import ConfigError

spark = catalog_session("pg-test", master="local[1]", config={"spark.ui.enabled": "false"},
                        broker_config=load_config(sys.argv[1]))
row = spark.sql("SELECT count(*) AS n, count(DISTINCT offset) AS d FROM danube.default.orders")
print("ROW", *row.first())
"""


@pytest.mark.slow
@pytest.mark.spark
async def test_a_postgresql_catalog_is_published_once_and_read_by_spark(
    etcd_kv: EtcdKV,
    keys: Keys,
    tmp_path: Path,
    postgres_server: LocalPostgres,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The catalog for several machines: PostgreSQL. A publish whose commit answer is lost
    adds nothing twice; Spark reads the table by name through Iceberg's JDBC catalog."""
    database = f"c{uuid.uuid4().hex[:10]}"
    postgres_server.create_database(database)
    config_file = tmp_path / "broker.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "broker": {"data_dir": str(tmp_path)},
                "storage": {"cloud": {"backend": "fs", "root": str(tmp_path / "objects")}},
                "iceberg": {"uri": postgres_server.url_of(database)},
            }
        )
    )
    found = IcebergTarget.from_config(load_config(config_file))
    assert found is not None and found.uri.startswith("postgresql+psycopg2://")
    store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
    await active_table(etcd_kv, keys, store)
    await store.close()

    lost = lose_first_commit_answer(monkeypatch)
    done = await publish(etcd_kv, keys, TOPIC, found)
    assert lost == [1]
    assert done is not None and done.snapshot_id is None  # (the lost commit had landed)
    table = found.catalog().load_table(("default", "orders"))
    assert len(table.snapshots()) == 1
    assert offsets(found) == list(range(300))

    spark = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", SPARK_COUNT, str(config_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    assert spark.returncode == 0, spark.stderr[-3000:]
    [row] = [line for line in spark.stdout.splitlines() if line.startswith("ROW ")]
    assert row == "ROW 300 300"
