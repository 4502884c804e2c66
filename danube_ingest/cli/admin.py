"""``danube-ingest topics``, ``subscriptions`` and ``status``: cluster state, read from etcd.

``status`` also reads each live broker's ``/metrics`` (the ``metrics_url`` it registered) for
what only the broker knows: WAL bytes, upload backlog and the lag of every subscription it
serves (its largest ``metrics.max_lag_series`` ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from danube_ingest.broker.deletion import delete_topic
from danube_ingest.broker.names import parse_topic, partition_base, partition_name
from danube_ingest.cli import subscriptions
from danube_ingest.cli.client import non_negative, topic_name
from danube_ingest.cli.etcd_args import add_etcd_security, etcd_security
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.retention import describe as describe_policy
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.durable import DurableEnd, read_durable_end
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.handover import LOST, PENDING, Handover, list_handovers
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.kv import KV
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.policies import Policies, RetentionPolicy, effective
from danube_ingest.metadata.records import Records, TopicRecord
from danube_ingest.schema import SchemaNotFoundError, SchemaRegistry
from danube_ingest.schema.kvstore import KVSchemaStore


def register(commands: Any) -> None:
    topics = commands.add_parser(
        "topics",
        help="list topics with owner, dispatch strategy and what is in objects",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(topics)
    topics.add_argument("--namespace", help="only this namespace")
    topics.set_defaults(handler=_sync(_topics))
    actions = topics.add_subparsers(dest="action", metavar="{create,describe,delete,unload}")
    create = actions.add_parser(
        "create",
        help="create a topic (or N partitions of it) before any producer does",
        description="Create a topic's record in etcd; a broker takes it on first use. A "
        "producer creates a missing topic by itself: this is for choosing its dispatch "
        "strategy and partitions up front. Exit 1 if it exists already.",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(create)
    create.add_argument("topic", type=topic_name, help="topic name, /namespace/topic")
    create.add_argument(
        "--partitions",
        type=non_negative,
        default=0,
        help="create partitions TOPIC-part-0 .. -part-(N-1) (0: one plain topic)",
    )
    create.add_argument(
        "--non-reliable",
        action="store_true",
        help="non-reliable dispatch (no WAL, live fan-out only)",
    )
    create.set_defaults(handler=_sync(_create))
    describe = actions.add_parser(
        "describe",
        help="one topic: partitions, dispatch, owner, retention, schema, offsets, subscriptions",
        description="One topic (every partition of a partitioned one), from etcd: partitions, "
        "dispatch, creation time, retention policy (its own over its namespace's), schema "
        "subject and validation policy, owner and offsets in objects, subscriptions with "
        "cursor and lag. Exit 1 if it does not exist.",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(describe)
    describe.add_argument("topic", type=topic_name, help="topic name, /namespace/topic")
    describe.set_defaults(handler=_sync(_describe))
    delete = actions.add_parser(
        "delete",
        help="delete a topic: fence its owner, remove its metadata, retire its objects",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(delete)
    delete.add_argument("topic", help="topic name, /namespace/topic")
    delete.set_defaults(handler=_sync(_delete))
    unload = actions.add_parser(
        "unload",
        help="move a topic off its broker: it uploads the topic's WAL tail, releases it, and "
        "another broker takes it",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(unload)
    unload.add_argument("topic", help="topic name, /namespace/topic")
    unload.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for the owner to let go"
    )
    unload.set_defaults(handler=_sync(_unload))

    subs = commands.add_parser(
        "subscriptions",
        help="list a topic's subscriptions with cursor and lag; reset or delete one",
        description="With --topic: a topic's subscriptions (of each partition of a "
        "partitioned topic): type, cursor (every offset below it is acknowledged) and lag "
        "(messages between the topic's end and the cursor, as its owner reports it on "
        "/metrics; '-' when the topic has no live owner or its lag is not among the owner's "
        "metrics.max_lag_series largest). 'reset' and 'delete' change one through the topic's "
        "owner.",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(subs)
    subs.add_argument(
        "--topic", type=topic_name, help="topic name, /namespace/topic (required to list)"
    )
    subs.set_defaults(handler=_sync(_subscriptions))
    subscriptions.register_actions(subs)

    status = commands.add_parser(
        "status",
        help="brokers (WAL bytes, upload backlog), topics, clients and subscription lag",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(status)
    status.set_defaults(handler=_sync(_status))


def _etcd_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", default="http://127.0.0.1:2379", help="etcd endpoint URL(s)")
    parser.add_argument("--prefix", default="/danube", help="metadata key prefix")
    add_etcd_security(parser)


def _sync(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return int(asyncio.run(handler(args)))

    return run


async def _connect(args: argparse.Namespace) -> tuple[EtcdKV, Keys, Records]:
    kv = await EtcdKV.connect(args.etcd.split(","), timeout=5.0, security=etcd_security(args))
    keys = Keys(args.prefix)
    return kv, keys, Records(kv, keys)


async def _owner(kv: EtcdKV, keys: Keys, topic: str) -> Owner | None:
    key = keys.topic_owner(topic)
    found = await kv.get(key)
    return None if found is None else Owner.decode(found.value, key)


async def _topics(args: argparse.Namespace) -> int:
    kv, keys, records = await _connect(args)
    try:
        rows = []
        manifest = Manifest(kv, keys)
        for record in await records.list_topics(args.namespace):
            owner = await _owner(kv, keys, record.name)
            ranges = await manifest.ranges(record.name) if record.reliable else []
            rows.append(
                (
                    record.name,
                    "reliable" if record.reliable else "non-reliable",
                    f"{owner.broker_id} (epoch {owner.epoch})" if owner else "-",
                    str(len(ranges)),
                    f"{ranges[0].start_offset}..{ranges[-1].end_offset}" if ranges else "-",
                )
            )
        _table(("topic", "dispatch", "owner", "object ranges", "offsets in objects"), rows)
    finally:
        await kv.close()
    return 0


async def _delete(args: argparse.Namespace) -> int:
    kv, keys, _records = await _connect(args)
    try:
        report = await delete_topic(kv, keys, args.topic)
    except DanubeIngestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await kv.close()
    what = "deleted" if report.existed else "did not exist; leftovers removed"
    print(
        f"topic {report.topic} {what}: {report.subscriptions} subscriptions, "
        f"{report.clients} clients, {report.manifest_entries} manifest entries "
        f"({report.retired_objects} objects retired), {report.prune_marks} prune marks"
    )
    return 0


#: Lease of an unload request: how long the broker it names keeps redirecting the topic's
#: clients to other brokers instead of taking the topic back.
UNLOAD_LEASE_SECONDS = 30


async def _unload(args: argparse.Namespace) -> int:
    kv, keys, records = await _connect(args)
    try:
        return await _request_unload(args, kv, keys, records)
    except DanubeIngestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await kv.close()


async def _request_unload(
    args: argparse.Namespace, kv: EtcdKV, keys: Keys, records: Records
) -> int:
    """Ask the topic's owner to unload it; wait until it let go (see ``TopicManager.unload``)."""
    if await records.get_topic(args.topic) is None:
        print(f"error: topic {args.topic} does not exist", file=sys.stderr)
        return 1
    owner = await _owner(kv, keys, args.topic)
    if owner is None:
        print(f"topic {args.topic} is not owned by any broker: nothing to unload")
        return 0
    lease = await kv.grant_lease(UNLOAD_LEASE_SECONDS)
    request = {"broker": owner.broker_id, "requested_ms": int(time.time() * 1000)}
    await kv.put(keys.topic_unload(args.topic), json.dumps(request).encode(), lease=lease)
    deadline = time.monotonic() + args.timeout
    while True:
        now = await _owner(kv, keys, args.topic)
        if now is None or now.broker_id != owner.broker_id or now.epoch != owner.epoch:
            where = "not owned yet" if now is None else f"now owned by {now.broker_id}"
            print(f"topic {args.topic} unloaded from {owner.broker_id} ({where})")
            return 0
        if time.monotonic() > deadline:
            print(
                f"error: {owner.broker_id} still owns {args.topic} after {args.timeout:.0f} s "
                "(its WAL tail may not upload: see its log); try again",
                file=sys.stderr,
            )
            return 1
        await asyncio.sleep(0.1)


