"""Topics' tables as Apache Iceberg tables: the committed Parquet, registered in a catalog.

A topic ``/ns/name`` with a table (``convert.py``) is the Iceberg table (format v2)
``<catalog>.ns.name``: Spark SQL, pyiceberg and anything else with an Iceberg reader reach it by
name. Its data files are the table's published Parquet files themselves (same bytes, same
paths: nothing is copied or rewritten), partitioned by ``hour(ingest_time)`` and sorted by
``offset``; its metadata lives under ``iceberg/`` in the object store (or ``iceberg.warehouse``).

The etcd records stay what a table *is* (``commit.py``: committed partitions, the active
rendition, ``since`` and ``upper``); :func:`publish` makes the Iceberg table say the same. It
computes the files the table must hold, those of the active rendition's partitions in
``[since, upper)``, and the files its current snapshot holds, and commits the difference as
ONE snapshot (an append, or an overwrite when files leave: a rendition handed over, partitions
below a moved ``since``). Every such snapshot's summary carries ``danube.topic``,
``danube.rendition``, ``danube.since-ms``, ``danube.frontier-ms`` (the rendition's ``upper``:
the snapshot holds exactly the entries with ingest time in ``[since, frontier)``),
``danube.first-offset`` / ``danube.last-offset`` of the files it adds (-1: none),
``danube.converter`` and ``danube.tokens`` (the conversion runs that committed them).

Exactly once. The difference is computed from the table as committed, and pyiceberg's commit
asserts that the table's current snapshot is still the one it was computed from (optimistic
concurrency: of two publishers, the second's commit fails and it recomputes). After a commit
whose outcome is unknown (the catalog may have applied it and the answer was lost:
``CommitStateUnknownException``, a dropped connection), the table is loaded again and the
difference recomputed: files that did land are in the current snapshot, so no file is ever
added twice, and a publish that did not land is simply made again. Publishing the same state
twice commits nothing the second time.

Errors: :class:`IcebergPublishError` (retriable when the catalog or the store could not be
reached); the Parquet commit it follows stands either way, and the next :func:`publish` (every
conversion starts and ends with one) catches the table up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from danube_ingest.analytics.checks import CheckFinding
from danube_ingest.analytics.columns import DEAD_LETTER_SCHEMA, table_schema
from danube_ingest.analytics.errors import AnalyticsError
from danube_ingest.analytics.evolve import WIDENINGS
from danube_ingest.analytics.layout import dead_letters_of, topic_prefix, topic_subdir
from danube_ingest.analytics.records import (
    PartitionCommit,
    RenditionRecord,
    TableKeys,
    TableRecord,
)
from danube_ingest.analytics.renditions import read_rendition
from danube_ingest.analytics.tail import read_tail, tail_prefix, wanted_pieces
from danube_ingest.config.models import BrokerConfig
from danube_ingest.errors import ConfigError
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

__all__ = [
    "DEFAULT_JARS_DIR",
    "Freshness",
    "IcebergPublishError",
    "IcebergTarget",
    "MaintenanceResult",
    "PublishResult",
    "check_table",
    "freshness",
    "held_keys",
    "identifier",
    "maintain",
    "publish",
]

log = logging.getLogger(__name__)

#: Where ``make iceberg-jars`` puts Spark's Iceberg runtime and the SQLite JDBC driver
#: (``tools/iceberg/pom.xml``); ``DANUBE_INGEST_ICEBERG_JARS`` names another directory.
DEFAULT_JARS_DIR = Path(__file__).resolve().parents[2] / ".deps" / "iceberg"
JARS_ENV = "DANUBE_INGEST_ICEBERG_JARS"
#: The partition field of every table: the hour of ``ingest_time`` (partitions of a table
#: narrower than an hour fall in one hour each).
PARTITION_FIELD = "ingest_hour"
#: Commits tried before giving up when other publishers keep winning.
MAX_ATTEMPTS = 8
#: Maintenance defaults (``maintain``): snapshots younger than this stay (time travel to them
#: works; Iceberg's own default for ``history.expire.max-snapshot-age-ms``), the newest ones
#: always stay, and an unreferenced metadata file is deleted only once older than the grace (a
#: publisher writes its manifests before it commits them).
SNAPSHOT_MAX_AGE_S = 5 * 24 * 3600.0
#: Tail-only snapshots (``danube.tokens`` = ``tail``, one per tail step: thousands a day) expire
#: after an hour: every snapshot a table holds makes each commit slower (pyiceberg copies the
#: whole metadata), and the partitions' snapshots keep time travel at partition granularity.
TAIL_SNAPSHOT_MAX_AGE_S = 3600.0
MIN_SNAPSHOTS = 1
ORPHAN_GRACE_S = 3600.0
#: ``danube.tokens`` of a snapshot adding tail pieces (``tail.py``) rather than committed runs.
TAIL_TOKEN = "tail"
#: The summary key naming the runs a snapshot committed.
TOKENS = "danube.tokens"
#: How far a table may trail its partition width before ``Freshness.stale``: a partition is
#: converted once the topic clock passed its end, by the next sensor tick and run (seconds).
FRESHNESS_SLACK_S = 900.0
#: Table properties set at creation and by ``maintain``: each commit deletes metadata.json
#: versions beyond the newest ``METADATA_VERSIONS`` (pyiceberg and Spark both honour them).
METADATA_VERSIONS = 20


class IcebergPublishError(AnalyticsError):
    """A table could not be published to the Iceberg catalog (nothing of this attempt is
    visible to readers; the Parquet commit stands). ``retriable``: the catalog or the object
    store could not be reached."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


