"""``danube-ingest tables`` and ``tables convert`` as child processes, on the real daemon's
objects (``tests.analytics.daemon_support``) and a real etcd; the rendition lifecycle
(``tables rendition``, ``activate``, ``collect``) through ``danube_ingest.cli.main``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from danube_ingest.analytics.convert import StoreSpec
from danube_ingest.analytics.layout import partition_end
from danube_ingest.analytics.read import read_topic
from danube_ingest.analytics.renditions import hold, read_rendition
from danube_ingest.analytics.session import spark_session
from danube_ingest.cli import main
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.records import Records, TopicRecord
from tests.analytics.daemon_support import (
    AVRO,
    JSON_T,
    PAYLOADS,
    PLAIN,
    TOPICS,
    WIDTH_S,
    Produced,
    clone,
)

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
#: The Spark child's master: two local threads, no UI (as the job tests run it).
SPARK_SUBMIT_ARGS = "--master local[2] --conf spark.ui.enabled=false pyspark-shell"


def _own_objects(produced: Produced, tmp_path: Path) -> Path:
    """A copy of the daemon's objects: the warehouse lives in the objects store, and the
    session's ``produced`` objects are shared with other tests."""
    copy = tmp_path / "objects"
    shutil.copytree(produced.objects, copy)
    return copy


def _clone(produced: Produced) -> Keys:
    async def run() -> Keys:
        kv = await EtcdKV.connect([produced.endpoint], timeout=5.0)
        try:
            return await clone(kv, produced.prefix)
        finally:
            await kv.close()

    return asyncio.run(run())


