"""``danube-ingest tables``: the topics' Parquet tables, and one conversion run.

* ``tables [--topic T]`` lists each table (width, active rendition, ``since``/``upper``
  frontiers as ISO times), its renditions (state, converter, decode schema, frontier, holds)
  and each rendition's last commit. Reads etcd only; changes nothing.
* ``tables convert --topic T [--width-s N] [--engine local|spark] [--start-ms N ...]`` runs
  ``analytics.convert`` once with the daemon's config (object store, etcd): the complete
  partitions not committed yet, or exactly the ones named. The warehouse is the daemon's object
  store under ``warehouse/`` (``{data_dir}/objects/warehouse/`` by default). Exit 1 when the
  conversion fails (the error names the partition, and the object key and byte position when
  an object is bad; earlier partitions stay committed). With ``--rendition rN`` it converts
  into that rendition instead of the active one, in as many runs as it takes to catch up.
  Exit 2, writing nothing, for a topic that does not exist (unless
  ``--create-for-future-topic``) or is non-reliable (its messages are never stored).
  ``--wait`` shows its progress on stderr.
* ``tables path --topic T`` prints where the table's active rendition keeps that topic's files
  (a directory for fs, an ``s3://``/``gs://`` URL otherwise): the one path that holds exactly
  that topic's table (rendition numbers are per table, so ``warehouse/r1`` mixes topics).
* ``tables rendition --topic T`` creates the next rendition (``building``) and prints its name;
  ``tables activate --topic T --rendition rN`` hands readers over to it (exit 1, naming the
  frontiers, while it is behind the table's ``upper``); ``tables collect [--topic T]
  [--grace-s N]`` deletes dead runs' staging and the draining renditions no reader holds
  (``analytics.lifecycle``), printing what it collected and what is still held.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from danube_ingest.analytics.convert import PartitionResult, StoreSpec, convert
from danube_ingest.analytics.errors import AnalyticsError, RenditionError
from danube_ingest.analytics.follow import tail_round
from danube_ingest.analytics.iceberg import (
    IcebergPublishError,
    IcebergTarget,
    PublishResult,
    publish,
)
from danube_ingest.analytics.layout import (
    DEFAULT_ROOT,
    DEFAULT_WIDTH_S,
    partition_end,
    partition_start,
    topic_prefix,
)
from danube_ingest.analytics.lifecycle import COLLECT_GRACE_S, collect, new_rendition
from danube_ingest.analytics.plan import read_plan_input
from danube_ingest.analytics.records import (
    HoldRecord,
    PartitionCommit,
    RenditionRecord,
    TableKeys,
    TableRecord,
)
from danube_ingest.analytics.renditions import activate, read_table
from danube_ingest.analytics.session import spark_session
from danube_ingest.analytics.tail import read_tail
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.progress import PLAIN_INTERVAL_S
from danube_ingest.config import load_config
from danube_ingest.config.models import BrokerConfig
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import Get
from danube_ingest.metadata.records import Records, TopicRecord
from danube_ingest.objects.store import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: given before or after "convert", an option is not reset by the other parser.
    hidden = argparse.SUPPRESS
    parser.add_argument("--config", default=hidden, help="broker config file (objects, etcd)")
    parser.add_argument(
        "--data-dir",
        default=hidden,
        help="broker data directory (fs objects under DATA_DIR/objects)",
    )
    parser.add_argument("--etcd", default=hidden, help="etcd endpoint URL(s), comma-separated")
    parser.add_argument("--prefix", default=hidden, help="metadata key prefix")


def register(commands: Any) -> None:
    text = "list the topics' Parquet tables, renditions, frontiers and last commits"
    group = commands.add_parser("tables", help=text, description=text)
    _common(group)
    group.add_argument("--topic", default=argparse.SUPPRESS, help="only this topic")
    group.set_defaults(handler=_list)
    sub = group.add_subparsers(dest="tables_command", metavar="ACTION")
    text = "convert a topic's complete partitions into committed Parquet, once"
    cmd = sub.add_parser("convert", help=text, description=text)
    _common(cmd)
    cmd.add_argument("--topic", required=True, help="the topic, /namespace/topic")
    cmd.add_argument(
        "--width-s",
        type=int,
        default=DEFAULT_WIDTH_S,
        help="partition width in seconds when the table is created (3600, or a divisor of it "
        "of at least 60); an existing table keeps its width",
    )
    cmd.add_argument(
        "--engine",
        choices=("local", "spark"),
        default="local",
        help="local: this process (default); spark: one Spark task per partition",
    )
    cmd.add_argument(
        "--start-ms",
        type=int,
        action="append",
        help="convert exactly this partition (start, ms since the epoch); repeatable",
    )
    cmd.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to SECONDS until every partition that began before this command "
        "is complete (the topic clock has passed the end of the current partition); exit 1 "
        "if it is not by then (default 0: convert what is complete now)",
    )
    cmd.add_argument(
        "--rendition",
        help="convert into this rendition (e.g. one made by 'tables rendition') instead of the "
        "active one, catching up every complete partition it has not committed",
    )
    cmd.add_argument(
        "--create-for-future-topic",
        action="store_true",
        help="create the table even though the topic does not exist yet (without it, a topic "
        "that does not exist is refused with exit 2, so a typo creates nothing)",
    )
    cmd.set_defaults(handler=_convert)
    text = "print where the active rendition keeps a topic's Parquet files (for spark.read)"
    cmd = sub.add_parser("path", help=text, description=text, formatter_class=DefaultsHelpFormatter)
    _common(cmd)
    cmd.add_argument("--topic", required=True, help="the topic, /namespace/topic")
    cmd.set_defaults(handler=_path)
    text = "create the next rendition of a topic's table (current converter and decode schema)"
    cmd = sub.add_parser(
        "rendition", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.add_argument("--topic", required=True, help="the topic, /namespace/topic")
    cmd.add_argument(
        "--dead-letters",
        choices=("keep", "table"),
        default=None,
        help="rows whose payload does not decode: keep them in the table, or put them in the "
        "<topic>__dlq table (default: the configuration's iceberg.dead_letters)",
    )
    cmd.set_defaults(handler=_rendition)
    text = "hand a topic's readers over to a rendition (one etcd transaction)"
    cmd = sub.add_parser(
        "activate", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.add_argument("--topic", required=True, help="the topic, /namespace/topic")
    cmd.add_argument(
        "--rendition",
        required=True,
        help="the rendition to activate; refused while it is behind the table's upper",
    )
    cmd.set_defaults(handler=_activate)
    text = (
        "make the topics' Iceberg tables hold exactly their active renditions' committed files "
        "(registers existing tables in the catalog in place: no file is copied or rewritten)"
    )
    cmd = sub.add_parser(
        "publish", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.add_argument(
        "--topic", default=argparse.SUPPRESS, help="only this topic's table (default: every table)"
    )
    cmd.set_defaults(handler=_publish)
    text = (
        "keep the topics' Iceberg tables fresh: every --interval-s, append each table's tail "
        "(its entries past the complete partitions, up to the clock rounded down to "
        "iceberg.tail_step_seconds) and publish it; what the Dagster sensor iceberg_tail_sensor "
        "does, for deployments without Dagster"
    )
    cmd = sub.add_parser(
        "follow", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.add_argument(
        "--topic", default=argparse.SUPPRESS, help="only this topic's table (default: every table)"
    )
    cmd.add_argument("--interval-s", type=float, default=10.0, help="seconds between two rounds")
    cmd.add_argument("--once", action="store_true", help="one round, then exit")
    cmd.set_defaults(handler=_follow)
    text = "delete dead runs' staging and the draining renditions no reader holds"
    cmd = sub.add_parser(
        "collect", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.add_argument(
        "--topic", default=argparse.SUPPRESS, help="only this topic's table (default: every table)"
    )
    cmd.add_argument(
        "--grace-s",
        type=float,
        default=COLLECT_GRACE_S,
        help="collect a dead run's staging only once it began this many seconds ago",
    )
    cmd.set_defaults(handler=_collect)


def _config(args: argparse.Namespace) -> tuple[BrokerConfig, list[str], Keys]:
    data_dir = getattr(args, "data_dir", None)
    config = load_config(
        getattr(args, "config", None), {"broker.data_dir": data_dir} if data_dir else None
    )
    etcd = getattr(args, "etcd", None)
    endpoints = etcd.split(",") if etcd else list(config.etcd.endpoints)
    return config, endpoints, Keys(getattr(args, "prefix", None) or config.etcd.prefix)


async def _connect(config: BrokerConfig, endpoints: list[str]) -> EtcdKV:
    """An etcd connection to ``endpoints`` with the config's connect timeout, TLS and auth."""
    return await EtcdKV.connect(
        endpoints,
        timeout=config.etcd.connect_timeout_seconds,
        security=EtcdSecurity.from_config(config.etcd),
    )


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _list(args: argparse.Namespace) -> int:
    return asyncio.run(_list_async(args))