@dataclass(frozen=True)
class PublishResult:
    """What :func:`publish` did to one table."""

    table: str
    """``catalog.namespace.name``."""
    snapshot_id: int | None
    """The snapshot it committed; None when the table already said what etcd says."""
    added: int
    removed: int
    frontier_ms: int


def identifier(topic: str) -> tuple[str, str]:
    """The Iceberg ``(namespace, table)`` of a topic: ``/default/orders`` is
    ``("default", "orders")``."""
    return split_topic(topic)


#: Appended to a topic's table name for the table of its dead letters.
DEAD_LETTERS_SUFFIX = "__dlq"


def dead_letters_identifier(topic: str) -> tuple[str, str]:
    """The Iceberg ``(namespace, table)`` of a topic's dead letters: ``/default/orders`` has
    ``("default", "orders__dlq")``."""
    namespace, name = split_topic(topic)
    return namespace, f"{name}{DEAD_LETTERS_SUFFIX}"


def _sqlite_path(uri: str) -> str | None:
    """The file of a ``sqlite:///path`` URL (None for any other database)."""
    if not uri.startswith("sqlite:///"):
        return None
    return uri[len("sqlite:///") :]


@dataclass(frozen=True)
class IcebergTarget:
    """Where a deployment's tables are published: the catalog (``iceberg`` configuration,
    resolved) and the URI prefix of the object store's keys."""

    name: str
    kind: str
    """``sql`` or ``rest``."""
    uri: str
    warehouse: str
    """URI where new tables' metadata goes."""
    location: str
    """URI prefix of the object store: a file's key appended to it is the file's URI."""
    properties: Mapping[str, str] = field(default_factory=dict)
    dead_letters: bool = False
    """Renditions created for this deployment keep rows that do not decode apart, in the
    ``<topic>__dlq`` table (``iceberg.dead_letters: table``)."""
    _catalog: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, config: BrokerConfig) -> IcebergTarget | None:
        """The target of ``config`` (``iceberg`` and ``storage.cloud``); None when
        ``iceberg.catalog`` is ``off`` or the object store is ``memory`` (it lives in one
        process: no other reader could open the files)."""
        ice = config.iceberg
        if ice.catalog == "off":
            return None
        cloud = config.storage.cloud
        if cloud.backend == "fs":
            # (Not percent-encoded: readers take the path after file:// as it is.)
            location = f"file://{Path(config.objects_root()).resolve()}/"
        elif cloud.backend in ("s3", "gcs"):
            scheme = "s3" if cloud.backend == "s3" else "gs"
            root = cloud.root.strip("/")
            location = f"{scheme}://{cloud.bucket}/" + (f"{root}/" if root else "")
        else:
            # A memory store lives in one process: no catalog reader could open its files.
            return None
        uri = ice.uri
        if ice.catalog == "sql" and not uri:
            uri = f"sqlite:///{(config.broker.data_dir / 'iceberg' / 'catalog.db').resolve()}"
        properties = dict(ice.properties)
        if cloud.backend == "s3":
            if cloud.endpoint is not None:
                properties.setdefault("s3.endpoint", cloud.endpoint)
            if cloud.region is not None:
                properties.setdefault("s3.region", cloud.region)
        return cls(
            ice.name,
            ice.catalog,
            uri,
            ice.warehouse or f"{location}iceberg",
            location,
            properties,
            ice.dead_letters == "table",
        )

    def uri_of(self, key: str) -> str:
        """The URI of the object store's ``key``."""
        return self.location + key

    def catalog(self) -> Catalog:
        """The pyiceberg catalog, made on first use and kept (one engine and connection pool
        for every table this target publishes or checks; the SQLite file's directory is
        created when missing)."""
        if self._catalog is None:
            object.__setattr__(self, "_catalog", self._new_catalog())
        catalog: Catalog = self._catalog
        return catalog

    def _new_catalog(self) -> Catalog:
        props = {**self.properties, "warehouse": self.warehouse}
        if self.kind == "rest":
            from pyiceberg.catalog.rest import RestCatalog

            return RestCatalog(self.name, **{**props, "uri": self.uri})
        from pyiceberg.catalog.sql import SqlCatalog

        path = _sqlite_path(self.uri)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        return SqlCatalog(self.name, **{**props, "uri": self.uri})

    def spark_config(self, jars_dir: Path | None = None) -> dict[str, str]:
        """Spark settings that make the catalog ``self.name`` in Spark SQL: the Iceberg runtime
        and JDBC driver jars (``jars_dir``: ``DANUBE_INGEST_ICEBERG_JARS``, else
        ``.deps/iceberg``), the Iceberg SQL extensions, and the catalog itself. ``ConfigError``
        when the jars are missing (run ``make setup``)."""
        directory = jars_dir or Path(os.environ.get(JARS_ENV) or DEFAULT_JARS_DIR)
        jars = sorted(str(p) for p in directory.glob("*.jar"))
        if not any("iceberg-spark-runtime" in Path(j).name for j in jars):
            raise ConfigError(
                f"no Iceberg Spark runtime jar in {directory}: run `make setup` (it fetches "
                f"them with Maven), or set {JARS_ENV} to a directory holding them"
            )
        prefix = f"spark.sql.catalog.{self.name}"
        settings = {
            "spark.jars": ",".join(jars),
            "spark.sql.extensions": (
                "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
            ),
            prefix: "org.apache.iceberg.spark.SparkCatalog",
            f"{prefix}.warehouse": self.warehouse,
            # Every query loads the table's current metadata: Iceberg's catalog cache would
            # show a session the snapshot it first read for up to 30 s (a query still reads
            # one snapshot throughout).
            f"{prefix}.cache-enabled": "false",
        }
        if self.kind == "rest":
            settings[f"{prefix}.type"] = "rest"
            settings[f"{prefix}.uri"] = self.uri
        else:
            settings[f"{prefix}.type"] = "jdbc"
            settings.update({f"{prefix}.{k}": v for k, v in _jdbc(self.uri).items()})
        for key, value in self.properties.items():
            settings[f"{prefix}.{key}"] = value
        return settings