def _config(produced: Produced, keys: Keys, objects: Path, tmp_path: Path) -> Path:
    config = tmp_path / "broker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "broker": {"data_dir": str(tmp_path / "data")},  # (the Iceberg catalog's)
                "etcd": {"endpoints": [produced.endpoint], "prefix": keys.prefix},
                "storage": {"cloud": {"backend": "fs", "root": str(objects)}},
            }
        )
    )
    return config


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "danube_ingest.cli", *args],
        capture_output=True,
        text=True,
        # A Spark child starts a JVM: generous on a loaded 2-core machine.
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.slow
def test_tables_convert_then_list(produced: Produced, tmp_path: Path) -> None:
    keys = _clone(produced)
    objects = _own_objects(produced, tmp_path)
    config = _config(produced, keys, objects, tmp_path)
    upper = partition_end(produced.last_minute, WIDTH_S)

    empty = _cli("tables", "--config", str(config))
    assert empty.returncode == 0, empty.stderr
    assert "no tables" in empty.stdout

    done = _cli("tables", "convert", "--config", str(config), "--topic", JSON_T, "--width-s", "60")
    assert done.returncode == 0, done.stderr
    assert f"topic {JSON_T} rendition r1:" in done.stdout
    assert f"upper {_iso(upper)}" in done.stdout
    assert "committed" in done.stdout
    assert "iceberg table danube.default.json_orders: snapshot " in done.stdout
    assert (tmp_path / "data" / "iceberg" / "catalog.db").is_file()

    files = sorted((objects / "warehouse" / "r1").rglob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert sorted(r["offset"] for r in rows) == list(range(produced.sent[JSON_T]))
    assert all(r["payload"] == PAYLOADS[JSON_T](r["offset"]) for r in rows)

    listed = _cli("tables", "--config", str(config))
    assert listed.returncode == 0, listed.stderr
    assert f"table {JSON_T}: width 60 s, active r1, since " in listed.stdout
    assert f"upper {_iso(upper)}" in listed.stdout
    assert "rendition r1: active" in listed.stdout
    assert f"last {_iso(produced.last_minute)}" in listed.stdout
    assert PLAIN not in listed.stdout  # no table yet

    alone = _cli("tables", "--config", str(config), "--topic", PLAIN)
    assert alone.stdout.strip() == f"topic {PLAIN}: no table"

    early = _cli(
        "tables", "convert", "--config", str(config), "--topic", JSON_T, "--start-ms", str(upper)
    )
    assert early.returncode == 1
    assert f"partition {upper}" in early.stderr and "not complete" in early.stderr

    # The daemon is stopped: the clock cannot pass the end of the current minute.
    waited = _cli("tables", "convert", "--config", str(config), "--topic", JSON_T, "--wait", "1.5")
    assert waited.returncode == 1
    assert f"{JSON_T} is not complete up to" in waited.stderr and "its clock is at" in waited.stderr


@pytest.mark.slow
@pytest.mark.spark
def test_tables_convert_engine_spark_writes_the_local_engines_files(
    produced: Produced, tmp_path: Path
) -> None:
    """``tables convert --engine spark`` as a child process (its own local[2] Spark, tasks
    opening the fs store from the config) commits the same files as ``--engine local``."""
    trees = {}
    for engine in ("local", "spark"):
        keys = _clone(produced)
        objects = _own_objects(produced, tmp_path / engine)
        config = _config(produced, keys, objects, tmp_path / engine)
        env = {"PYSPARK_SUBMIT_ARGS": SPARK_SUBMIT_ARGS}
        args = ("--topic", AVRO, "--width-s", "60", "--engine", engine)
        done = _cli("tables", "convert", "--config", str(config), *args, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"topic {AVRO} rendition r1:" in done.stdout and "committed" in done.stdout
        assert not list((objects / "warehouse" / "_staging").rglob("*.parquet"))
        trees[engine] = _tree(objects / "warehouse" / "r1")
    assert trees["spark"] == trees["local"]
    rows = [r for p in trees["local"] for r in pq.read_table(tmp_path / "local" / "objects"
            / "warehouse" / "r1" / p).to_pylist()]  # fmt: skip
    assert sorted(r["offset"] for r in rows) == list(range(produced.sent[AVRO]))


def test_rendition_activate_collect_through_the_cli(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from danube_ingest.objects.store import ObjectStore
    from tests.pipelines.parquet_support import ROOT as WAREHOUSE
    from tests.pipelines.parquet_support import TOPIC, publish_topic

    objects_dir = tmp_path / "objects"

    async def setup() -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(objects_dir)})
        try:
            await publish_topic(kv, keys, hours=2, extra_ms=1, objects=store)
        finally:
            await store.close()
            await kv.close()

    asyncio.run(setup())
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["tables", *args, *common])
        out, err = capsys.readouterr()
        return code, out, err

    assert run("convert", "--topic", TOPIC)[0] == 0
    r1_files = sorted((objects_dir / WAREHOUSE / "r1").rglob("*.parquet"))
    assert r1_files
    code, out, _ = run("rendition", "--topic", TOPIC)
    assert (code, out) == (0, "r2\n")
    code, _, err = run("activate", "--topic", TOPIC, "--rendition", "r2")
    assert code == 1
    assert "activation refused" in err and "behind the table's upper" in err and "r2" in err
    code, out, _ = run("convert", "--topic", TOPIC, "--rendition", "r2")
    assert code == 0 and "rendition r2: 2 partitions" in out
    code, out, _ = run("activate", "--topic", TOPIC, "--rendition", "r2")
    assert code == 0 and "active r2" in out

    async def collect_while_held() -> tuple[int, str]:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        try:
            async with hold(kv, keys, TOPIC, "r1"):
                code, out, _ = await asyncio.to_thread(run, "collect", "--topic", TOPIC)
            return code, out
        finally:
            await kv.close()

    code, out = asyncio.run(collect_while_held())
    assert code == 0 and f"held {TOPIC} rendition r1" in out
    assert "renditions_collected=0 rendition_files_deleted=0 renditions_held=1" in out
    assert all(f.exists() for f in r1_files)
    code, out, _ = run("collect", "--grace-s", "60")
    assert code == 0 and f"collected {TOPIC} rendition r1" in out
    # The Iceberg table's first snapshot (published by convert) still holds r1's files: they
    # stay for time travel until iceberg_maintenance finds no snapshot holding them.
    assert "renditions_collected=1 rendition_files_deleted=0 renditions_held=0 " in out
    assert f"rendition_files_kept={len(r1_files)}" in out
    assert all(f.exists() for f in r1_files)

    async def maintain_all() -> None:
        from danube_ingest.analytics.iceberg import IcebergTarget, maintain
        from danube_ingest.config import load_config

        target = IcebergTarget.from_config(load_config(None, {"broker.data_dir": str(tmp_path)}))
        assert target is not None
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        try:
            later = int(time.time() * 1000) + 2 * 3600 * 1000
            tails = (kv, keys, WAREHOUSE)
            await maintain(target, TOPIC, now_ms=later, max_snapshot_age_s=0, tails=tails)
        finally:
            await kv.close()

    asyncio.run(maintain_all())
    assert not any(f.exists() for f in r1_files)
    assert list((objects_dir / WAREHOUSE / "r2").rglob("*.parquet"))

    async def state(name: str) -> str:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        try:
            record = await read_rendition(kv, keys, TOPIC, name)
            assert record is not None
            return record.state
        finally:
            await kv.close()

    assert asyncio.run(state("r1")) == "collected"
    assert asyncio.run(state("r2")) == "active"
    # A rendition that keeps rows which do not decode apart (docs/iceberg.md#dead-letters).
    assert run("rendition", "--topic", TOPIC, "--dead-letters", "table")[:2] == (0, "r3\n")
    code, out, _ = run("--topic", TOPIC)
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if "rendition r" in line}
    assert code == 0 and "dead letters table" in lines["rendition r3"], out
    assert "dead letters kept" in lines["rendition r2"], out