async def _subscriptions(args: argparse.Namespace) -> int:
    if args.topic is None:
        print("danube-ingest: error: subscriptions: give --topic TOPIC to list", file=sys.stderr)
        return 2
    kv, keys, records = await _connect(args)
    try:
        rows = await _subscription_rows(kv, keys, records, await _partitions(records, args.topic))
    finally:
        await kv.close()
    _table(("topic", "subscription", "type", "cursor", "lag"), rows)
    return 0


async def _partitions(records: Records, topic: str) -> list[str]:
    """``topic`` itself if it exists, else its partitions (``topic-part-N``), in index order;
    ``[topic]`` when neither exists."""
    if await records.get_topic(topic) is not None:
        return [topic]
    ns, _ = parse_topic(topic)
    found = []
    for record in await records.list_topics(ns):
        base = partition_base(record.name)
        if base is not None and base[0] == topic:
            found.append((base[1], record.name))
    return [name for _, name in sorted(found)] or [topic]


async def _subscription_rows(
    kv: EtcdKV, keys: Keys, records: Records, topics: Sequence[str]
) -> list[tuple[str, ...]]:
    """(topic, subscription, type, cursor, lag) of every subscription of ``topics``."""
    rows: list[tuple[str, ...]] = []
    for topic in topics:
        lags = await _owner_lags(kv, keys, topic)
        for sub in await records.list_subscriptions(topic):
            cursor = await records.get_cursor(topic, sub.name)
            lag = lags.get(sub.name)
            rows.append(
                (
                    topic,
                    sub.name,
                    sub.sub_type,
                    "-" if cursor is None else str(cursor),
                    "-" if lag is None else f"{lag:.0f}",
                )
            )
    return rows