def _jdbc(uri: str) -> dict[str, str]:
    """Iceberg JDBC catalog settings for a SQLAlchemy URL (SQLite or PostgreSQL)."""
    path = _sqlite_path(uri)
    if path is not None:
        return {"uri": f"jdbc:sqlite:{path}"}
    parts = urlsplit(uri)
    if parts.scheme.split("+")[0] in ("postgresql", "postgres"):
        settings = {"uri": f"jdbc:postgresql://{parts.hostname}:{parts.port or 5432}{parts.path}"}
        if parts.username:
            settings["jdbc.user"] = unquote(parts.username)
        if parts.password:
            settings["jdbc.password"] = unquote(parts.password)
        return settings
    raise ConfigError(
        f"iceberg.uri {parts.scheme}://...: Spark's JDBC catalog is set up for sqlite:/// and "
        "postgresql:// URLs only"
    )


@dataclass(frozen=True)
class _Wanted:
    """What etcd says the table holds."""

    rendition: str
    since_ms: int
    frontier_ms: int
    schema: pa.Schema
    converter: str
    files: dict[str, PartitionCommit]
    """URI of each file -> its partition's commit."""
    revision: int
    """The etcd revision of the table record read (every change of its active rendition,
    since or upper writes it): orders publishers' views of the table."""
    dead_letters: _Wanted | None = None
    """What the ``<topic>__dlq`` table holds: the dead-letter files of the same partitions and
    tail (none when the rendition keeps such rows in the table)."""
    keeps_apart: bool = False
    """The rendition keeps rows that do not decode apart (``RenditionRecord.dead_letters``):
    the ``__dlq`` table is created if absent (otherwise only an existing one is published,
    emptied)."""


async def _wanted(kv: KV, keys: Keys, topic: str, target: IcebergTarget) -> _Wanted | None:
    from danube_ingest.analytics.convert import rendition_decoder

    stored = await kv.get(TableKeys(keys, topic).table())
    if stored is None:
        return None
    table = TableRecord.decode(stored.value, stored.key)
    if table.active is None:
        return None
    record = await read_rendition(kv, keys, topic, table.active)
    if record is None:
        return None
    since, frontier = table.since_ms, max(record.upper_ms, table.since_ms)
    entries = await kv.get_prefix(TableKeys(keys, topic).parts_prefix(table.active))
    files: dict[str, PartitionCommit] = {}
    dead: dict[str, PartitionCommit] = {}
    for entry in entries:
        commit = PartitionCommit.decode(entry.value, entry.key)
        if since <= commit.start_ms < frontier:
            for f in commit.files:
                (dead if f.dead_letters else files)[target.uri_of(f.path)] = commit
    # The tail (tail.py): the entries past the partitions, up to its end.
    tail, _revision = await read_tail(kv, keys, topic)
    for piece in wanted_pieces(tail, table.active, frontier):
        rows = sum(f.rows for f in piece.files)
        as_commit = PartitionCommit(
            piece.start_ms,
            piece.end_ms,
            piece.files,
            rows,
            piece.files[0].first_offset if piece.files else -1,
            piece.files[-1].last_offset if piece.files else -1,
            0 if tail is None else tail.input_revision,
            record.converter_version,
            TAIL_TOKEN,
            0,
            True,
        )
        for f in piece.files:
            (dead if f.dead_letters else files)[target.uri_of(f.path)] = as_commit
        frontier = piece.end_ms
    decoder = await rendition_decoder(kv, keys, topic, record)
    # Top-level columns are optional in the catalog: a file may then lack a column a later
    # schema added (read as null), and the Parquet's required columns still match.
    schema = pa.schema([f.with_nullable(True) for f in table_schema(decoder)])
    main = _Wanted(
        table.active,
        since,
        frontier,
        schema,
        record.converter_version,
        files,
        stored.mod_revision,
    )
    letters = pa.schema([f.with_nullable(True) for f in DEAD_LETTER_SCHEMA])
    return replace(
        main,
        dead_letters=replace(main, schema=letters, files=dead),
        keeps_apart=record.dead_letters,
    )


