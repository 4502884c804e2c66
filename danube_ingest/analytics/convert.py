"""The conversion run: a topic's complete partitions from ``.bin`` objects to committed Parquet.

``convert`` glues the table steps together (``plan``, ``source``, ``parquet``, ``commit``,
``renditions``): it creates the table and its first rendition ``r1`` if absent, publishes what
a crashed run committed, plans, announces an intent, reads each partition's rows from the
objects, stages its file, commits it with one compare-and-swap, publishes it and advances the
frontier. Guarantees:

* **Complete partitions only**: a partition is converted once the topic clock has passed its
  end (every offset below is in the manifest); a requested partition that is not complete is
  refused with :class:`ConvertError` naming it, before anything is written.
* **Definite output**: engine ``"local"`` (one process, pyarrow) and engine ``"spark"`` (one
  Spark task per partition reads the objects and writes the staged file; the driver commits)
  write byte-identical files; a rerun, a crash and rerun, or concurrent runs end with the same
  files and one commit record per partition (``commit.py``).
* **Commits in order, nothing past a failure**: partitions are committed in start order; when
  a partition cannot be read or written (a missing or damaged object: the error names the key
  and byte position) the run commits the partitions before it, commits nothing of it or after
  it, deletes its own staged files for them and raises :class:`ConvertError`.

Spark tasks open the stores from a :class:`StoreSpec` (scheme and opendal options, no
credentials: executors take them from their environment, as the ``danube`` data source does).
pyspark is imported only when the Spark engine runs.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from danube_ingest.analytics.columns import table_schema
from danube_ingest.analytics.commit import (
    advance_frontier,
    begin,
    commit_partition,
    finish_published,
)
from danube_ingest.analytics.decode import SchemaDecoder, load_decoder
from danube_ingest.analytics.errors import AnalyticsError
from danube_ingest.analytics.evolve import evolve_schema
from danube_ingest.analytics.iceberg import IcebergTarget, PublishResult, publish
from danube_ingest.analytics.layout import (
    DEFAULT_ROOT,
    DEFAULT_WIDTH_S,
    check_root,
    dead_letters_of,
    partition_dir,
    partition_end,
    partition_start,
)
from danube_ingest.analytics.parquet import FileInfo, write_partition
from danube_ingest.analytics.plan import (
    DEFAULT_LIMIT,
    Partition,
    PlanInput,
    complete_partitions,
    read_plan_input,
)
from danube_ingest.analytics.records import PartitionCommit, RenditionRecord, TableKeys
from danube_ingest.analytics.renditions import activate, create_table, read_rendition, read_table
from danube_ingest.analytics.source import ReadPart, aread_part, plan_reads
from danube_ingest.config.models import BrokerConfig
from danube_ingest.errors import ConfigError, DanubeIngestError
from danube_ingest.metadata.errors import MetadataUnavailableError
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV, Compare, Put
from danube_ingest.objects.store import ObjectStore, is_credential_option, location_options
from danube_ingest.schema import SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "CONVERTER_VERSION",
    "ConvertError",
    "ConvertResult",
    "PartitionResult",
    "StoreSpec",
    "convert",
    "current_conversion",
    "ensure_table",
    "failure_cause",
    "first_since",
    "not_complete_error",
    "pending_partitions",
]

log = logging.getLogger(__name__)

#: Recorded in every rendition and commit. The Parquet bytes depend on pyarrow (``created_by``
#: and the encoders), so its version is part of the converter's.
CONVERTER_VERSION = (
    f"danube-ingest-{importlib.metadata.version('danube-ingest')}+pyarrow-{pa.__version__}"
)
#: The first rendition of a table, created and activated by the first run.
FIRST_RENDITION = "r1"

Engine = Literal["local", "spark"]


class ConvertError(AnalyticsError):
    """A run could not convert a partition (or was asked for one it must not convert).

    Nothing of the named partition (or of any later one in the run) was committed; partitions
    before it were. ``retriable`` is True when the cause was transient (the store or etcd
    stayed unreachable), so running the conversion again may succeed. ``cause`` names the
    kind of failure in one word for callers that report it (Dagster's metadata):
    ``not_complete``, ``before_since``, ``not_a_partition``, ``object_missing``, ``read_failed``
    or ``conversion`` (anything else).
    """

    def __init__(self, message: str, *, retriable: bool = False, cause: str = "conversion") -> None:
        super().__init__(message)
        self.retriable = retriable
        self.cause = cause


def failure_cause(exc: BaseException) -> str:
    """A failed run's kind in one word, for reports: ``ConvertError.cause``,
    ``etcd_unreachable``, or the error's class name."""
    if isinstance(exc, ConvertError):
        return exc.cause
    if isinstance(exc, MetadataUnavailableError):
        return "etcd_unreachable"
    return type(exc).__name__


@dataclass(frozen=True)
class PartitionResult:
    """What a run did to one partition."""

    start_ms: int
    end_ms: int
    """Exclusive."""
    rows: int
    first_offset: int
    """-1 for a partition without rows."""
    last_offset: int
    """-1 for a partition without rows."""
    files: list[str]
    """The published files' keys in the warehouse store, in offset order."""
    outcome: Literal["committed", "already"]
    """``committed`` by this run, or ``already`` committed by another (its record)."""


@dataclass(frozen=True)
class ConvertResult:
    """What a run did."""

    topic: str
    rendition: str
    partitions: list[PartitionResult]
    """In start order."""
    upper_ms: int
    """The rendition's frontier after the run."""
    input_revision: int
    """The etcd revision of the clock and manifest the run planned from (0: nothing planned)."""
    published: PublishResult | None = None
    """What publishing the table to the Iceberg catalog did (None: no catalog given)."""


@dataclass(frozen=True)
class StoreSpec:
    """How a Spark task opens an object store: an opendal scheme and its options (picklable).

    Never put credentials in ``options``: executors read them from their environment (for s3
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or the instance role).
    """

    scheme: str
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.options:
            if is_credential_option(name):
                raise ConfigError(
                    f"object store option {name!r} looks like a credential: Spark tasks would "
                    "receive it in their plan; give credentials through the environment "
                    "(e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3) instead"
                )

    def open(self) -> ObjectStore:
        """A new store (the caller closes it)."""
        return ObjectStore(self.scheme, options=dict(self.options))

    @classmethod
    def from_config(cls, config: BrokerConfig) -> StoreSpec:
        """The daemon's ``storage.cloud`` store, without its credentials. ``ConfigError`` for
        a ``memory`` backend (tasks run in other processes)."""
        cloud = config.storage.cloud
        if cloud.backend == "memory":
            raise ConfigError(
                "storage.cloud.backend is 'memory': Spark tasks cannot share it; use fs, s3 or "
                "gcs, or the local engine"
            )
        options = location_options(config)
        options.update(cloud.options)
        return cls(cloud.backend, options)


@dataclass(frozen=True, slots=True)
class _Task:
    """One partition to read and stage: what a Spark task gets (picklable)."""

    topic: str
    start_ms: int
    parts: tuple[ReadPart, ...]
    staged_dir: str
    decoder: SchemaDecoder | None
    dead_letters_dir: str | None = None
    """Where rows that do not decode are staged apart (a rendition with ``dead_letters``)."""


@dataclass(frozen=True, slots=True)
class _Staged:
    """A task's answer: its staged files, or why it failed."""

    start_ms: int
    files: tuple[FileInfo, ...] = ()
    error: str | None = None
    retriable: bool = False


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def _stage(objects: ObjectStore, warehouse: ObjectStore, task: _Task) -> _Staged:
    """Read the task's rows from the objects and stage its file; errors become ``_Staged``."""
    try:
        batches: list[pa.RecordBatch] = []
        for part in task.parts:
            batches.extend([b async for b in aread_part(objects, part, decoder=task.decoder)])
        files = await write_partition(
            warehouse,
            task.staged_dir,
            batches,
            table_schema(task.decoder),
            dead_letters=task.dead_letters_dir,
        )
    except DanubeIngestError as exc:
        return _Staged(task.start_ms, error=str(exc), retriable=bool(exc.retriable))
    return _Staged(task.start_ms, tuple(files))


def _spark_stage(item: tuple[_Task, StoreSpec, StoreSpec]) -> _Staged:
    """A Spark task: open the stores, stage one partition, close the stores."""
    task, objects_spec, warehouse_spec = item

    async def run() -> _Staged:
        objects, warehouse = objects_spec.open(), warehouse_spec.open()
        try:
            return await _stage(objects, warehouse, task)
        finally:
            await objects.close()
            await warehouse.close()

    return asyncio.run(run())


def _run_on_spark(
    spark: SparkSession | None, tasks: list[_Task], objects: StoreSpec, warehouse: StoreSpec
) -> list[_Staged]:
    """Stage ``tasks`` as Spark tasks, one per partition; blocks until all are done."""
    if spark is None:
        from danube_ingest.analytics.session import spark_session

        spark = spark_session()
    context = spark.sparkContext
    context.setJobDescription(f"danube-ingest convert {tasks[0].topic} ({len(tasks)} partitions)")
    items = [(task, objects, warehouse) for task in tasks]
    staged: list[_Staged] = context.parallelize(items, len(items)).map(_spark_stage).collect()
    return staged


def _registry(kv: KV, keys: Keys) -> SchemaRegistry:
    return SchemaRegistry(KVSchemaStore(kv, keys))


async def rendition_decoder(
    kv: KV, keys: Keys, topic: str, record: RenditionRecord
) -> SchemaDecoder | None:
    """The decoder of a rendition's ``schema_ref`` (``subject:version``; ``""``: none)."""
    if not record.schema_ref:
        return None
    version = int(record.schema_ref.rsplit(":", 1)[1])
    return await load_decoder(_registry(kv, keys), topic, version=version)


async def current_conversion(kv: KV, keys: Keys, topic: str) -> tuple[str, str]:
    """What a rendition created now records: this converter's ``CONVERTER_VERSION`` and the
    topic's current decode schema as ``subject:version`` (``""``: the topic has none)."""
    decoder = await load_decoder(_registry(kv, keys), topic)
    schema_ref = "" if decoder is None else f"{decoder.subject}:{decoder.decode_version}"
    return CONVERTER_VERSION, schema_ref


def first_since(plan_input: PlanInput, width_s: int) -> int:
    """The ``since`` a first run gives the table it creates: the start of the partition of
    the topic's first ingest time in the manifest (else of its clock, else of now)."""
    firsts = [r.first_ingest_ms for r in plan_input.ranges]
    if firsts:
        since = min(firsts)
    elif plan_input.clock is not None:
        since = plan_input.clock.ingest_ms
    else:
        since = _now_ms()
    return partition_start(since, width_s)


async def _ensure_rendition(
    kv: KV, keys: Keys, topic: str, width_s: int, plan_input: PlanInput, dead_letters: bool
) -> str:
    """The table's active rendition, creating the table and ``r1`` (with ``dead_letters``) and
    activating it first when absent. Safe against concurrent runs: creations are
    compare-and-swaps."""
    table = await read_table(kv, keys, topic)
    if table is None:
        table = await create_table(
            kv, keys, topic, since_ms=first_since(plan_input, width_s), width_s=width_s
        )
    if table.active is not None:
        return table.active
    tables = TableKeys(keys, topic)
    converter_version, schema_ref = await current_conversion(kv, keys, topic)
    record = RenditionRecord(
        converter_version,
        schema_ref,
        _now_ms(),
        "building",
        table.since_ms,
        dead_letters=dead_letters,
    )
    key = tables.rendition(FIRST_RENDITION)
    created = await kv.txn([Compare.absent(key)], [Put(key, record.encode())])
    if created.succeeded:
        log.info(
            "rendition created topic=%s rendition=%s converter=%s schema=%s",
            topic,
            FIRST_RENDITION,
            converter_version,
            schema_ref,
        )
    activated = await activate(kv, keys, topic, FIRST_RENDITION)
    assert activated.active is not None
    return activated.active


async def ensure_table(
    kv: KV,
    keys: Keys,
    topic: str,
    *,
    width_s: int = DEFAULT_WIDTH_S,
    dead_letters: bool = False,
) -> str:
    """The active rendition of ``topic``'s table, creating the table (``width_s`` wide, from
    the partition of the topic's first ingest time) and ``r1`` (with ``dead_letters``) when
    absent, as a first conversion run does; converts nothing."""
    plan_input = await read_plan_input(kv, keys, topic)
    return await _ensure_rendition(kv, keys, topic, width_s, plan_input, dead_letters)


async def _committed(kv: KV, keys: Keys, topic: str, rendition: str) -> dict[int, PartitionCommit]:
    """The rendition's partition commits by start."""
    entries = await kv.get_prefix(TableKeys(keys, topic).parts_prefix(rendition))
    records = (PartitionCommit.decode(e.value, e.key) for e in entries)
    return {r.start_ms: r for r in records}


async def pending_partitions(
    kv: KV, keys: Keys, topic: str, *, width_s: int = DEFAULT_WIDTH_S
) -> list[int]:
    """Starts of the complete partitions the active rendition has not committed, in order (at
    most a day of minute partitions per call). Creates nothing: without a table, the
    partitions a first run with ``width_s`` would convert."""
    plan_input = await read_plan_input(kv, keys, topic)
    table = await read_table(kv, keys, topic)
    upper: int | None = None
    committed: dict[int, PartitionCommit] = {}
    if table is not None:
        width_s, upper = table.width_s, table.since_ms
        if table.active is not None:
            record = await read_rendition(kv, keys, topic, table.active)
            if record is not None:
                upper = max(record.upper_ms, table.since_ms)
            committed = await _committed(kv, keys, topic, table.active)
    partitions = complete_partitions(
        plan_input.clock, plan_input.ranges, width_s=width_s, upper_ms=upper
    )
    return [p.start_ms for p in partitions if p.start_ms not in committed]


def not_complete_error(topic: str, start: int, width_s: int, plan_input: PlanInput) -> ConvertError:
    """The error refusing ``topic``'s partition ``start``: it is not complete (says where the
    topic's clock is and when to convert it)."""
    clock = plan_input.clock
    where = (
        "it has no ingest clock yet"
        if clock is None
        else f"its clock is at {_iso(clock.ingest_ms)}"
    )
    return ConvertError(
        f"partition {start} ({_iso(start)}, {width_s} s) of {topic} is not complete: {where}; "
        f"convert it once the topic's clock has passed {_iso(partition_end(start, width_s))}",
        cause="not_complete",
    )


def _choose(
    topic: str,
    width_s: int,
    since_ms: int,
    upper_ms: int,
    plan_input: PlanInput,
    committed: Mapping[int, PartitionCommit],
    starts_ms: Sequence[int] | None,
) -> tuple[list[Partition], list[PartitionCommit]]:
    """The partitions to convert and the requested ones already committed."""
    if starts_ms is None:
        partitions = complete_partitions(
            plan_input.clock, plan_input.ranges, width_s=width_s, upper_ms=upper_ms,
            limit=DEFAULT_LIMIT,
        )  # fmt: skip
        return [p for p in partitions if p.start_ms not in committed], []
    todo: list[Partition] = []
    done: list[PartitionCommit] = []
    for start in sorted(set(starts_ms)):
        try:
            partition_end(start, width_s)
        except AnalyticsError as exc:
            raise ConvertError(
                f"cannot convert partition {start} of {topic}: {exc}", cause="not_a_partition"
            ) from exc
        if start < since_ms:
            raise ConvertError(
                f"partition {start} ({_iso(start)}) of {topic} is before the table's since "
                f"{_iso(since_ms)}: it is not kept; ask for a later partition",
                cause="before_since",
            )
        if start in committed:
            done.append(committed[start])
            continue
        found = complete_partitions(
            plan_input.clock, plan_input.ranges, width_s=width_s, upper_ms=start, limit=1
        )
        if not found or found[0].start_ms != start:
            raise not_complete_error(topic, start, width_s, plan_input)
        todo.append(found[0])
    return todo, done


def _result(record: PartitionCommit, outcome: Literal["committed", "already"]) -> PartitionResult:
    return PartitionResult(
        record.start_ms,
        record.end_ms,
        record.rows,
        record.first_offset,
        record.last_offset,
        [f.path for f in record.files],
        outcome,
    )


async def convert(
    *,
    kv: KV,
    keys: Keys,
    objects: ObjectStore,
    warehouse: ObjectStore,
    topic: str,
    starts_ms: Sequence[int] | None = None,
    engine: Engine = "local",
    spark: SparkSession | None = None,
    width_s: int = DEFAULT_WIDTH_S,
    root: str = DEFAULT_ROOT,
    rendition: str | None = None,
    objects_spec: StoreSpec | None = None,
    warehouse_spec: StoreSpec | None = None,
    iceberg: IcebergTarget | None = None,
) -> ConvertResult:
    """Convert ``topic``'s complete partitions into committed Parquet (module docstring).

    ``starts_ms``: exactly these partitions (starts in ms); None: every complete partition the
    rendition has not committed (at most a day of minute partitions). ``width_s`` only applies
    when the table is created (an existing table keeps its width). ``rendition``: convert into
    this rendition instead of the active one (e.g. a new one being built). Engine ``"spark"``
    needs ``objects_spec`` and ``warehouse_spec`` (how its tasks open the same stores) and
    uses ``spark`` or the active session. ``iceberg``: where the table is published once the
    run's commits are (``iceberg.publish``: the Iceberg table then holds exactly the active
    rendition's published partitions, including what earlier runs left unpublished).

    Raises :class:`ConvertError` for a partition that cannot be converted (not complete, before
    the table's since, an object missing or damaged), the commit errors of ``commit.py`` and
    ``IcebergPublishError`` (the run's Parquet commits stand; the next run publishes them).
    """
    check_root(root)
    if engine not in ("local", "spark"):
        raise ConvertError(f"unknown engine {engine!r}: use 'local' or 'spark'")
    if engine == "spark" and (objects_spec is None or warehouse_spec is None):
        raise ConvertError(
            "the spark engine needs objects_spec and warehouse_spec: how its tasks open the "
            "object stores (StoreSpec.from_config for the daemon's store)"
        )
    plan_input = await read_plan_input(kv, keys, topic)
    dead_letters = iceberg is not None and iceberg.dead_letters
    active = await _ensure_rendition(kv, keys, topic, width_s, plan_input, dead_letters)
    name = rendition or active
    if name == active:  # a newer version of the topic's subject that extends the rendition's
        await evolve_schema(kv, keys, topic)
    await finish_published(kv, keys, topic, warehouse, root)
    table = await read_table(kv, keys, topic)
    record = await read_rendition(kv, keys, topic, name)
    if table is None or record is None or record.state == "collected":
        raise ConvertError(f"{topic} has no rendition {name} to convert into (or it is collected)")
    plan_input = await read_plan_input(kv, keys, topic)
    committed = await _committed(kv, keys, topic, name)
    todo, done = _choose(
        topic,
        table.width_s,
        table.since_ms,
        max(record.upper_ms, table.since_ms),
        plan_input,
        committed,
        starts_ms,
    )
    results = {r.start_ms: _result(r, "already") for r in done}
    failure: ConvertError | None = None
    if todo:
        decoder = await rendition_decoder(kv, keys, topic, record)
        intent = await begin(kv, keys, topic, name, [p.start_ms for p in todo], plan_input.revision)
        async with intent:
            tasks = [
                _Task(
                    topic,
                    p.start_ms,
                    tuple(
                        plan_reads(
                            p.ranges,
                            start_offset=p.min_offset,
                            end_offset=p.end_offset,
                            start_ms=p.start_ms,
                            end_ms=p.end_ms,
                        )
                    ),
                    intent.staging_path(root, f"{root}{final}"),
                    decoder,
                    intent.staging_path(root, dead_letters_of(root, f"{root}{final}"))
                    if record.dead_letters
                    else None,
                )
                for p in todo
                for final in [partition_dir(name, topic, p.start_ms, table.width_s)]
            ]
            staged: dict[int, _Staged] = {}
            remote = [t for t in tasks if t.parts] if engine == "spark" else []
            if remote:
                assert objects_spec is not None and warehouse_spec is not None
                for done_task in await asyncio.to_thread(
                    _run_on_spark, spark, remote, objects_spec, warehouse_spec
                ):
                    staged[done_task.start_ms] = done_task
            for task in tasks:
                answer = staged.get(task.start_ms)
                if failure is not None:
                    # Past a failure nothing is committed: remove what was staged for it.
                    for info in () if answer is None else answer.files:
                        await warehouse.delete(info.path)
                    continue
                if answer is None:
                    answer = await _stage(objects, warehouse, task)
                if answer.error is not None:
                    failure = ConvertError(
                        f"conversion of {topic} partition {task.start_ms} "
                        f"({_iso(task.start_ms)}) failed, nothing of it was committed: "
                        f"{answer.error}",
                        retriable=answer.retriable,
                        cause="read_failed",
                    )
                    continue
                outcome = await commit_partition(
                    intent, warehouse, root, task.start_ms, table.width_s, answer.files,
                    record.converter_version,
                )  # fmt: skip
                results[task.start_ms] = _result(outcome.record, outcome.status)
    upper = await advance_frontier(kv, keys, topic, name)
    published = None
    if iceberg is not None:
        # (Also after a failure: what the run did commit becomes visible by name.)
        published = await publish(kv, keys, topic, iceberg)
    if failure is not None:
        log.error("conversion failed topic=%s rendition=%s error=%s", topic, name, failure)
        raise failure
    partitions = [results[s] for s in sorted(results)]
    log.info(
        "conversion done topic=%s rendition=%s engine=%s partitions=%d committed=%d rows=%d "
        "upper_ms=%d input_revision=%d",
        topic,
        name,
        engine,
        len(partitions),
        sum(p.outcome == "committed" for p in partitions),
        sum(p.rows for p in partitions if p.outcome == "committed"),
        upper,
        plan_input.revision,
    )
    return ConvertResult(topic, name, partitions, upper, plan_input.revision, published)


def result_json(result: ConvertResult) -> dict[str, Any]:
    """``result`` as plain JSON values (for the job's output and Dagster metadata)."""
    return {
        "topic": result.topic,
        "rendition": result.rendition,
        "upper_ms": result.upper_ms,
        "input_revision": result.input_revision,
        "iceberg_table": None if result.published is None else result.published.table,
        "iceberg_snapshot": None if result.published is None else result.published.snapshot_id,
        "partitions": [
            {
                "start_ms": p.start_ms,
                "end_ms": p.end_ms,
                "rows": p.rows,
                "first_offset": p.first_offset,
                "last_offset": p.last_offset,
                "files": list(p.files),
                "outcome": p.outcome,
            }
            for p in result.partitions
        ],
    }