async def _owner_lags(kv: EtcdKV, keys: Keys, topic: str) -> dict[str, float]:
    """The lag of ``topic``'s subscriptions as its live owner reports it on ``/metrics``;
    empty when it has no owner, the owner has no metrics endpoint or it cannot be read."""
    owner = await _owner(kv, keys, topic)
    if owner is None:
        return {}
    found = await kv.get(keys.broker(owner.broker_id))
    metrics_url = None if found is None else json.loads(found.value).get("metrics_url")
    if not metrics_url:
        return {}
    try:
        figures = await asyncio.to_thread(scrape, f"{metrics_url}/metrics")
    except OSError:
        return {}
    lags = {}
    for (name, labels), value in figures.items():
        label = dict(labels)
        if name == "danube_ingest_subscription_lag_messages" and label.get("topic") == topic:
            lags[label["subscription"]] = value
    return lags


async def _create(args: argparse.Namespace) -> int:
    kv, _keys, records = await _connect(args)
    names = [partition_name(args.topic, i) for i in range(args.partitions)] or [args.topic]
    reliable = not args.non_reliable
    try:
        if args.partitions and await records.get_topic(args.topic) is not None:
            print(f"error: topic {args.topic} exists as a plain topic", file=sys.stderr)
            return 1
        created = []
        for name in names:
            record, new = await records.create_topic_if_absent(
                TopicRecord(name=name, reliable=reliable, created_ms=int(time.time() * 1000))
            )
            if new:
                created.append(name)
            elif record.reliable != reliable:
                print(
                    f"error: topic {name} exists and is "
                    f"{'reliable' if record.reliable else 'non-reliable'}",
                    file=sys.stderr,
                )
                return 1
    finally:
        await kv.close()
    dispatch = "reliable" if reliable else "non-reliable"
    if not created:
        print(f"error: topic {args.topic} exists already ({dispatch})", file=sys.stderr)
        return 1
    what = f"{len(created)} partitions" if args.partitions else "1 topic"
    print(f"topic {args.topic} created ({dispatch}, {what})")
    return 0