def _create(
    catalog: Catalog, ident: tuple[str, str], schema: pa.Schema, *, create: bool = True
) -> Table | None:
    """The table, created (with its partition spec, sort order and name mapping) if absent
    (``create=False``: None then)."""
    from pyiceberg.exceptions import (
        NamespaceAlreadyExistsError,
        NoSuchTableError,
        TableAlreadyExistsError,
    )
    from pyiceberg.table import TableProperties
    from pyiceberg.transforms import HourTransform, IdentityTransform

    try:
        table = catalog.load_table(ident)
    except NoSuchTableError:
        if not create:
            return None
        with contextlib.suppress(NamespaceAlreadyExistsError):
            catalog.create_namespace(ident[0])
        try:
            table = catalog.create_table(ident, schema=schema, properties={"format-version": "2"})
        except TableAlreadyExistsError:
            table = catalog.load_table(ident)
    # (Idempotent: a creator that died before these leaves them to the next publish.)
    if not table.spec().fields or table.sort_order().is_unsorted:
        tx = table.transaction()
        if not table.spec().fields:
            with tx.update_spec() as spec:
                spec.add_field("ingest_time", HourTransform(), PARTITION_FIELD)
        if table.sort_order().is_unsorted:
            with tx.update_sort_order() as order:
                order.asc("offset", IdentityTransform())
        if table.metadata.name_mapping() is None:
            mapping = table.schema().name_mapping.model_dump_json()
            tx.set_properties({TableProperties.DEFAULT_NAME_MAPPING: mapping, **_TIDY})
        table = tx.commit_transaction()
    return table


#: See ``METADATA_VERSIONS``.
_TIDY = {
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": str(METADATA_VERSIONS),
}


def _current_files(table: Table) -> dict[str, Any]:
    """URI -> DataFile of the table's current snapshot."""
    if table.current_snapshot() is None:
        return {}
    return {task.file.file_path: task.file for task in table.scan().plan_files()}


def _difference(table: Table, wanted: _Wanted) -> tuple[dict[str, Any], list[str], list[str]]:
    """The current snapshot's files (URI -> DataFile), and the URIs etcd wants that it lacks
    and that it holds but etcd does not want, each sorted."""
    current = _current_files(table)
    added = sorted(set(wanted.files) - set(current))
    removed = sorted(set(current) - set(wanted.files))
    return current, added, removed


def _same_view(state: tuple[str, str, str] | None, wanted: _Wanted) -> bool:
    """The current snapshot (``_state``) holds ``wanted``'s rendition from its ``since``."""
    return state is not None and state[:2] == (wanted.rendition, str(wanted.since_ms))


def _summary(topic: str, wanted: _Wanted, added: list[str]) -> dict[str, str]:
    commits = [wanted.files[uri] for uri in added]
    offsets = [f.first_offset for c in commits for f in c.files if f.first_offset >= 0]
    lasts = [f.last_offset for c in commits for f in c.files if f.last_offset >= 0]
    return {
        "danube.topic": topic,
        "danube.rendition": wanted.rendition,
        "danube.since-ms": str(wanted.since_ms),
        "danube.frontier-ms": str(wanted.frontier_ms),
        "danube.first-offset": str(min(offsets, default=-1)),
        "danube.last-offset": str(max(lasts, default=-1)),
        "danube.converter": wanted.converter,
        TOKENS: ",".join(sorted({c.token for c in commits})),
        "danube.table-revision": str(wanted.revision),
    }


def _state(table: Table) -> tuple[str, str, str] | None:
    snapshot = table.current_snapshot()
    if snapshot is None or snapshot.summary is None:
        return None
    summary = snapshot.summary
    return (
        summary.get("danube.rendition", ""),
        summary.get("danube.since-ms", ""),
        summary.get("danube.frontier-ms", ""),
    )


def _behind(table: Table, wanted: _Wanted) -> bool:
    """The table's current snapshot was published from a newer view of the etcd records than
    ``wanted`` (a later frontier or since of the same rendition, or a later table revision)."""
    snapshot = table.current_snapshot()
    summary = None if snapshot is None else snapshot.summary
    if summary is None:
        return False
    try:
        revision = int(summary.get("danube.table-revision") or 0)
        since = int(summary.get("danube.since-ms") or 0)
        frontier = int(summary.get("danube.frontier-ms") or 0)
    except ValueError:
        return False
    if summary.get("danube.rendition") == wanted.rendition and (
        frontier > wanted.frontier_ms or since > wanted.since_ms
    ):
        return True
    return revision > wanted.revision


