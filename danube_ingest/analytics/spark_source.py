"""The Spark data source ``"danube"``: a topic's rows read from its objects through opendal.

::

    from danube_ingest.analytics.spark_source import register
    register(spark)
    df = spark.read.format("danube").option("topic", "/default/orders").load()

The driver reads the topic's schema (once, in ``schema()``) and its manifest (one etcd range
read, in ``partitions()``) and plans one input partition per manifest range; each task reads
its object's footer and only the frames it needs (:mod:`danube_ingest.analytics.source`) and
yields Arrow record batches. No Hadoop connector is involved: fs, s3 and gcs all go through
opendal. Options (all strings) are listed in :data:`OPTIONS` and in ``docs/analytics.md``;
credentials come from the environment of the driver and executors (``AWS_ACCESS_KEY_ID``...,
read by opendal), never from options: an option whose name looks like a credential is refused.

Executors must import this module (classes are pickled by reference) and run the interpreter
that has pyarrow and opendal: build the session with ``analytics.spark_session`` (it sets
``PYSPARK_PYTHON`` to this interpreter) or set ``PYSPARK_PYTHON`` before Spark starts. In local
mode :func:`register` checks that Spark's workers can import them and raises ``ConfigError`` at
once if not (otherwise the first read would fail in a worker, a minute later).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from danube_ingest.analytics.columns import table_schema
from danube_ingest.analytics.decode import SchemaDecoder, load_decoder
from danube_ingest.analytics.source import MAX_ROWS, ReadPart, plan_reads, read_part
from danube_ingest.errors import ConfigError
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import split_topic
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.objects.store import ObjectStore, is_credential_option
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore

__all__ = ["FORMAT", "OPTIONS", "DanubeDataSource", "DanubePartition", "register"]

FORMAT = "danube"
"""The short name: ``spark.read.format("danube")``."""

ENDPOINTS_ENV = "DANUBE_INGEST_ETCD_ENDPOINTS"
PREFIX_ENV = "DANUBE_INGEST_ETCD_PREFIX"

OPTIONS: dict[str, str] = {
    "topic": "required: the topic, /namespace/topic",
    "etcd.endpoints": f"comma-separated etcd URLs (default ${ENDPOINTS_ENV}, else "
    "http://127.0.0.1:2379)",
    "etcd.prefix": f"the brokers' etcd key prefix (default ${PREFIX_ENV}, else /danube)",
    "etcd.timeout": "seconds to wait for etcd (default 5)",
    "objects.backend": "fs, s3 or gcs (default fs), as storage.cloud.backend",
    "objects.root": "storage.cloud.root: a directory for fs (required), a prefix in the bucket",
    "objects.bucket": "storage.cloud.bucket (s3, gcs)",
    "objects.endpoint": "storage.cloud.endpoint (S3-compatible servers, emulators)",
    "objects.region": "storage.cloud.region (required for s3)",
    "objects.option.<name>": "further opendal options, as storage.cloud.options",
    "start_offset": "first offset read (inclusive, default 0)",
    "end_offset": "offset after the last read (exclusive, default: all)",
    "start_time": "first ingest time read (inclusive): ISO 8601 (no offset: UTC) or epoch ms",
    "end_time": "ingest time after the last read (exclusive): ISO 8601 or epoch ms",
    "schema_version": "version of the topic's subject whose fields become columns "
    "(default: the latest)",
    "max_rows": f"rows per Arrow batch (default {MAX_ROWS})",
}

_BACKENDS = ("fs", "s3", "gcs")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class DanubePartition(InputPartition):
    """One task: one manifest range of the topic."""

    def __init__(self, index: int, part: ReadPart) -> None:
        super().__init__(index)
        self.part = part


class DanubeDataSource(DataSource):
    """``spark.read.format("danube")``: see the module docstring and :data:`OPTIONS`."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self._settings = _Settings(dict(options))
        self._decoder: SchemaDecoder | None = None
        self._loaded = False

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        """The topic's columns; reads its schema configuration from etcd once."""
        if not self._loaded:
            self._decoder = asyncio.run(self._settings.load_decoder())
            self._loaded = True
        return from_arrow_schema(table_schema(self._decoder))

    def reader(self, schema: StructType) -> DataSourceReader:
        if not self._loaded:
            self.schema()
        return _DanubeReader(self._settings, self._decoder)


