"""``danube-ingest brokers``: live brokers and takeovers, and declaring a broker lost.

``brokers list`` shows every live broker and every takeover record (``metadata.handover``):
pending ones (a new owner waits for a broker's unuploaded tail; its clients get UNAVAILABLE)
and resolved ones. ``brokers forget ID`` declares a broker that is gone for good lost: every
takeover waiting on it resolves as lost, with a recorded offset jump over the range it may have
acknowledged but never uploaded, and the new owners continue after it. That range is the
broker's offset reservation, an upper bound ("up to N" lost); when the broker recorded its WAL's
durable end in etcd (``metadata.durable``, each second) the report also says about how many it
really had acknowledged past the manifest's end.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from danube_ingest.cli.admin import _connect, _etcd_options, _sync, _table, lost_estimate
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.metadata.handover import PENDING, forget_broker, list_handovers


def register(commands: Any) -> None:
    brokers = commands.add_parser(
        "brokers",
        help="live brokers and takeovers waiting for a broker's unuploaded WAL tail",
        formatter_class=DefaultsHelpFormatter,
    )
    actions = brokers.add_subparsers(dest="action", metavar="{list,forget}", required=True)
    listing = actions.add_parser(
        "list",
        help="live brokers, and takeovers pending (waiting for a broker) or resolved",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(listing)
    listing.set_defaults(handler=_sync(_list))
    forget = actions.add_parser(
        "forget",
        help="declare a dead broker lost for good: topics waiting for its unuploaded tail "
        "skip it (a recorded jump); what it acknowledged and never uploaded is lost",
        formatter_class=DefaultsHelpFormatter,
    )
    _etcd_options(forget)
    forget.add_argument("broker_id", metavar="ID", help="the broker id (see 'brokers list')")
    forget.set_defaults(handler=_sync(_forget))


async def _list(args: argparse.Namespace) -> int:
    kv, keys, _records = await _connect(args)
    try:
        live = []
        for item in await kv.get_prefix(keys.brokers_prefix()):
            info = json.loads(item.value)
            live.append((item.key.rsplit("/", 1)[-1], str(info.get("url", "?"))))
        print(f"brokers ({len(live)} live):")
        _table(("broker", "url"), live, indent="  ")
        rows = [
            (
                record.topic,
                record.state,
                record.previous,
                f"{record.committed}..{record.reserved}",
                "-" if record.end is None else str(record.end),
                f"{record.owner} (epoch {record.epoch})",
            )
            for record, _ in await list_handovers(kv, keys)
        ]
        print("takeovers (pending: the new owner waits for the previous broker's tail):")
        _table(("topic", "state", "previous", "awaited", "continued at", "new owner"), rows, "  ")
    finally:
        await kv.close()
    return 0


async def _forget(args: argparse.Namespace) -> int:
    kv, keys, _records = await _connect(args)
    try:
        lost = await forget_broker(kv, keys, args.broker_id)
        estimates = [await lost_estimate(kv, keys, record) for record in lost]
        waiting = [r for r, _ in await list_handovers(kv, keys) if r.state == PENDING]
    finally:
        await kv.close()
    for record, estimate in zip(lost, estimates, strict=True):
        print(
            f"{record.topic}: offsets {record.committed}..{record.reserved - 1} of broker "
            f"{args.broker_id} skipped ({estimate.text()}); the owner continues at "
            f"{record.reserved}"
        )
    print(f"broker {args.broker_id} forgotten: {len(lost)} takeover(s) resolved as lost")
    others = sorted({r.previous for r in waiting})
    if others:
        print(f"still pending, waiting on: {', '.join(others)}")
    return 0