def _publish_once(
    catalog: Catalog, topic: str, wanted: _Wanted, ident: tuple[str, str], create: bool
) -> PublishResult | None:
    """One attempt: the difference committed as one snapshot; None when the commit failed
    because the table moved (recompute)."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    name = ".".join((catalog.name, *ident))
    found = _create(catalog, ident, wanted.schema, create=create)
    if found is None:
        return PublishResult(name, None, 0, 0, wanted.frontier_ms)
    table = found
    if _behind(table, wanted):
        # Another publisher already committed a newer view of the table: never go back.
        return PublishResult(name, None, 0, 0, wanted.frontier_ms)
    current, added, removed = _difference(table, wanted)
    # Nothing to add or remove: no snapshot, even if the frontier moved over empty
    # partitions (the summary's frontier may lag then; it is a lower bound), so an idle topic
    # does not add a snapshot per conversion.
    if not added and not removed and (not current or _same_view(_state(table), wanted)):
        return PublishResult(name, None, 0, 0, wanted.frontier_ms)
    tx = table.transaction()
    if _schema_grows(table.schema().as_arrow(), wanted.schema):
        with tx.update_schema() as update:  # a newer decode schema's columns, added or widened
            update.union_by_name(wanted.schema)
    props = _summary(topic, wanted, added)
    metadata = tx.table_metadata  # (a deep copy per access: read once)
    files = [parquet_file_to_data_file(table.io, metadata, uri) for uri in added]
    producer = tx.update_snapshot(snapshot_properties=props)
    with producer.overwrite() if removed else producer.fast_append() as update:
        for uri in removed:
            update.delete_data_file(current[uri])
        for data_file in files:
            update.append_data_file(data_file)
    try:
        table = tx.commit_transaction()
    except CommitFailedException as exc:
        log.info("iceberg commit lost a race, again table=%s error=%s", name, exc)
        return None
    snapshot = table.current_snapshot()
    assert snapshot is not None
    log.info(
        "iceberg table published table=%s snapshot=%d added=%d removed=%d rendition=%s "
        "frontier_ms=%d",
        name,
        snapshot.snapshot_id,
        len(added),
        len(removed),
        wanted.rendition,
        wanted.frontier_ms,
    )
    return PublishResult(name, snapshot.snapshot_id, len(added), len(removed), wanted.frontier_ms)


def _schema_grows(current: pa.Schema, wanted: pa.Schema) -> bool:
    """Whether ``wanted`` (the active rendition's columns) has a column the table lacks, or
    one widened since (int to long, float to double: ``evolve.py``)."""
    for column in wanted:
        index = current.get_field_index(column.name)
        if index < 0 or (current.field(index).type, column.type) in WIDENINGS:
            return True
    return False


def _publish_sync(
    target: IcebergTarget,
    topic: str,
    wanted: _Wanted,
    ident: tuple[str, str],
    create: bool = True,
) -> PublishResult:
    from pyiceberg.exceptions import CommitStateUnknownException

    catalog = target.catalog()
    last: BaseException | None = None
    for _ in range(MAX_ATTEMPTS):
        try:
            result = _publish_once(catalog, topic, wanted, ident, create)
        except CommitStateUnknownException as exc:
            # Applied or not: the next attempt reads the table again and adds only what is
            # not in it.
            log.warning("iceberg commit outcome unknown, reading the table again: %s", exc)
            last = exc
            continue
        if result is not None:
            return result
    raise IcebergPublishError(
        f"could not publish {topic} to the Iceberg catalog {target.name} in {MAX_ATTEMPTS} "
        f"attempts: other publishers kept committing first, or the outcome stayed unknown "
        f"({last}); publish again",
        retriable=True,
    )


async def publish(kv: KV, keys: Keys, topic: str, target: IcebergTarget) -> PublishResult | None:
    """Make ``topic``'s Iceberg table hold exactly its active rendition's files in
    ``[since, upper)`` (module docstring), and its ``__dlq`` table their dead letters (created
    when the rendition keeps them apart; an existing one is emptied when the active rendition
    keeps them in the table); None when the topic has no active table yet. The result is the
    topic's table's. Raises :class:`IcebergPublishError`."""
    wanted = await _wanted(kv, keys, topic, target)
    if wanted is None:
        return None
    try:
        result = await asyncio.to_thread(_publish_sync, target, topic, wanted, identifier(topic))
        if wanted.dead_letters is not None:
            await asyncio.to_thread(
                _publish_sync,
                target,
                topic,
                wanted.dead_letters,
                dead_letters_identifier(topic),
                wanted.keeps_apart,
            )
        return result
    except IcebergPublishError:
        raise
    except (OSError, ConnectionError) as exc:
        raise IcebergPublishError(
            f"publishing {topic} to the Iceberg catalog {target.name} failed: {exc}",
            retriable=True,
        ) from exc
    except Exception as exc:
        from sqlalchemy.exc import OperationalError

        raise IcebergPublishError(
            f"publishing {topic} to the Iceberg catalog {target.name} failed: "
            f"{type(exc).__name__}: {exc}",
            retriable=isinstance(exc, OperationalError),
        ) from exc


def _check_sync(target: IcebergTarget, topic: str, wanted: _Wanted) -> list[str]:
    from pyiceberg.conversions import from_bytes
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.types import LongType

    try:
        table = target.catalog().load_table(identifier(topic))
    except NoSuchTableError:
        if not wanted.files:
            return []
        return [f"no Iceberg table, but {len(wanted.files)} published files: publish it"]
    problems: list[str] = []
    current, missing, extra = _difference(table, wanted)
    if missing:
        problems.append(
            f"{len(missing)} published files are not in the current snapshot (e.g. "
            f"{min(missing)}): publish again (the next conversion does)"
        )
    if extra:
        problems.append(
            f"{len(extra)} files in the current snapshot are not the table's in etcd (e.g. "
            f"{min(extra)})"
        )
    state = _state(table)
    if current and (
        state is None
        or not _same_view(state, wanted)
        or not state[2].isdigit()
        or int(state[2]) > wanted.frontier_ms
    ):
        problems.append(
            f"the current snapshot says rendition/since/frontier {state}, etcd "
            f"{(wanted.rendition, wanted.since_ms, wanted.frontier_ms)}: publish again"
        )
    # No offset twice: the files' offset ranges (their column bounds) are disjoint.
    field_id = table.schema().find_field("offset").field_id
    spans = []
    for uri, data_file in current.items():
        low, high = data_file.lower_bounds.get(field_id), data_file.upper_bounds.get(field_id)
        if low is None or high is None:
            problems.append(f"{uri} has no offset bounds")
            continue
        spans.append((from_bytes(LongType(), low), from_bytes(LongType(), high), uri))
    spans.sort()
    for (_, high, uri), (low, _, other) in itertools.pairwise(spans):
        if low <= high:
            problems.append(f"offsets {low}..{high} are in two files: {uri} and {other}")
    # Snapshot frontiers never move back along the table's history (within a rendition).
    previous: tuple[str, int] | None = None
    for entry in table.history():
        snapshot = table.snapshot_by_id(entry.snapshot_id)
        summary = None if snapshot is None else snapshot.summary
        frontier = None if summary is None else summary.get("danube.frontier-ms")
        if summary is None or frontier is None:
            continue
        now = (str(summary.get("danube.rendition")), int(frontier))
        if previous is not None and now[0] == previous[0] and now[1] < previous[1]:
            problems.append(
                f"snapshot {entry.snapshot_id} moved the frontier back from {previous[1]} to "
                f"{now[1]}"
            )
        previous = now
    return problems


async def check_table(kv: KV, keys: Keys, topic: str, target: IcebergTarget) -> list[CheckFinding]:
    """What is wrong with ``topic``'s Iceberg table (empty: sound): its current snapshot holds
    exactly the active rendition's files in ``[since, upper)`` and says so in its summary, no
    offset is in two of its files, and its snapshots' frontiers never moved back. Reads only;
    findings name the table's ``since`` as their partition."""
    wanted = await _wanted(kv, keys, topic, target)
    if wanted is None:
        return []
    problems = await asyncio.to_thread(_check_sync, target, topic, wanted)
    return [CheckFinding(topic, wanted.since_ms, problem) for problem in problems]


@dataclass(frozen=True, slots=True)
class MaintenanceResult:
    """What ``maintain`` did to one table."""

    table: str
    snapshots_expired: int
    snapshots_kept: int
    files_deleted: int
    """Metadata files (manifests, manifest lists, metadata versions) no snapshot or metadata
    version referenced, older than the grace."""
    bytes_deleted: int


def _referenced(table: Table) -> set[str]:
    """Paths (scheme stripped) of every metadata file the table's metadata reaches."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    def path(uri: str) -> str:
        return PyArrowFileIO.parse_location(uri)[2]

    keep = {path(table.metadata_location)}
    keep.update(path(entry.metadata_file) for entry in table.metadata.metadata_log)
    for snapshot in table.metadata.snapshots:
        keep.add(path(snapshot.manifest_list))
        keep.update(path(m.manifest_path) for m in snapshot.manifests(table.io))
    for stats in [*table.metadata.statistics, *table.metadata.partition_statistics]:
        keep.add(path(stats.statistics_path))
    return keep


async def held_keys(target: IcebergTarget, topic: str) -> set[str]:
    """The object store keys of the data files some snapshot of ``topic``'s Iceberg table (or
    of its ``__dlq`` table) holds (empty when it has no table): what time travel may still
    read."""
    from pyiceberg.exceptions import NoSuchTableError

    def read() -> set[str]:
        found: set[str] = set()
        for ident in (identifier(topic), dead_letters_identifier(topic)):
            try:
                table = target.catalog().load_table(ident)
            except NoSuchTableError:
                continue
            found.update(
                uri[len(target.location) :]
                for uri in _referenced_data(table, uris=True)
                if uri.startswith(target.location)
            )
        return found

    return await asyncio.to_thread(read)


def _referenced_data(table: Table, *, uris: bool = False) -> set[str]:
    """Paths (scheme stripped; ``uris``: as the table names them) of the data files some
    remaining snapshot holds."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    seen: set[str] = set()
    found: set[str] = set()
    for snapshot in table.metadata.snapshots:
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in seen:
                continue
            seen.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                path = entry.data_file.file_path
                found.add(path if uris else PyArrowFileIO.parse_location(path)[2])
    return found


