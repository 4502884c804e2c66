"""``danube-ingest topics``, ``subscriptions`` and ``status``: cluster state, read from etcd."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

from danube_ingest.broker.deletion import delete_topic
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.records import Records


def register(commands: Any) -> None:
    topics = commands.add_parser(
        "topics",
        help="list topics with owner, dispatch strategy and what is in objects",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(topics)
    topics.add_argument("--namespace", help="only this namespace")
    topics.set_defaults(handler=_sync(_topics))
    actions = topics.add_subparsers(dest="action", metavar="{delete}")
    delete = actions.add_parser(
        "delete",
        help="delete a topic: fence its owner, remove its metadata, retire its objects",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(delete)
    delete.add_argument("topic", help="topic name, /namespace/topic")
    delete.set_defaults(handler=_sync(_delete))

    subs = commands.add_parser(
        "subscriptions",
        help="list a topic's subscriptions and cursors",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(subs)
    subs.add_argument("--topic", required=True, help="topic name, /namespace/topic")
    subs.set_defaults(handler=_sync(_subscriptions))

    status = commands.add_parser(
        "status",
        help="brokers, topics and clients in the cluster",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(status)
    status.set_defaults(handler=_sync(_status))


def _etcd_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", default="http://127.0.0.1:2379", help="etcd endpoint URL(s)")
    parser.add_argument("--prefix", default="/danube", help="metadata key prefix")


def _sync(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return int(asyncio.run(handler(args)))

    return run


async def _connect(args: argparse.Namespace) -> tuple[EtcdKV, Keys, Records]:
    kv = await EtcdKV.connect(args.etcd.split(","), timeout=5.0)
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


async def _subscriptions(args: argparse.Namespace) -> int:
    kv, _keys, records = await _connect(args)
    try:
        rows = []
        for sub in await records.list_subscriptions(args.topic):
            cursor = await records.get_cursor(args.topic, sub.name)
            rows.append((sub.name, sub.sub_type, "-" if cursor is None else str(cursor)))
        _table(("subscription", "type", "cursor"), rows)
    finally:
        await kv.close()
    return 0


async def _status(args: argparse.Namespace) -> int:
    kv, keys, records = await _connect(args)
    try:
        brokers = await kv.get_prefix(keys.brokers_prefix())
        print(f"brokers ({len(brokers)} live):")
        for item in brokers:
            info = json.loads(item.value)
            print(f"  {item.key.rsplit('/', 1)[-1]}  {info.get('url', '?')}")
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
    finally:
        await kv.close()
    return 0


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))
    if not rows:
        print("(none)")