def test_lifecycle_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tables", "collect", "--help"])
    assert "(default: 3600" in capsys.readouterr().out


def _keys_under(etcd_server: str, keys: Keys) -> list[str]:
    async def run() -> list[str]:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        try:
            return [e.key for e in await kv.get_prefix(f"{keys.prefix}/")]
        finally:
            await kv.close()

    return asyncio.run(run())


def _create_topic(etcd_server: str, keys: Keys, topic: str, *, reliable: bool) -> None:
    async def run() -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        try:
            await Records(kv, keys).create_topic_if_absent(TopicRecord(topic, reliable=reliable))
        finally:
            await kv.close()

    asyncio.run(run())


def test_convert_refuses_a_missing_topic_unless_asked_for_a_future_one(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]
    _create_topic(etcd_server, keys, "/default/orders", reliable=True)
    before = _keys_under(etcd_server, keys)

    code = main(["tables", "convert", "--topic", "/default/ordrs", "--wait", "30", *common])
    err = capsys.readouterr().err
    assert code == 2
    assert "topic /default/ordrs does not exist" in err and "--create-for-future-topic" in err
    assert _keys_under(etcd_server, keys) == before  # nothing written

    future = ["--topic", "/default/later", "--create-for-future-topic", *common]
    assert main(["tables", "convert", *future]) == 0
    assert f"{keys.prefix}/tables/default/later/table" in _keys_under(etcd_server, keys)


def test_convert_refuses_a_non_reliable_topic_at_once(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]
    _create_topic(etcd_server, keys, "/default/live", reliable=False)
    before = _keys_under(etcd_server, keys)

    started = time.monotonic()
    code = main(["tables", "convert", "--topic", "/default/live", "--wait", "30", *common])
    assert time.monotonic() - started < 10  # not the whole --wait
    err = capsys.readouterr().err
    assert code == 2
    assert "topic /default/live is non-reliable" in err and "never stored" in err
    assert _keys_under(etcd_server, keys) == before


def test_convert_wait_shows_progress(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No daemon moves the clock: the wait runs out, telling where it is every 2 s."""
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]
    _create_topic(etcd_server, keys, "/default/quiet", reliable=True)
    code = main(["tables", "convert", "--topic", "/default/quiet", "--wait", "3", *common])
    err = capsys.readouterr().err
    assert code == 1
    waiting = [line for line in err.splitlines() if line.startswith("waiting for /default/quiet")]
    assert len(waiting) == 2  # at 0 s and 2 s
    assert "to be complete up to " in waiting[0] and "no clock yet, waited 0 s of 3 s" in waiting[0]
    assert "not complete up to" in err.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.spark
def test_documented_reads_see_every_topic_after_a_rendition_switch(
    produced: Produced, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Renditions are numbered per table: after a handover on one topic its files are under
    ``r2`` and the others' under ``r1``, so ``warehouse/r1`` silently lacks it. Both ways the
    docs read a table (``read_topic``, and ``spark.read.parquet`` of the directory ``tables
    path`` prints) read every topic whole."""
    keys = _clone(produced)
    objects = _own_objects(produced, tmp_path)
    common = ["--config", str(_config(produced, keys, objects, tmp_path))]

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["tables", *args, *common])
        out, err = capsys.readouterr()
        return code, out, err

    for topic in TOPICS:
        assert run("convert", "--topic", topic, "--width-s", "60")[0] == 0
    assert run("rendition", "--topic", AVRO)[:2] == (0, "r2\n")
    assert run("convert", "--topic", AVRO, "--rendition", "r2")[0] == 0
    assert run("activate", "--topic", AVRO, "--rendition", "r2")[0] == 0
    assert f"collected {AVRO} rendition r1" in run("collect", "--grace-s", "60")[1]
    code, _, err = run("path", "--topic", "/default/none")
    assert code == 1 and "/default/none has no table" in err

    spark = spark_session(
        "danube-tables-path-test",
        master="local[2]",
        config={"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC"},
    )
    warehouse = StoreSpec("fs", {"root": str(objects)})
    try:
        for topic in TOPICS:
            code, out, err = run("path", "--topic", topic)
            assert code == 0, err
            rendition = "r2" if topic == AVRO else "r1"
            name = topic.rsplit("/", 1)[1]
            path = out.strip()
            assert path == f"{objects}/warehouse/{rendition}/namespace=default/topic={name}/"
            every = list(range(produced.sent[topic]))
            plain = spark.read.parquet(path)
            assert sorted(r["offset"] for r in plain.select("offset").collect()) == every
            with read_topic(
                spark, topic, endpoints=[produced.endpoint], prefix=keys.prefix, warehouse=warehouse
            ) as df:
                assert sorted(r["offset"] for r in df.select("offset").collect()) == every
    finally:
        spark.stop()