async def _describe(args: argparse.Namespace) -> int:
    kv, keys, records = await _connect(args)
    try:
        topics = await _partitions(records, args.topic)
        found = [r for r in [await records.get_topic(t) for t in topics] if r is not None]
        if not found:
            print(f"error: topic {args.topic} does not exist", file=sys.stderr)
            return 1
        print(f"topic: {args.topic}")
        if topics != [args.topic]:
            print(f"partitions: {len(topics)} ({', '.join(topics)})")
        else:
            print("partitions: - (not partitioned)")
        print(f"dispatch: {'reliable' if found[0].reliable else 'non-reliable'}")
        created = datetime.fromtimestamp(found[0].created_ms / 1000, UTC)
        print(f"created: {created.isoformat(timespec='seconds')}")
        print(f"retention: {await _retention(kv, keys, args.topic)}")
        schemas = {topic: await _schema(kv, keys, topic) for topic in topics}
        if len(set(schemas.values())) == 1:
            print(f"schema: {schemas[topics[0]]}")
        else:
            print("schema (partitions differ):")
            for topic, schema in schemas.items():
                print(f"  {topic}: {schema}")
        manifest = Manifest(kv, keys)
        rows = []
        for topic in topics:
            owner = await _owner(kv, keys, topic)
            ranges = await manifest.ranges(topic) if found[0].reliable else []
            rows.append(
                (
                    topic,
                    f"{owner.broker_id} (epoch {owner.epoch})" if owner else "-",
                    f"{ranges[0].start_offset}..{ranges[-1].end_offset}" if ranges else "-",
                )
            )
        print("owner and offsets:")
        _table(("topic", "owner", "offsets in objects"), rows, indent="  ")
        print("subscriptions:")
        _table(
            ("topic", "subscription", "type", "cursor", "lag"),
            await _subscription_rows(kv, keys, records, topics),
            indent="  ",
        )
    finally:
        await kv.close()
    return 0


async def _retention(kv: EtcdKV, keys: Keys, topic: str) -> str:
    """The topic's retention policy (its own over its namespace's), as ``retention show``
    says it."""
    stored = await Policies(kv, keys).all()
    policy = effective(topic, stored, RetentionPolicy())
    if policy == RetentionPolicy():
        return "none set (the retention job's default applies)"
    return describe_policy(policy)


async def _schema(kv: EtcdKV, keys: Keys, topic: str) -> str:
    """The topic's schema subject and validation policy, ``none`` without one."""
    try:
        config = await SchemaRegistry(KVSchemaStore(kv, keys)).get_topic_schema_config(topic)
    except SchemaNotFoundError:
        return "none"
    if config.subject is None:
        return f"none (validation policy {config.validation_policy.value})"
    payload = ", payload validation" if config.enable_payload_validation else ""
    return (
        f"subject {config.subject} (schema id {config.schema_id}), validation policy "
        f"{config.validation_policy.value}{payload}"
    )


async def _status(args: argparse.Namespace) -> int:
    kv, keys, records = await _connect(args)
    try:
        brokers = await kv.get_prefix(keys.brokers_prefix())
        print(f"brokers ({len(brokers)} live):")
        lags: list[tuple[str, ...]] = []
        for item in brokers:
            info = json.loads(item.value)
            broker_id = item.key.rsplit("/", 1)[-1]
            line = f"  {broker_id}  {info.get('url', '?')}"
            metrics_url = info.get("metrics_url")
            if not metrics_url:
                print(f"{line}  (no metrics endpoint)")
                continue
            try:
                figures = await asyncio.to_thread(scrape, f"{metrics_url}/metrics")
            except OSError as exc:
                print(f"{line}  (metrics at {metrics_url} unreachable: {exc})")
                continue
            print(f"{line}  {_broker_figures(figures)}")
            for (name, labels), value in sorted(figures.items()):
                if name == "danube_ingest_subscription_lag_messages":
                    label = dict(labels)
                    lags.append((label["topic"], label["subscription"], f"{value:.0f}", broker_id))
        topics = await records.list_topics()
        owned: dict[str, int] = {}
        for record in topics:
            owner = await _owner(kv, keys, record.name)
            name = owner.broker_id if owner else "(unowned)"
            owned[name] = owned.get(name, 0) + 1
        print(f"topics: {len(topics)}")
        for name, count in sorted(owned.items()):
            print(f"  {name}: {count}")
        clients = await records.list_clients()
        producers = sum(1 for c in clients if c.kind == "producer")
        print(f"clients: {producers} producers, {len(clients) - producers} consumers registered")
        print("subscription lag (messages between the topic's end and the cursor):")
        _table(("topic", "subscription", "lag", "broker"), lags, indent="  ")
        await _takeovers(kv, keys, await list_handovers(kv, keys))
    finally:
        await kv.close()
    return 0