async def _list_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    kv = await _connect(config, endpoints)
    try:
        topic = getattr(args, "topic", None)
        topics = [topic] if topic else [r.name for r in await Records(kv, keys).list_topics()]
        shown = 0
        for name in sorted(topics):
            shown += await _show(kv, keys, name, always=bool(topic))
        if not shown and not topic:
            print("no tables (run: danube-ingest tables convert --topic T)")
    finally:
        await kv.close()
    return 0


async def _show(kv: EtcdKV, keys: Keys, topic: str, *, always: bool) -> int:
    tables = TableKeys(keys, topic)
    read = await kv.txn(
        [],
        [
            Get(tables.table()),
            Get(tables.renditions_prefix(), True),
            Get(tables.holds_prefix(), True),
        ],
    )
    table_kv = read.kv(0)
    if table_kv is None:
        if always:
            print(f"topic {topic}: no table")
        return 0
    table = TableRecord.decode(table_kv.value, table_kv.key)
    print(
        f"table {topic}: width {table.width_s} s, active {table.active or '-'}, "
        f"since {_iso(table.since_ms)}, upper {_iso(table.upper_ms)}"
    )
    holds: dict[str, int] = {}
    for entry in read.responses[2].kvs:
        held = HoldRecord.decode(entry.value, entry.key).rendition
        holds[held] = holds.get(held, 0) + 1
    renditions = {e.key: e for e in read.responses[1].kvs if tables.is_rendition(e.key)}
    for key, entry in sorted(renditions.items()):
        name = key.rsplit("/", 1)[1]
        record = RenditionRecord.decode(entry.value, key)
        print(
            f"  rendition {name}: {record.state}, upper {_iso(record.upper_ms)}, converter "
            f"{record.converter_version}, schema {record.schema_ref or '-'}, "
            f"dead letters {'table' if record.dead_letters else 'kept'}, "
            f"readers {holds.get(name, 0)}"
        )
        parts = await kv.get_prefix(tables.parts_prefix(name))
        if not parts:
            print("    no commits")
            continue
        last = PartitionCommit.decode(parts[-1].value, parts[-1].key)
        offsets = f"{last.first_offset}..{last.last_offset}" if last.rows else "none"
        print(
            f"    {len(parts)} partitions; last {_iso(last.start_ms)}: {last.rows} rows, "
            f"offsets {offsets}, {len(last.files)} files, committed {_iso(last.committed_ms)}"
            f"{'' if last.published else ', not published yet'}"
        )
    tail, _revision = await read_tail(kv, keys, topic)
    if tail is not None and tail.active_pieces(table):
        shown = tail.active_pieces(table)
        rows = sum(f.rows for p in shown for f in p.files)
        print(
            f"  tail ({tail.rendition}): to {_iso(shown[-1].end_ms)}, {len(shown)} pieces, "
            f"{rows} rows"
        )
    return 1


