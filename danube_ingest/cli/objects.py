"""``danube-ingest objects verify``: check the manifest against the object store;
``danube-ingest objects gc``: delete orphaned objects (see :mod:`danube_ingest.objects.orphans`).

Reads the manifest from etcd and every object it names (see
:mod:`danube_ingest.objects.verify`); changes nothing. Exits 1 when a range and its object
disagree (missing object, wrong size or CRC, a footer that does not match, with ``--deep`` a
frame that does not decode) or offsets are missing between ranges with no recorded offset jump
covering them.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from danube_ingest.config import load_config
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.etcd_security import EtcdSecurity
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.manifest import Manifest
from danube_ingest.metadata.records import Records
from danube_ingest.objects.orphans import DEFAULT_GRACE_S, MIN_GRACE_S, collect_orphans
from danube_ingest.objects.store import ObjectStore
from danube_ingest.objects.verify import TopicReport, verify_topic


def register(commands: Any) -> None:
    group = commands.add_parser("objects", help="inspect the object store and its manifest")
    sub = group.add_subparsers(dest="objects_command", required=True, metavar="ACTION")
    text = "check every manifest range against its object; change nothing"
    cmd = sub.add_parser("verify", help=text, description=text)
    cmd.add_argument("--config", help="broker config file (object store, etcd)")
    cmd.add_argument("--data-dir", help="broker data directory (fs objects under DATA_DIR/objects)")
    cmd.add_argument("--etcd", help="etcd endpoint URL(s), comma-separated (default: the config's)")
    cmd.add_argument("--prefix", help="metadata key prefix (default: the config's)")
    cmd.add_argument(
        "--topic", action="append", help="only this topic (repeatable; default: every topic)"
    )
    cmd.add_argument(
        "--deep", action="store_true", help="also decode every frame (reads every entry)"
    )
    cmd.set_defaults(handler=_verify)
    text = (
        "delete objects under segments/, topics/ and _staging/ that no manifest entry names "
        "and that are older than the grace period"
    )
    gc = sub.add_parser("gc", help=text, description=text)
    gc.add_argument("--config", help="broker config file (object store, etcd)")
    gc.add_argument("--data-dir", help="broker data directory (fs objects under DATA_DIR/objects)")
    gc.add_argument("--etcd", help="etcd endpoint URL(s), comma-separated (default: the config's)")
    gc.add_argument("--prefix", help="metadata key prefix (default: the config's)")
    gc.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        help=f"keep orphans younger than this many seconds (default {DEFAULT_GRACE_S})",
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    gc.set_defaults(handler=_gc)


def _gc(args: argparse.Namespace) -> int:
    if args.grace_s < MIN_GRACE_S:
        raise SystemExit(
            f"--grace-s must be at least {MIN_GRACE_S:.0f} (twice the uploader's refresh age of "
            f"a segment object awaiting its commit; got {args.grace_s})"
        )
    return asyncio.run(_gc_async(args))


async def _open(args: argparse.Namespace) -> tuple[Keys, ObjectStore, EtcdKV]:
    """The key layout, object store and etcd connection the options and config name."""
    overrides = {"broker.data_dir": args.data_dir} if args.data_dir else None
    config = load_config(args.config, overrides)
    endpoints = args.etcd.split(",") if args.etcd else config.etcd.endpoints
    objects = ObjectStore.from_config(config)
    kv = await EtcdKV.connect(
        endpoints,
        timeout=config.etcd.connect_timeout_seconds,
        security=EtcdSecurity.from_config(config.etcd),
    )
    return Keys(args.prefix or config.etcd.prefix), objects, kv


async def _gc_async(args: argparse.Namespace) -> int:
    keys, objects, kv = await _open(args)
    try:
        report = await collect_orphans(
            kv, keys, objects, grace_s=args.grace_s, dry_run=args.dry_run
        )
    finally:
        await kv.close()
        await objects.close()
    verb = "would delete" if report.dry_run else "deleted"
    print(f"objects: {objects.description}")
    for key in report.deleted:
        print(f"  {verb} {key}")
    for key in report.no_time:
        print(f"  kept {key}: the store gives no modification time")
    print(
        f"{report.candidates} objects, {report.kept} referenced; {verb} {len(report.deleted)} "
        f"({report.deleted_bytes} bytes); {report.too_young} younger than {report.grace_s:g} s "
        f"({report.too_young_bytes} bytes); {len(report.no_time)} without a time; "
        f"{report.rescued} committed meanwhile"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    return asyncio.run(_verify_async(args))


async def _verify_async(args: argparse.Namespace) -> int:
    keys, objects, kv = await _open(args)
    try:
        topics = args.topic or [
            record.name for record in await Records(kv, keys).list_topics() if record.reliable
        ]
        manifest = Manifest(kv, keys)
        print(f"objects: {objects.description}")
        bad = 0
        for topic in topics:
            report = await verify_topic(manifest, objects, topic, deep=args.deep)
            _print(report)
            bad += bool(report.problems)
    finally:
        await kv.close()
        await objects.close()
    return 1 if bad else 0


def _print(report: TopicReport) -> None:
    if not report.ranges and not report.problems:
        print(f"topic {report.topic}: nothing in objects")
        return
    print(
        f"topic {report.topic}: {report.ranges} ranges, offsets "
        f"{report.first_offset}..{report.end_offset}, {report.entries} entries, "
        f"{report.bytes} bytes: {'PROBLEMS' if report.problems else 'ok'}"
    )
    for start, end in report.gaps:
        if not any(start <= a < end for a, _ in report.unexplained):
            print(f"  no offsets {start}..{end - 1} (skipped by a new owner: a recorded jump)")
    for problem in report.problems:
        print(f"  {problem}")