@dataclass(frozen=True, slots=True)
class LostEstimate:
    """How many acknowledged messages a lost takeover may have lost."""

    at_most: int
    """The offsets skipped (the previous broker's reservation past the manifest's end): a
    strict bound, usually well above what it really acknowledged."""
    recorded: DurableEnd | None
    """The previous broker's last recorded durable end of the topic (None: none recorded, or
    one older than the manifest's end)."""
    about: int | None
    """Acknowledged and not uploaded as of that record (None: no record)."""

    def text(self) -> str:
        """``up to N acknowledged messages lost``, narrowed by the durable end when recorded."""
        bound = f"up to {self.at_most} acknowledged messages lost"
        if self.recorded is None or self.about is None:
            return bound
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.recorded.at_ms / 1000))
        return (
            f"{bound}; about {self.about} by the broker's last recorded durable end "
            f"({self.recorded.end} at {at}; more only if it acknowledged any after that)"
        )


async def lost_estimate(kv: KV, keys: Keys, record: Handover) -> LostEstimate:
    """What ``record`` (a takeover resolved, or about to be, as lost) may have lost: at most
    its skipped range, and about as much as the previous broker's recorded durable end says it
    had acknowledged past the manifest's end (``metadata.durable``)."""
    at_most = record.reserved - record.committed
    recorded = await read_durable_end(kv, keys, record.topic, record.previous)
    if recorded is None or recorded.end < record.committed:
        # Below the manifest's end: the record is from an earlier time the broker owned the
        # topic (its uploads of the last one reached further), so it says nothing here.
        return LostEstimate(at_most, None, None)
    about = min(recorded.end, record.reserved) - record.committed
    return LostEstimate(at_most, recorded, about)


async def _takeovers(kv: KV, keys: Keys, found: Sequence[tuple[Handover, Any]]) -> None:
    """Pending takeovers (topics not served until a broker is back or forgotten) and offsets
    declared lost (``brokers forget``): at most the skipped range, and about what the lost
    broker's recorded durable ends say."""
    pending = [r for r, _ in found if r.state == PENDING]
    lost = [r for r, _ in found if r.state == LOST]
    estimates = {r.topic: await lost_estimate(kv, keys, r) for r in lost}
    at_most = sum(e.at_most for e in estimates.values())
    known = [e.about for e in estimates.values() if e.about is not None]
    about = ""
    if known:
        partly = "" if len(known) == len(estimates) else " of the topics with one"
        about = f"; about {sum(known)} by the recorded durable ends{partly}"
    summary = f"takeovers: {len(pending)} pending, {len(lost)} declared lost"
    if lost:
        summary += f" (up to {at_most} acknowledged messages lost: the offsets skipped{about})"
    print(summary)
    rows = [
        (
            r.topic,
            r.state,
            r.previous,
            f"{r.committed}..{r.reserved - 1}",
            _lost_column(estimates.get(r.topic)),
        )
        for r in pending + lost
    ]
    if rows:
        _table(("topic", "state", "broker", "offsets", "lost"), rows, indent="  ")


def _lost_column(estimate: LostEstimate | None) -> str:
    if estimate is None:
        return "-"
    if estimate.about is None:
        return f"up to {estimate.at_most}"
    return f"up to {estimate.at_most}, about {estimate.about}"


Figures = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 3.0) -> Figures:
    """The samples of a Prometheus endpoint: (name, sorted labels) -> value. Raises
    ``OSError`` when it cannot be read."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _broker_figures(figures: Figures) -> str:
    def value(name: str) -> float:
        return figures.get((name, ()), 0.0)

    text = f"wal {_size(value('danube_ingest_wal_bytes'))}"
    if ("danube_ingest_upload_backlog_segments", ()) in figures:
        text += (
            f", upload backlog {value('danube_ingest_upload_backlog_segments'):.0f} segments "
            f"({_size(value('danube_ingest_upload_backlog_bytes'))})"
        )
    return text


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], indent: str = "") -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        print(indent + "  ".join(cells).rstrip())
    if not rows:
        print(f"{indent}(none)")
