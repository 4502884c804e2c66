"""For analysts: a topic's committed Parquet as a Spark DataFrame, held while in use.

::

    with read_topic(spark, "/default/orders", "2026-11-24T10:00:00Z") as df:
        df.createOrReplaceTempView("orders")
        spark.sql("SELECT count(*) FROM orders").show()

Guarantees of :func:`read_topic` (and of :func:`open_topic`, its async form for callers that
have a ``KV``):

* The DataFrame holds **exactly the committed, published partitions of the active rendition**
  that overlap ``[start, end)`` (whole partitions; filter on ``ingest_time`` for finer bounds),
  found from their commit records in etcd, never from a directory listing: a partition being
  written, a staged file or another rendition's file is never read.
* The rendition is **held** (``renditions.hold``: a key under a lease kept alive by a
  background thread) from before the commit records are read until the hold is released, so a
  handover to a new rendition cannot collect the files under the DataFrame. The hold is
  released when the ``with`` block exits, or by ``TopicRead.release()``; a process that dies
  holding it loses it when its lease expires (30 s).
* fs warehouses are read by Spark itself (``spark.read.parquet(paths)``: lazy, distributed).
  Other stores (s3, gcs, memory) are read on the driver through the ``ObjectStore`` (opendal)
  with pyarrow and handed to Spark with ``createDataFrame``: no Hadoop connector is needed,
  at the cost of holding the selected partitions in the driver's memory.

The columns are the files' (``docs/analytics.md``); the Hive partition columns (``date``,
``hour``...) are not added. Errors: ``RenditionError`` when the topic has no active
rendition, ``MetadataUnavailableError`` when etcd cannot be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import os
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from danube_ingest.analytics.columns import table_schema
from danube_ingest.analytics.convert import StoreSpec, rendition_decoder
from danube_ingest.analytics.errors import RenditionError
from danube_ingest.analytics.records import PartitionCommit, TableKeys
from danube_ingest.analytics.renditions import hold, read_rendition
from danube_ingest.config import load_config
from danube_ingest.config.loader import CONFIG_ENV
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.objects.store import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["TopicRead", "open_topic", "read_topic"]

ENDPOINTS_ENV = "DANUBE_INGEST_ETCD_ENDPOINTS"
PREFIX_ENV = "DANUBE_INGEST_ETCD_PREFIX"

Instant = dt.datetime | int | str | None
T = TypeVar("T")


def _ms(value: Instant, name: str) -> int | None:
    """An instant as ms since the epoch: a datetime (naive means UTC), epoch ms, or ISO 8601."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ValueError(f"{name} {value!r} is not ISO 8601 (2026-11-24T10:00:00Z)") from exc
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return int(value.timestamp() * 1000)


@dataclass(frozen=True)
class _Selection:
    rendition: str
    partitions: list[PartitionCommit]
    schema: pa.Schema


async def _select(
    kv: KV, keys: Keys, topic: str, rendition: str, start_ms: int | None, end_ms: int | None
) -> _Selection:
    """The held rendition's published partitions overlapping ``[start_ms, end_ms)``."""
    record = await read_rendition(kv, keys, topic, rendition)
    if record is None:
        raise RenditionError(f"{topic} has no rendition {rendition}")
    entries = await kv.get_prefix(TableKeys(keys, topic).parts_prefix(rendition))
    commits = sorted(
        (PartitionCommit.decode(e.value, e.key) for e in entries), key=lambda c: c.start_ms
    )
    chosen = [
        c
        for c in commits
        if c.published
        and (start_ms is None or c.end_ms > start_ms)
        and (end_ms is None or c.start_ms < end_ms)
    ]
    decoder = await rendition_decoder(kv, keys, topic, record)
    return _Selection(rendition, chosen, table_schema(decoder))


def _fs_root(spec: StoreSpec) -> Path | None:
    return Path(spec.options["root"]) if spec.scheme == "fs" and spec.options.get("root") else None


async def _arrow(store: ObjectStore, selection: _Selection) -> pa.Table:
    tables = [
        pq.read_table(io.BytesIO(await store.get(f.path)))
        for c in selection.partitions
        for f in c.files
        if not f.dead_letters  # (in the __dlq Iceberg table, not the topic's)
    ]
    if not tables:
        return selection.schema.empty_table()
    return pa.concat_tables([_aligned(t, selection.schema) for t in tables])