def _sweep(
    filesystem: Any, directory: str, keep: set[str], before_ns: int, marker: str = ""
) -> tuple[int, int]:
    """Delete the files below ``directory`` whose path contains ``marker``, is not in
    ``keep`` and that were last modified before ``before_ns``; (files, bytes) deleted."""
    from pyarrow import fs as pafs

    selector = pafs.FileSelector(directory.rstrip("/"), allow_not_found=True, recursive=True)
    deleted = size = 0
    for info in filesystem.get_file_info(selector):
        if info.type != pafs.FileType.File or marker not in info.path or info.path in keep:
            continue
        if info.mtime_ns is None or info.mtime_ns >= before_ns:
            continue  # young: a publisher may be about to commit it
        try:
            filesystem.delete_file(info.path)
        except FileNotFoundError:
            continue
        deleted += 1
        size += info.size or 0
    return deleted, size


def _tidy(
    catalog: Catalog,
    ident: tuple[str, str],
    *,
    max_snapshot_age_s: float,
    max_tail_snapshot_age_s: float,
    min_snapshots: int,
    now_ms: int,
    grace_ns: int,
) -> tuple[Table, int, int, int, int] | None:
    """Expire one table's old snapshots and delete its orphan metadata: the table as it is
    then, snapshots expired and kept, files and bytes deleted; None when it does not exist."""
    from pyiceberg.exceptions import NoSuchTableError
    from pyiceberg.io.pyarrow import PyArrowFileIO

    name = ".".join((catalog.name, *ident))
    try:
        table = catalog.load_table(ident)
    except NoSuchTableError:
        return None
    if any(table.properties.get(k) != v for k, v in _TIDY.items()):
        tx = table.transaction()
        tx.set_properties(_TIDY)
        table = tx.commit_transaction()
    # Snapshots: the current one, the newest ``min_snapshots`` and those younger than the
    # age stay; pyiceberg's expiry removes the others from the metadata and deletes no file
    # (the data files are the table's Parquet, deleted by ``lifecycle`` alone).
    current = table.current_snapshot()
    newest = sorted(table.metadata.snapshots, key=lambda s: s.timestamp_ms, reverse=True)
    kept = {s.snapshot_id for s in newest[: max(min_snapshots, 1)]}
    if current is not None:
        kept.add(current.snapshot_id)
    cutoff = now_ms - round(max_snapshot_age_s * 1000)
    tail_cutoff = now_ms - round(max_tail_snapshot_age_s * 1000)

    def old(snapshot: Any) -> bool:
        if snapshot.timestamp_ms < cutoff:
            return True
        tail = snapshot.summary is not None and snapshot.summary.get(TOKENS) == TAIL_TOKEN
        return tail and snapshot.timestamp_ms < tail_cutoff

    expired = [s.snapshot_id for s in newest if s.snapshot_id not in kept and old(s)]
    if expired:
        table.maintenance.expire_snapshots().by_ids(expired).commit()
        table = catalog.load_table(ident)
    # Orphan metadata: files under the table's metadata directory that nothing reaches.
    if not isinstance(table.io, PyArrowFileIO):
        log.warning("iceberg maintenance skips orphan files table=%s io=%s", name, table.io)
        return table, len(expired), len(newest) - len(expired), 0, 0
    scheme, netloc, root = PyArrowFileIO.parse_location(table.location())
    filesystem = table.io.fs_by_scheme(scheme, netloc)
    deleted, size = _sweep(filesystem, f"{root.rstrip('/')}/metadata", _referenced(table), grace_ns)
    return table, len(expired), len(newest) - len(expired), deleted, size