def test_tables_publish_registers_an_existing_table_in_place(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Migration: a table converted before Iceberg (no catalog then) is registered by
    ``tables publish``: its Parquet files where they are, nothing copied; again: unchanged."""
    from danube_ingest.analytics.convert import convert
    from danube_ingest.analytics.iceberg import IcebergTarget, identifier
    from danube_ingest.config import load_config
    from danube_ingest.objects.store import ObjectStore
    from tests.pipelines.parquet_support import ROOT as WAREHOUSE
    from tests.pipelines.parquet_support import TOPIC, publish_topic

    objects_dir = tmp_path / "objects"

    async def setup() -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(objects_dir)})
        try:
            await publish_topic(kv, keys, hours=2, extra_ms=1, objects=store)
            await convert(kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC)
        finally:
            await store.close()
            await kv.close()

    asyncio.run(setup())
    files = sorted(p.resolve() for p in (objects_dir / WAREHOUSE / "r1").rglob("*.parquet"))
    before = {p: p.read_bytes() for p in files}
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]
    target = IcebergTarget.from_config(load_config(None, {"broker.data_dir": str(tmp_path)}))
    assert target is not None and not (tmp_path / "iceberg" / "catalog.db").exists()

    code = main(["tables", "publish", "--topic", TOPIC, *common])
    out, _ = capsys.readouterr()
    name = "danube." + ".".join(identifier(TOPIC))
    assert code == 0 and out.startswith(f"iceberg table {name}: snapshot ")
    assert f"(+{len(files)} -0 files)" in out
    table = target.catalog().load_table(identifier(TOPIC))
    registered = sorted(
        Path(t.file.file_path.removeprefix("file://")) for t in table.scan().plan_files()
    )
    assert registered == files and {p: p.read_bytes() for p in files} == before
    assert main(["tables", "publish", *common]) == 0  # every table: nothing new
    assert capsys.readouterr().out == f"iceberg table {name}: unchanged\n"
    assert main(["tables", "publish", "--topic", "/default/none", *common]) == 0
    assert "no active table" in capsys.readouterr().out


def test_tables_follow_once_shows_the_open_hour(
    etcd_server: str, keys: Keys, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tables follow --once``: a topic without a table gets one, and its tail (the open hour
    up to the clock's last 10 s step) is in the Iceberg table; a second round adds nothing."""
    from danube_ingest.analytics.iceberg import IcebergTarget, identifier
    from danube_ingest.config import load_config
    from danube_ingest.metadata.clock import TopicClock
    from danube_ingest.objects.store import ObjectStore
    from tests.pipelines.parquet_support import H0, MINUTE, TOPIC, publish_topic

    async def setup() -> None:
        kv = await EtcdKV.connect([etcd_server], timeout=5.0)
        store = ObjectStore("fs", options={"root": str(tmp_path / "objects")})
        try:
            await publish_topic(kv, keys, hours=1, objects=store)
            clock = TopicClock(offset=600, ingest_ms=H0 + 12 * MINUTE + 4_000, broker="b1", epoch=1)
            await kv.put(keys.topic_clock(TOPIC), clock.encode())
        finally:
            await store.close()
            await kv.close()

    asyncio.run(setup())
    common = ["--etcd", etcd_server, "--prefix", keys.prefix, "--data-dir", str(tmp_path)]
    assert main(["tables", "follow", "--once", *common]) == 0
    out = capsys.readouterr().out
    assert out == f"tail {TOPIC}: frontier {_iso(H0 + 12 * MINUTE)}, +1 pieces (120 rows), -0\n"
    target = IcebergTarget.from_config(load_config(None, {"broker.data_dir": str(tmp_path)}))
    assert target is not None
    table = target.catalog().load_table(identifier(TOPIC))
    assert sorted(table.scan().to_arrow().column("offset").to_pylist()) == list(range(120))
    assert main(["tables", "follow", "--once", "--topic", TOPIC, *common]) == 0
    assert capsys.readouterr().out == ""
    assert main(["tables", "--topic", TOPIC, *common]) == 0
    shown = capsys.readouterr().out
    assert f"  tail (r1): to {_iso(H0 + 12 * MINUTE)}, 1 pieces, 120 rows\n" in shown
    assert main(["tables", "follow", "--interval-s", "0", *common]) == 2