def _aligned(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: a file written before its rendition's
    schema evolved (``evolve.py``) lacks the added columns (null here) and may hold a
    narrower type (cast)."""
    if table.schema.equals(schema):
        return table
    columns = [
        table.column(f.name).cast(f.type)
        if f.name in table.schema.names
        else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _frame(
    spark: SparkSession,
    spec: StoreSpec,
    paths: Sequence[str],
    data: pa.Table | None,
    schema: pa.Schema,
) -> DataFrame:
    from pyspark.sql.pandas.types import from_arrow_schema

    if data is not None:
        if data.num_rows == 0:
            return spark.createDataFrame([], schema=from_arrow_schema(data.schema))
        return spark.createDataFrame(data)
    root = _fs_root(spec)
    assert root is not None
    # The rendition's columns, not the first file's: files written before its schema evolved
    # lack the added columns (null) and may hold a narrower type.
    return spark.read.schema(from_arrow_schema(schema)).parquet(*(str(root / p) for p in paths))


def _default_spec() -> StoreSpec:
    return StoreSpec.from_config(load_config(os.environ.get(CONFIG_ENV) or None))


@contextlib.asynccontextmanager
async def open_topic(
    spark: SparkSession,
    topic: str,
    start: Instant = None,
    end: Instant = None,
    *,
    kv: KV,
    keys: Keys,
    warehouse: StoreSpec | None = None,
) -> AsyncIterator[DataFrame]:
    """:func:`read_topic` for async code with its own ``kv``: the hold lasts the block."""
    spec = warehouse or _default_spec()
    start_ms, end_ms = _ms(start, "start"), _ms(end, "end")
    async with hold(kv, keys, topic, holder="read_topic") as rendition:
        selection = await _select(kv, keys, topic, rendition, start_ms, end_ms)
        yield await _build(spark, spec, selection)


async def _build(spark: SparkSession, spec: StoreSpec, selection: _Selection) -> DataFrame:
    paths = [f.path for c in selection.partitions for f in c.files if not f.dead_letters]
    data = None
    if _fs_root(spec) is None or not paths:
        if paths:
            store = spec.open() if spec.scheme != "memory" else None
            if store is None:
                raise RenditionError("a memory warehouse cannot be read by read_topic")
            try:
                data = await _arrow(store, selection)
            finally:
                await store.close()
        else:
            data = selection.schema.empty_table()
    return await asyncio.to_thread(_frame, spark, spec, paths, data, selection.schema)


class TopicRead:
    """A held read of a topic (see the module docstring): ``df`` is the DataFrame; the hold is
    released by ``release()`` or on leaving the ``with`` block (``__enter__`` returns ``df``)."""

    def __init__(
        self,
        spark: SparkSession,
        topic: str,
        start: Instant,
        end: Instant,
        *,
        endpoints: Sequence[str],
        prefix: str,
        warehouse: StoreSpec,
        security: EtcdSecurity | None = None,
    ) -> None:
        self.topic = topic
        self._security = security
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"hold-{topic}", daemon=True
        )
        self._thread.start()
        self._stack = contextlib.AsyncExitStack()
        self._released = False
        try:
            self.df: DataFrame = self._call(
                self._open(spark, topic, start, end, endpoints, prefix, warehouse)
            )
        except BaseException:
            self.release()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _open(
        self,
        spark: SparkSession,
        topic: str,
        start: Instant,
        end: Instant,
        endpoints: Sequence[str],
        prefix: str,
        warehouse: StoreSpec,
    ) -> DataFrame:
        kv = await EtcdKV.connect(list(endpoints), timeout=5.0, security=self._security)
        self._stack.push_async_callback(kv.close)
        reading = open_topic(
            spark, topic, start, end, kv=kv, keys=Keys(prefix), warehouse=warehouse
        )
        frame: DataFrame = await self._stack.enter_async_context(reading)
        return frame

    def release(self) -> None:
        """Release the hold (idempotent). The DataFrame must not be used afterwards: its
        files may be collected."""
        if self._released:
            return
        self._released = True
        try:
            self._call(self._stack.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> DataFrame:
        return self.df

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def read_topic(
    spark: SparkSession,
    topic: str,
    start: Instant = None,
    end: Instant = None,
    *,
    endpoints: Sequence[str] | None = None,
    prefix: str | None = None,
    warehouse: StoreSpec | None = None,
    security: EtcdSecurity | None = None,
) -> TopicRead:
    """The committed partitions of ``topic``'s active rendition overlapping ``[start, end)``
    (datetimes, ISO 8601 strings or epoch ms; None: unbounded), held until released.

    ``endpoints``/``prefix`` default to ``$DANUBE_INGEST_ETCD_ENDPOINTS`` /
    ``$DANUBE_INGEST_ETCD_PREFIX``, then the config of ``$DANUBE_INGEST_CONFIG`` (whose
    ``storage.cloud`` is also the default ``warehouse``). ``security`` (etcd TLS and user)
    defaults to ``$DANUBE_INGEST_ETCD_*`` (``EtcdSecurity.from_env``), else that config's
    ``etcd`` section. Use as ``with read_topic(...) as
    df:``, or keep the returned :class:`TopicRead` and call ``release()``.
    """
    config = None
    if endpoints is None or prefix is None or warehouse is None:
        config = load_config(os.environ.get(CONFIG_ENV) or None)
    if endpoints is None:
        text = os.environ.get(ENDPOINTS_ENV)
        assert config is not None
        endpoints = [e for e in text.split(",") if e] if text else list(config.etcd.endpoints)
    if prefix is None:
        assert config is not None
        prefix = os.environ.get(PREFIX_ENV) or config.etcd.prefix
    if warehouse is None:
        assert config is not None
        warehouse = StoreSpec.from_config(config)
    if security is None:
        security = (
            EtcdSecurity.from_env()
            if config is None
            else EtcdSecurity.from_env_or_config(config.etcd)
        )
    return TopicRead(
        spark,
        topic,
        start,
        end,
        endpoints=endpoints,
        prefix=prefix,
        warehouse=warehouse,
        security=security,
    )