def _maintain_sync(
    target: IcebergTarget,
    topic: str,
    *,
    max_snapshot_age_s: float,
    max_tail_snapshot_age_s: float,
    min_snapshots: int,
    orphan_grace_s: float,
    now_ms: int,
    tails: tuple[list[tuple[str, str]], set[str]] | None = None,
) -> MaintenanceResult | None:
    from pyiceberg.io.pyarrow import PyArrowFileIO

    catalog = target.catalog()
    name = ".".join((catalog.name, *identifier(topic)))
    grace_ns = (now_ms - round(orphan_grace_s * 1000)) * 1_000_000
    tidied = [
        _tidy(
            catalog,
            ident,
            max_snapshot_age_s=max_snapshot_age_s,
            max_tail_snapshot_age_s=max_tail_snapshot_age_s,
            min_snapshots=min_snapshots,
            now_ms=now_ms,
            grace_ns=grace_ns,
        )
        for ident in (identifier(topic), dead_letters_identifier(topic))
    ]
    if tidied[0] is None:
        return None
    done = [t for t in tidied if t is not None]
    expired = sum(t[1] for t in done)
    kept = sum(t[2] for t in done)
    deleted = sum(t[3] for t in done)
    deleted_bytes = sum(t[4] for t in done)
    table = done[0][0]
    if tails is not None and isinstance(table.io, PyArrowFileIO):
        # Data files only old snapshots held (of the table or of its dead letters' table):
        # tail pieces (tail.py) the tail record no longer lists, and the files collection left
        # behind in collected renditions.
        directories, listed = tails
        held = {PyArrowFileIO.parse_location(u)[2] for u in listed}
        for t in done:
            held |= _referenced_data(t[0])
        for directory, marker in directories:
            d_scheme, d_netloc, d_root = PyArrowFileIO.parse_location(directory)
            count, size = _sweep(
                table.io.fs_by_scheme(d_scheme, d_netloc), d_root, held, grace_ns, marker
            )
            deleted, deleted_bytes = deleted + count, deleted_bytes + size
    log.info(
        "iceberg table maintained table=%s snapshots_expired=%d files_deleted=%d",
        name,
        expired,
        deleted,
    )
    return MaintenanceResult(name, expired, kept, deleted, deleted_bytes)


