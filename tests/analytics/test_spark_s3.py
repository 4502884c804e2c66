"""The Spark paths on s3 (a real ``moto_server`` child process) over the real daemon's objects
(``daemon_support``), copied into a bucket: the Spark engine of ``convert`` writes an s3
warehouse byte-equal to the local engine's fs one, the ``danube`` data source reads the topic
from s3, and ``read_topic`` reads the committed partitions from s3 (its non-fs path).

Credentials are only in the environment (the driver's, and the executors' through
``spark.executorEnv``): the store specs, the data source's options and its pickled partitions
never hold them, and opendal finds them there.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from danube_ingest.analytics.convert import StoreSpec, convert
from danube_ingest.analytics.read import read_topic
from danube_ingest.analytics.spark_source import DanubeDataSource
from danube_ingest.metadata import EtcdKV
from danube_ingest.objects.store import ObjectStore
from danube_ingest.testing import MotoServer
from tests.analytics.daemon_support import (
    AVRO,
    PAYLOADS,
    WIDTH_S,
    Produced,
    clone,
    expected_fields,
)

pytestmark = [
    pytest.mark.etcd,
    pytest.mark.s3,
    pytest.mark.slow,
    pytest.mark.spark,
    pytest.mark.timeout(300),
]

BUCKET = "danube-spark-s3"


@pytest.fixture(scope="module")
def credentials(s3_server: MotoServer) -> Iterator[dict[str, str]]:
    """The moto keys in this process's environment (where opendal reads them), for the
    module's duration."""
    env = {
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        # No instance-metadata probe on a machine that is not in a cloud.
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        yield env


@pytest.fixture(scope="module")
def spark(credentials: dict[str, str]) -> Iterator[Any]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from danube_ingest.analytics.spark_source import register

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("danube-spark-s3-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    # The JVM may predate this module (another module's session): hand the executors'
    # Python workers the environment explicitly.
    for name, value in credentials.items():
        builder = builder.config(f"spark.executorEnv.{name}", value)
    session = builder.getOrCreate()
    register(session)
    yield session
    session.stop()


def s3_spec(server: MotoServer, root: str) -> StoreSpec:
    """The opendal s3 options of ``root`` in the bucket, without credentials."""
    options = {
        k: v
        for k, v in server.options(BUCKET, root).items()
        if k not in ("access_key_id", "secret_access_key", "disable_config_load")
    }
    return StoreSpec("s3", options)


@pytest.fixture(scope="module")
def s3_root(s3_server: MotoServer, produced: Produced, credentials: dict[str, str]) -> str:
    """A root in the bucket holding a copy of the daemon's objects (same keys)."""
    s3_server.create_bucket(BUCKET)
    root = f"/objects-{uuid.uuid4().hex[:12]}"

    async def upload() -> None:
        store = s3_spec(s3_server, root).open()
        try:
            for path in sorted(produced.objects.rglob("*")):
                if path.is_file():
                    await store.put(str(path.relative_to(produced.objects)), path.read_bytes())
        finally:
            await store.close()

    asyncio.run(upload())
    return root


@pytest.fixture
async def kv(produced: Produced) -> AsyncIterator[EtcdKV]:
    store = await EtcdKV.connect([produced.endpoint], timeout=5.0)
    yield store
    await store.close()


def no_credentials(data: bytes | str, credentials: dict[str, str]) -> bool:
    text = data if isinstance(data, bytes) else data.encode()
    return not any(
        secret.encode() in text
        for name, secret in credentials.items()
        if name.startswith("AWS_") and "KEY" in name
    )


async def test_spark_engine_writes_an_s3_warehouse_equal_to_the_local_one_and_reads_it_back(
    spark: Any,
    s3_server: MotoServer,
    s3_root: str,
    produced: Produced,
    kv: EtcdKV,
    credentials: dict[str, str],
    tmp_path: Path,
) -> None:
    # The local engine on fs: the reference bytes.
    local_keys = await clone(kv, produced.prefix)
    fs_objects = ObjectStore("fs", options={"root": str(produced.objects)})
    fs_warehouse = ObjectStore("fs", options={"root": str(tmp_path / "wh")})
    await convert(
        kv=kv,
        keys=local_keys,
        objects=fs_objects,
        warehouse=fs_warehouse,
        topic=AVRO,
        width_s=WIDTH_S,
    )
    await fs_objects.close()
    await fs_warehouse.close()
    base = tmp_path / "wh"
    expected = {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted((base / "warehouse" / "r1").rglob("*"))
        if p.is_file()
    }
    assert expected

    # The Spark engine: tasks read the objects from s3 and stage and publish to an s3 warehouse.
    keys = await clone(kv, produced.prefix)
    objects_spec = s3_spec(s3_server, s3_root)
    warehouse_spec = s3_spec(s3_server, f"/wh-{uuid.uuid4().hex[:12]}")
    assert no_credentials(pickle.dumps((objects_spec, warehouse_spec)), credentials)
    objects, warehouse = objects_spec.open(), warehouse_spec.open()
    try:
        result = await convert(
            kv=kv,
            keys=keys,
            objects=objects,
            warehouse=warehouse,
            topic=AVRO,
            engine="spark",
            spark=spark,
            width_s=WIDTH_S,
            objects_spec=objects_spec,
            warehouse_spec=warehouse_spec,
        )
        assert {p.outcome for p in result.partitions} == {"committed"}
        assert sum(p.rows for p in result.partitions) == produced.sent[AVRO]
        written = {
            key: await warehouse.get(key)
            for key in await warehouse.list("warehouse/")
            if not key.endswith("/")
        }
    finally:
        await objects.close()
        await warehouse.close()
    assert {k: v for k, v in written.items() if k.startswith("warehouse/r1/")} == expected
    assert not [k for k in written if k.startswith("warehouse/_staging/")]

    # read_topic from s3 (no fs root: the driver reads the committed files through opendal).
    opened = dict(endpoints=[produced.endpoint], prefix=keys.prefix, warehouse=warehouse_spec)
    with read_topic(spark, AVRO, **opened) as df:
        rows = sorted((r.asDict() for r in await asyncio.to_thread(df.collect)),
                      key=lambda r: r["offset"])  # fmt: skip
    local_rows = sorted(
        (r for p in expected for r in pq.read_table(base / p).to_pylist()),
        key=lambda r: r["offset"],
    )
    assert [r["offset"] for r in rows] == [r["offset"] for r in local_rows]
    assert [r["offset"] for r in rows] == list(range(produced.sent[AVRO]))
    for row in rows:
        assert bytes(row["payload"]) == PAYLOADS[AVRO](row["offset"])
        for name, value in expected_fields(AVRO, row["offset"]).items():
            assert row[name] == value


def test_danube_source_reads_the_topic_from_s3_with_credentials_from_the_environment(
    spark: Any,
    s3_server: MotoServer,
    s3_root: str,
    produced: Produced,
    credentials: dict[str, str],
) -> None:
    options = {
        "topic": AVRO,
        "etcd.endpoints": produced.endpoint,
        "etcd.prefix": produced.prefix,
        "objects.backend": "s3",
        "objects.bucket": BUCKET,
        "objects.root": s3_root,
        "objects.endpoint": s3_server.endpoint,
        "objects.region": s3_server.region,
        "objects.option.disable_ec2_metadata": "true",
        "max_rows": "5",
    }
    source = DanubeDataSource(options)
    reader = source.reader(source.schema())
    partitions = reader.partitions()
    assert partitions
    assert no_credentials(repr(sorted(source._settings.store_options.items())), credentials)
    assert no_credentials(pickle.dumps(partitions), credentials)
    assert no_credentials(pickle.dumps(source._settings), credentials)

    def read() -> list[Any]:
        df = spark.read.format("danube").options(**options).load()
        rows: list[Any] = df.orderBy("offset").collect()
        return rows

    rows = read()
    assert [r["offset"] for r in rows] == list(range(produced.sent[AVRO]))
    for row in rows:
        i = row["offset"]
        assert bytes(row["payload"]) == PAYLOADS[AVRO](i)
        assert row["attributes"] == {"i": str(i), "t": AVRO}
        for name, value in expected_fields(AVRO, i).items():
            assert row[name] == value
