"""``danube-ingest retention set|show|clear /ns[/topic]``: retention policies in etcd.

See :mod:`danube_ingest.metadata.policies` for what the fields mean and how a topic's policy is
found (topic over namespace over the retention job's default), and
:mod:`danube_ingest.objects.retention` for what the hourly ``object_retention`` job does with
them. ``set`` changes only the fields given; ``clear`` removes the scope's whole policy.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from danube_ingest.cli.etcd_args import add_etcd_security, etcd_security
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.config.values import parse_duration, parse_size
from danube_ingest.errors import ConfigError
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys
from danube_ingest.metadata.policies import Policies, RetentionPolicy


def register(commands: Any) -> None:
    group = commands.add_parser(
        "retention", help="set, show or clear retention policies of namespaces and topics"
    )
    sub = group.add_subparsers(dest="retention_command", required=True, metavar="ACTION")
    text = "set fields of the retention policy of /namespace or /namespace/topic"
    cmd = sub.add_parser("set", help=text, description=text, formatter_class=DefaultsHelpFormatter)
    _common(cmd)
    cmd.add_argument(
        "--max-age", help="expire object ranges whose last ingest is older, e.g. 7d, 12h"
    )
    cmd.add_argument(
        "--max-bytes",
        help="expire the oldest ranges while the topic's bytes exceed this, e.g. 10GiB",
    )
    cmd.add_argument("--table-max-age", help="Parquet tables keep partitions this recent, e.g. 30d")
    cmd.set_defaults(handler=_sync(_set))
    text = "show the stored policies (of one scope, or all) and, for a topic, its effective one"
    cmd = sub.add_parser("show", help=text, description=text, formatter_class=DefaultsHelpFormatter)
    _common(cmd, required=False)
    cmd.set_defaults(handler=_sync(_show))
    text = "remove the retention policy of /namespace or /namespace/topic"
    cmd = sub.add_parser(
        "clear", help=text, description=text, formatter_class=DefaultsHelpFormatter
    )
    _common(cmd)
    cmd.set_defaults(handler=_sync(_clear))


def _common(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "scope", nargs=None if required else "?", help="/namespace or /namespace/topic"
    )
    parser.add_argument("--etcd", default="http://127.0.0.1:2379", help="etcd endpoint URL(s)")
    parser.add_argument("--prefix", default="/danube", help="metadata key prefix")
    add_etcd_security(parser)


def _sync(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        return int(asyncio.run(handler(args)))

    return run


def _millis(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    try:
        ms = round(parse_duration(value) * 1000)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from exc
    if ms <= 0:
        raise ConfigError(f"{option}: {value!r} must be above zero, e.g. 7d")
    return ms


def _bytes(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from exc
    if size <= 0:
        raise ConfigError(f"{option}: {value!r} must be above zero, e.g. 10GiB")
    return size


def describe(policy: RetentionPolicy) -> str:
    """``max_age=7d max_bytes=10GiB ...`` (``keep for ever`` when no field is set)."""
    parts = []
    if policy.max_age_ms is not None:
        parts.append(f"max_age={_duration_text(policy.max_age_ms)}")
    if policy.max_bytes is not None:
        parts.append(f"max_bytes={policy.max_bytes}")
    if policy.table_max_age_ms is not None:
        parts.append(f"table_max_age={_duration_text(policy.table_max_age_ms)}")
    return " ".join(parts) or "keep for ever"


def _duration_text(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


async def _open(args: argparse.Namespace) -> tuple[EtcdKV, Policies]:
    keys = Keys(args.prefix)
    if args.scope is not None:
        keys.policy(args.scope)  # a malformed scope fails before connecting
    kv = await EtcdKV.connect(args.etcd.split(","), timeout=5.0, security=etcd_security(args))
    return kv, Policies(kv, keys)


async def _set(args: argparse.Namespace) -> int:
    policy = RetentionPolicy(
        max_age_ms=_millis(args.max_age, "--max-age"),
        max_bytes=_bytes(args.max_bytes, "--max-bytes"),
        table_max_age_ms=_millis(args.table_max_age, "--table-max-age"),
    )
    if policy.empty:
        raise ConfigError("retention set: give --max-age, --max-bytes or --table-max-age")
    kv, policies = await _open(args)
    try:
        stored = await policies.set(args.scope, policy)
    finally:
        await kv.close()
    print(f"{args.scope}: {describe(stored)}")
    return 0


async def _show(args: argparse.Namespace) -> int:
    kv, policies = await _open(args)
    try:
        stored = await policies.all()
    finally:
        await kv.close()
    scopes = sorted(stored) if args.scope is None else [args.scope]
    for scope in scopes:
        found = stored.get(scope)
        print(f"{scope}: {'no policy' if found is None else describe(found)}")
    if args.scope is not None and args.scope.count("/") == 2:
        ns = args.scope.rsplit("/", 1)[0]
        policy = stored.get(args.scope) or RetentionPolicy()
        policy = policy.over(stored.get(ns) or RetentionPolicy())
        print(f"effective (before the job's default): {describe(policy)}")
    return 0


async def _clear(args: argparse.Namespace) -> int:
    kv, policies = await _open(args)
    try:
        had = await policies.clear(args.scope)
    finally:
        await kv.close()
    print(f"{args.scope}: {'cleared' if had else 'had no policy'}")
    return 0