async def maintain(
    target: IcebergTarget,
    topic: str,
    *,
    max_snapshot_age_s: float = SNAPSHOT_MAX_AGE_S,
    max_tail_snapshot_age_s: float = TAIL_SNAPSHOT_MAX_AGE_S,
    min_snapshots: int = MIN_SNAPSHOTS,
    orphan_grace_s: float = ORPHAN_GRACE_S,
    now_ms: int | None = None,
    tails: tuple[KV, Keys, str] | None = None,
) -> MaintenanceResult | None:
    """Keep ``topic``'s Iceberg table tidy: expire its snapshots older than
    ``max_snapshot_age_s`` (never the current one nor the newest ``min_snapshots``: time
    travel to an expired snapshot fails with Iceberg's "snapshot not found"), then delete the
    metadata files under its ``metadata/`` directory that no remaining snapshot or metadata
    version references and that are older than ``orphan_grace_s`` (manifests and manifest
    lists of the expired snapshots, a crashed publisher's uncommitted ones). With ``tails``
    (etcd and the warehouse root), also the data files no remaining snapshot holds among the
    topic's tail pieces (``tail.py``; those its tail record lists stay) and in its collected
    renditions (``lifecycle.collect`` leaves the files snapshots still hold), older than the
    grace. No other data file is ever deleted here. None when the table does not exist. Raises
    :class:`IcebergPublishError` (retriable when the catalog or the store could not be
    reached)."""
    if min(max_snapshot_age_s, max_tail_snapshot_age_s, orphan_grace_s) < 0 or min_snapshots < 1:
        raise ConfigError(
            "iceberg maintenance: max_snapshot_age, max_tail_snapshot_age and orphan_grace must "
            f"be >= 0 and min_snapshots >= 1 (got {max_snapshot_age_s}, "
            f"{max_tail_snapshot_age_s}, {orphan_grace_s}, {min_snapshots})"
        )
    import time

    when = now_ms if now_ms is not None else int(time.time() * 1000)
    swept: tuple[list[tuple[str, str]], set[str]] | None = None
    if tails is not None:
        kv, keys, root = tails
        tail, _revision = await read_tail(kv, keys, topic)
        listed = {target.uri_of(f.path) for p in (tail.pieces if tail else []) for f in p.files}
        directories = [(target.uri_of(tail_prefix(root)), f"/{topic_subdir(topic)}")]
        tables = TableKeys(keys, topic)
        for entry in await kv.get_prefix(tables.renditions_prefix()):
            if tables.is_rendition(entry.key):
                record = RenditionRecord.decode(entry.value, entry.key)
                if record.state == "collected":
                    rendition = entry.key[len(tables.renditions_prefix()) :]
                    prefix = topic_prefix(root, rendition, topic)
                    directories.append((target.uri_of(prefix), ""))
                    directories.append((target.uri_of(dead_letters_of(root, prefix)), ""))
        swept = (directories, listed)
    try:
        return await asyncio.to_thread(
            _maintain_sync,
            target,
            topic,
            max_snapshot_age_s=max_snapshot_age_s,
            max_tail_snapshot_age_s=max_tail_snapshot_age_s,
            min_snapshots=min_snapshots,
            orphan_grace_s=orphan_grace_s,
            now_ms=when,
            tails=swept,
        )
    except (OSError, ConnectionError) as exc:
        raise IcebergPublishError(
            f"maintaining {topic}'s Iceberg table in {target.name} failed: {exc}", retriable=True
        ) from exc


@dataclass(frozen=True, slots=True)
class Freshness:
    """How far a topic's Iceberg table trails its topic (``freshness``)."""

    topic: str
    table: str
    width_s: int
    clock_ms: int | None
    """The topic clock: every entry with an ingest time below it is uploaded (None: no clock
    yet)."""
    frontier_ms: int | None
    """What the table's current snapshot holds (entries with an ingest time below it); None
    when the table has no snapshot. When the snapshot holds exactly what etcd says the table
    holds, etcd's frontier (a snapshot is not made for idle, empty partitions)."""
    published_ms: int
    """etcd's frontier: what conversions have committed (the active rendition's upper)."""

    @property
    def lag_ms(self) -> int | None:
        """Clock minus frontier: how much uploaded data no query by name sees yet."""
        if self.clock_ms is None or self.frontier_ms is None:
            return None
        return max(self.clock_ms - self.frontier_ms, 0)

    def stale(self, slack_s: float = FRESHNESS_SLACK_S) -> bool:
        """Trails by more than a partition and ``slack_s``, or holds nothing while committed
        partitions exist."""
        if self.frontier_ms is None:
            return self.published_ms > 0 and self.clock_ms is not None
        lag = self.lag_ms
        return lag is not None and lag > self.width_s * 1000 + slack_s * 1000


def _frontier_sync(target: IcebergTarget, topic: str, wanted: _Wanted) -> int | None:
    from pyiceberg.exceptions import NoSuchTableError

    try:
        table = target.catalog().load_table(identifier(topic))
    except NoSuchTableError:
        return None
    state = _state(table)
    if state is None or not state[2].isdigit():
        return None
    _current, missing, extra = _difference(table, wanted)
    if not missing and not extra and _same_view(state, wanted):
        return max(int(state[2]), wanted.frontier_ms)
    return int(state[2])


async def freshness(kv: KV, keys: Keys, topic: str, target: IcebergTarget) -> Freshness | None:
    """How far ``topic``'s Iceberg table trails the topic clock; None when the topic has no
    active table. Reads only."""
    from danube_ingest.metadata.clock import read_clock

    stored = await kv.get(TableKeys(keys, topic).table())
    wanted = await _wanted(kv, keys, topic, target)
    if stored is None or wanted is None:
        return None
    width_s = TableRecord.decode(stored.value, stored.key).width_s
    clock = await read_clock(kv, keys, topic)
    frontier = await asyncio.to_thread(_frontier_sync, target, topic, wanted)
    return Freshness(
        topic,
        ".".join((target.name, *identifier(topic))),
        width_s,
        None if clock is None else clock.ingest_ms,
        frontier,
        wanted.frontier_ms if wanted.files else 0,
    )