async def _wait_complete(kv: EtcdKV, keys: Keys, topic: str, width_s: int, seconds: float) -> bool:
    """Wait until the topic clock passes the end of the partition holding now (the table's
    width, else ``width_s``); False (and a message) if it does not within ``seconds``.

    Progress goes to stderr as ``produce``'s does: one redrawn line on a terminal, else a line
    every ``PLAIN_INTERVAL_S`` seconds."""
    table = await read_table(kv, keys, topic)
    width = width_s if table is None else table.width_s
    now_ms = time.time_ns() // 1_000_000
    target = partition_end(partition_start(now_ms, width), width)
    tty = sys.stderr.isatty()
    started = time.monotonic()
    deadline = started + seconds
    shown = float("-inf")
    while True:
        clock = (await read_plan_input(kv, keys, topic)).clock
        at = "no clock yet" if clock is None else f"its clock is at {_iso(clock.ingest_ms)}"
        now = time.monotonic()
        if clock is not None and clock.ingest_ms >= target:
            print(
                ("\r" if tty else "")
                + f"{topic} is complete up to {_iso(target)} (waited {now - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            return True
        if now >= deadline:
            if tty:
                print(file=sys.stderr)
            print(
                f"danube-ingest: {topic} is not complete up to {_iso(target)} after {seconds} s "
                f"({at}); is the daemon running and the topic owned?",
                file=sys.stderr,
            )
            return False
        if tty or now - shown >= PLAIN_INTERVAL_S:
            shown = now
            line = (
                f"waiting for {topic} to be complete up to {_iso(target)}: {at}, "
                f"waited {now - started:.0f} s of {seconds:g} s"
            )
            print(
                f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True
            )
        await asyncio.sleep(1.0)


def _refusal(topic: str, record: TopicRecord | None, keys: Keys, future: bool) -> str | None:
    """Why ``tables convert`` must not touch ``topic`` (its record ``record``), or None."""
    if record is None and not future:
        return (
            f"topic {topic} does not exist (no topic record under etcd prefix {keys.prefix}); "
            "nothing was written. Check the name ('danube-ingest topics' lists them), or pass "
            "--create-for-future-topic to create its table before the topic exists"
        )
    if record is not None and not record.reliable:
        return (
            f"topic {topic} is non-reliable: its messages are delivered from memory and never "
            "stored (no WAL, no objects), so it has no table; nothing was written. Produce to "
            "a reliable topic instead ('danube-ingest produce' creates reliable topics; a "
            "danube-client producer needs DispatchStrategy.RELIABLE)"
        )
    return None


def _convert(args: argparse.Namespace) -> int:
    return asyncio.run(_convert_async(args))


async def _convert_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    kv = await _connect(config, endpoints)
    try:
        record = await Records(kv, keys).get_topic(args.topic)
        refusal = _refusal(args.topic, record, keys, args.create_for_future_topic)
        if refusal is not None:
            print(f"danube-ingest: {refusal}", file=sys.stderr)
            return 2
        spec = spark = None
        if args.engine == "spark":
            # Spark's JVM is started with no etcd (gRPC) connection open: gRPC skips its fork
            # handlers while a call is in flight, and the gateway's launch then fails now and
            # then ("Java gateway process exited"). Reconnected once Spark runs.
            await kv.close()
            spec = StoreSpec.from_config(config)
            spark = spark_session("danube-ingest-tables-convert")
            kv = await _connect(config, endpoints)
        objects = ObjectStore.from_config(config)
        try:
            iceberg = IcebergTarget.from_config(config)
            return await _convert_topic(args, kv, keys, objects, spark, spec, iceberg)
        finally:
            await objects.close()
    finally:
        await kv.close()


async def _convert_topic(
    args: argparse.Namespace,
    kv: EtcdKV,
    keys: Keys,
    objects: ObjectStore,
    spark: SparkSession | None,
    spec: StoreSpec | None,
    iceberg: IcebergTarget | None,
) -> int:
    if args.wait > 0 and not await _wait_complete(kv, keys, args.topic, args.width_s, args.wait):
        return 1
    converted: list[PartitionResult] = []
    try:
        while True:
            result = await convert(
                kv=kv,
                keys=keys,
                objects=objects,
                warehouse=objects,
                topic=args.topic,
                starts_ms=args.start_ms,
                engine=args.engine,
                spark=spark,
                width_s=args.width_s,
                root=DEFAULT_ROOT,
                rendition=args.rendition,
                objects_spec=spec,
                warehouse_spec=spec,
                iceberg=iceberg,
            )
            converted += result.partitions
            # A run converts at most a day of partitions: a new rendition catches up from the
            # table's since in as many runs as it takes (the last one finds nothing to do).
            if args.rendition is None or args.start_ms or not result.partitions:
                break
    except AnalyticsError as exc:
        print(f"danube-ingest: conversion failed: {exc}", file=sys.stderr)
        return 1
    for part in converted:
        offsets = f"{part.first_offset}..{part.last_offset}" if part.rows else "none"
        print(
            f"partition {_iso(part.start_ms)}: {part.outcome}, {part.rows} rows, offsets "
            f"{offsets}, {len(part.files)} files"
        )
    print(
        f"topic {result.topic} rendition {result.rendition}: {len(converted)} "
        f"partitions, upper {_iso(result.upper_ms)}, objects {objects.description}"
    )
    if result.published is not None:
        print(f"iceberg table {result.published.table}: {_snapshot_text(result.published)}")
    return 0


def _snapshot_text(published: PublishResult) -> str:
    if published.snapshot_id is None:
        return "unchanged"
    return f"snapshot {published.snapshot_id} (+{published.added} -{published.removed} files)"


def _location(spec: StoreSpec, key: str) -> str:
    """Where Spark finds ``key`` of the store ``spec``: a local path for fs, else a URL."""
    root = spec.options.get("root", "")
    if spec.scheme == "fs":
        return str(Path(root) / key) + "/"
    scheme = {"s3": "s3", "gcs": "gs"}.get(spec.scheme, spec.scheme)
    prefix = "/".join(p for p in (root.strip("/"), key) if p)
    return f"{scheme}://{spec.options.get('bucket', '')}/{prefix}"


def _path(args: argparse.Namespace) -> int:
    return asyncio.run(_path_async(args))


async def _path_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    kv = await _connect(config, endpoints)
    try:
        table = await read_table(kv, keys, args.topic)
    finally:
        await kv.close()
    if table is None or table.active is None:
        print(
            f"danube-ingest: topic {args.topic} has no table with an active rendition; "
            f"create it with: danube-ingest tables convert --topic {args.topic}",
            file=sys.stderr,
        )
        return 1
    spec = StoreSpec.from_config(config)
    print(_location(spec, topic_prefix(DEFAULT_ROOT, table.active, args.topic)))
    return 0


def _rendition(args: argparse.Namespace) -> int:
    return asyncio.run(_rendition_async(args))


async def _rendition_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    kv = await _connect(config, endpoints)
    try:
        choice = args.dead_letters or config.iceberg.dead_letters
        name = await new_rendition(kv, keys, args.topic, dead_letters=choice == "table")
    except RenditionError as exc:
        print(f"danube-ingest: cannot create a rendition: {exc}", file=sys.stderr)
        return 1
    finally:
        await kv.close()
    print(name)
    return 0


def _activate(args: argparse.Namespace) -> int:
    return asyncio.run(_activate_async(args))


async def _activate_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    kv = await _connect(config, endpoints)
    try:
        table = await activate(kv, keys, args.topic, args.rendition)
        print(f"table {args.topic}: active {table.active}, upper {_iso(table.upper_ms)}")
        iceberg = IcebergTarget.from_config(config)
        if iceberg is not None:
            published = await publish(kv, keys, args.topic, iceberg)
            if published is not None:
                print(f"iceberg table {published.table}: {_snapshot_text(published)}")
    except RenditionError as exc:
        print(f"danube-ingest: activation refused: {exc}", file=sys.stderr)
        return 1
    except IcebergPublishError as exc:
        print(
            f"danube-ingest: activated, but the Iceberg table still shows the previous "
            f"rendition: {exc}; publish it with: danube-ingest tables publish --topic "
            f"{args.topic}",
            file=sys.stderr,
        )
        return 1
    finally:
        await kv.close()
    return 0


def _publish(args: argparse.Namespace) -> int:
    return asyncio.run(_publish_async(args))


async def _publish_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    iceberg = IcebergTarget.from_config(config)
    if iceberg is None:
        print(
            "danube-ingest: no Iceberg catalog (iceberg.catalog is off, or the object store is "
            "memory): nothing to publish",
            file=sys.stderr,
        )
        return 2
    kv = await _connect(config, endpoints)
    failed = 0
    try:
        topic = getattr(args, "topic", None)
        topics = [topic] if topic else [r.name for r in await Records(kv, keys).list_topics()]
        for name in sorted(topics):
            try:
                published = await publish(kv, keys, name, iceberg)
            except IcebergPublishError as exc:
                print(f"danube-ingest: {name}: {exc}", file=sys.stderr)
                failed += 1
                continue
            if published is None:
                if topic:
                    print(f"topic {name}: no active table (run: danube-ingest tables convert)")
                continue
            print(f"iceberg table {published.table}: {_snapshot_text(published)}")
    finally:
        await kv.close()
    return 1 if failed else 0


def _follow(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_follow_async(args))
    except KeyboardInterrupt:
        return 0


async def _follow_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    iceberg = IcebergTarget.from_config(config)
    step_s = config.iceberg.tail_step_seconds
    if iceberg is None or step_s == 0:
        print(
            "danube-ingest: no tails to follow (iceberg.catalog is off, the object store is "
            "memory, or iceberg.tail_step_seconds is 0)",
            file=sys.stderr,
        )
        return 2
    if args.interval_s <= 0:
        print("danube-ingest: --interval-s must be > 0", file=sys.stderr)
        return 2
    topic = getattr(args, "topic", None)
    objects = ObjectStore.from_config(config)
    kv = await _connect(config, endpoints)
    failed = False
    try:
        while True:
            began = time.monotonic()
            done = await tail_round(
                kv,
                keys,
                objects,
                iceberg,
                root=DEFAULT_ROOT,
                step_s=step_s,
                topics=None if topic is None else [topic],
            )
            for step in done.moved:
                print(
                    f"tail {step.topic}: frontier {_iso(step.frontier_ms)}, +{step.added} "
                    f"pieces ({step.rows} rows), -{step.dropped}",
                    flush=True,
                )
            for problem in done.problems:
                print(f"danube-ingest: {problem}", file=sys.stderr, flush=True)
            failed = bool(done.problems)
            if args.once:
                break
            await asyncio.sleep(max(0.0, args.interval_s - (time.monotonic() - began)))
    finally:
        await kv.close()
        await objects.close()
    return 1 if failed else 0


def _collect(args: argparse.Namespace) -> int:
    return asyncio.run(_collect_async(args))


async def _collect_async(args: argparse.Namespace) -> int:
    config, endpoints, keys = _config(args)
    objects = ObjectStore.from_config(config)
    kv = await _connect(config, endpoints)
    try:
        result = await collect(
            kv,
            keys,
            objects,
            topic=getattr(args, "topic", None),
            staging_grace_s=args.grace_s,
            root=DEFAULT_ROOT,
            iceberg=IcebergTarget.from_config(config),
        )
    finally:
        await kv.close()
        await objects.close()
    for topic, rendition in result.collected:
        print(f"collected {topic} rendition {rendition}")
    for topic, rendition in result.held:
        print(f"held {topic} rendition {rendition}: a reader holds it; collect again later")
    print(" ".join(f"{k}={v}" for k, v in result.counts().items()))
    return 0