class _DanubeReader(DataSourceReader):
    def __init__(self, settings: _Settings, decoder: SchemaDecoder | None) -> None:
        self._settings = settings
        self._decoder = decoder

    def partitions(self) -> list[DanubePartition]:
        """One partition per manifest range holding wanted rows (one etcd range read)."""
        parts = asyncio.run(self._settings.plan())
        return [DanubePartition(i, part) for i, part in enumerate(parts)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, DanubePartition)
        store = self._settings.object_store()
        yield from read_part(
            store, partition.part, decoder=self._decoder, max_rows=self._settings.max_rows
        )


class _Settings:
    """The options, checked once on the driver; picklable (plain strings and ints)."""

    def __init__(self, options: dict[str, str]) -> None:
        opts = {k.lower(): v for k, v in options.items()}
        for name in opts:
            if is_credential_option(name):
                raise ConfigError(
                    f"danube data source: option {name!r} looks like a credential; "
                    "credentials come from the environment (e.g. AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY for s3), never from read options"
                )
        topic = opts.get("topic")
        if not topic:
            raise ConfigError(
                'danube data source: option "topic" is required, e.g. '
                '.option("topic", "/default/orders")'
            )
        try:
            split_topic(topic)
        except ValueError as exc:
            raise ConfigError(f"danube data source: option 'topic': {exc}") from exc
        self.topic = topic
        endpoints = opts.get("etcd.endpoints") or os.environ.get(
            ENDPOINTS_ENV, "http://127.0.0.1:2379"
        )
        self.endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        self.prefix = opts.get("etcd.prefix") or os.environ.get(PREFIX_ENV, "/danube")
        self.etcd_timeout = _number(opts, "etcd.timeout", 5.0)
        self.backend = opts.get("objects.backend", "fs")
        if self.backend not in _BACKENDS:
            raise ConfigError(
                f"danube data source: option 'objects.backend' is {self.backend!r}; expected "
                f"one of {', '.join(_BACKENDS)} (memory stores cannot be shared with tasks)"
            )
        self.store_options = _store_options(self.backend, opts)
        self.start_offset = _integer(opts, "start_offset", 0)
        self.end_offset = _optional_integer(opts, "end_offset")
        self.start_ms = _time(opts, "start_time")
        self.end_ms = _time(opts, "end_time")
        version = _optional_integer(opts, "schema_version")
        self.schema_version = version
        self.max_rows = _integer(opts, "max_rows", MAX_ROWS)
        if self.max_rows < 1:
            raise ConfigError("danube data source: option 'max_rows' must be at least 1")

    def object_store(self) -> ObjectStore:
        return ObjectStore(self.backend, options=dict(self.store_options))

    async def _connect(self) -> EtcdKV:
        # TLS files and user from DANUBE_INGEST_ETCD_* (the Dagster resource passes them on).
        return await EtcdKV.connect(
            self.endpoints, timeout=self.etcd_timeout, security=EtcdSecurity.from_env()
        )

    async def load_decoder(self) -> SchemaDecoder | None:
        kv = await self._connect()
        try:
            registry = SchemaRegistry(KVSchemaStore(kv, Keys(self.prefix)))
            return await load_decoder(registry, self.topic, version=self.schema_version)
        finally:
            await kv.close()

    async def plan(self) -> list[ReadPart]:
        kv = await self._connect()
        try:
            ranges = await Manifest(kv, Keys(self.prefix)).ranges(self.topic, self.start_offset)
        finally:
            await kv.close()
        return plan_reads(
            ranges,
            start_offset=self.start_offset,
            end_offset=self.end_offset,
            start_ms=self.start_ms,
            end_ms=self.end_ms,
        )


def _store_options(backend: str, opts: dict[str, str]) -> dict[str, str]:
    """opendal options as ``ObjectStore.from_config`` builds them from ``storage.cloud``."""
    options: dict[str, str] = {}
    root = opts.get("objects.root", "")
    if backend == "fs":
        if not root:
            raise ConfigError(
                "danube data source: option 'objects.root' is required for the fs backend "
                "(the brokers' storage.cloud.root, by default {data_dir}/objects)"
            )
        options["root"] = root
    else:
        bucket = opts.get("objects.bucket")
        if not bucket:
            raise ConfigError(
                f"danube data source: option 'objects.bucket' is required for {backend}"
            )
        options["bucket"] = bucket
        if root:
            options["root"] = root
        if opts.get("objects.endpoint"):
            options["endpoint"] = opts["objects.endpoint"]
    if backend == "s3":
        region = opts.get("objects.region")
        if not region:
            raise ConfigError("danube data source: option 'objects.region' is required for s3")
        options["region"] = region
    for name, value in opts.items():
        if name.startswith("objects.option."):
            options[name.removeprefix("objects.option.")] = value
    return options


def _integer(opts: dict[str, str], name: str, default: int) -> int:
    value = _optional_integer(opts, name)
    return default if value is None else value


def _optional_integer(opts: dict[str, str], name: str) -> int | None:
    raw = opts.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(
            f"danube data source: option {name!r} must be an integer, got {raw!r}"
        ) from None
    if value < 0:
        raise ConfigError(f"danube data source: option {name!r} must be >= 0, got {raw!r}")
    return value


def _number(opts: dict[str, str], name: str, default: float) -> float:
    raw = opts.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(
            f"danube data source: option {name!r} must be a number, got {raw!r}"
        ) from None


def _time(opts: dict[str, str], name: str) -> int | None:
    """An ingest-time bound in epoch milliseconds, from ms digits or ISO 8601 (UTC if no
    offset is given)."""
    raw = opts.get(name)
    if raw is None or raw == "":
        return None
    if raw.strip().lstrip("-").isdigit():
        return int(raw)
    try:
        parsed = dt.datetime.fromisoformat(raw.strip())
    except ValueError:
        raise ConfigError(
            f"danube data source: option {name!r} must be ISO 8601 (2026-11-24T10:00:00Z) "
            f"or epoch milliseconds, got {raw!r}"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return (parsed - _EPOCH) // dt.timedelta(milliseconds=1)


#: What Spark's Python workers import to run this source.
WORKER_IMPORTS = "import danube_ingest.analytics.source, pyarrow, opendal"


def register(spark: SparkSession) -> None:
    """Register :class:`DanubeDataSource` with ``spark`` under the name ``"danube"``.

    In local mode, ``ConfigError`` (naming the interpreter and what to set) if the interpreter
    Spark runs its Python workers with cannot import ``danube_ingest``, pyarrow and opendal."""
    context = spark.sparkContext
    if (context.master or "").startswith("local"):
        _check_workers(context.pythonExec)
    spark.dataSource.register(DanubeDataSource)


def _check_workers(python: str) -> None:
    """``ConfigError`` unless ``python`` (Spark's worker interpreter) has what tasks import."""
    found = shutil.which(python)
    if found is not None and os.path.abspath(found) == os.path.abspath(sys.executable):
        return
    if found is not None:
        probe = subprocess.run(
            [found, "-c", WORKER_IMPORTS], capture_output=True, text=True, timeout=120
        )
        if probe.returncode == 0:
            return
    raise ConfigError(
        f"danube data source: Spark runs its Python workers with {python!r} "
        f"(PYSPARK_PYTHON={os.environ.get('PYSPARK_PYTHON', 'unset')}), which cannot import "
        f"danube_ingest, pyarrow and opendal; set PYSPARK_PYTHON={sys.executable} before the "
        "SparkSession is created, or create it with danube_ingest.analytics.spark_session()"
    )
