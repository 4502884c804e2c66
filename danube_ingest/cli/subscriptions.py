"""``danube-ingest subscriptions reset|delete``: through the topic's owner.

A subscription's cursor is owned by the broker serving its topic (it holds it in memory and
writes it to etcd, fenced by its epoch), so these commands ask that broker
(``danube_ingest.admin.v1.SubscriptionAdmin``, see ``broker.admin_service``) rather than
writing etcd: it refuses while consumers are connected to the subscription, and otherwise
applies the change at once. A partitioned topic's partitions are changed one by one.

Exit codes: 0 done; 1 refused (consumers connected, no such subscription, no permission) or
the broker could not be reached; 2 bad input (a malformed topic, subscription or position),
refused before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import grpc
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.admin_service import DELETE, RESET, encode
from danube_ingest.broker.start import InvalidStartPositionError, StartPosition
from danube_ingest.broker.validation import check_name
from danube_ingest.cli import danube_client
from danube_ingest.cli.client import (
    BrokerUnreachableError,
    broker_options,
    check_reachable,
    topic_name,
)
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.tls_args import tls_options
from danube_ingest.cli.token import token_of
from danube_ingest.client import ClientError, TlsOptions, call_metadata, open_channel
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.keys import check_segment

#: Times a call is retried on a fresh lookup when the broker asked says it does not own the
#: topic (it moved between the lookup and the call).
LOOKUP_ATTEMPTS = 3

_TO_HELP = (
    "where the cursor goes: 'earliest' (the oldest retained message), 'latest' (the end: "
    "skip everything not consumed yet), OFFSET (a number, kept within [earliest, end]) or "
    "TIME (ISO 8601, naive means UTC: the first message ingested at or after it)"
)


def register_actions(subs: argparse.ArgumentParser) -> None:
    """Add ``reset`` and ``delete`` under the ``subscriptions`` command."""
    actions = subs.add_subparsers(dest="action", metavar="{reset,delete}")
    reset = actions.add_parser(
        "reset",
        help="move a subscription's cursor (earliest, latest, offset, time)",
        description="Move SUBSCRIPTION's cursor on TOPIC (each partition of a partitioned "
        "one) through the topic's owner. Refused (exit 1) while consumers are connected to it: "
        "stop them first. Messages at or after the new cursor are delivered (again); those "
        "before it are skipped.",
        formatter_class=DefaultsHelpFormatter,
    )
    _target(reset)
    reset.add_argument(
        "--to", required=True, type=_position, metavar="earliest|latest|OFFSET|TIME", help=_TO_HELP
    )
    broker_options(reset)
    reset.set_defaults(handler=_handler(_reset))
    delete = actions.add_parser(
        "delete",
        help="delete a subscription and its cursor",
        description="Delete SUBSCRIPTION of TOPIC (each partition of a partitioned one) "
        "through the topic's owner. Refused (exit 1) while consumers are connected to it. A "
        "consumer that subscribes again later creates it anew, where it asks to start.",
        formatter_class=DefaultsHelpFormatter,
    )
    _target(delete)
    broker_options(delete)
    delete.set_defaults(handler=_handler(_delete))


def _position(text: str) -> StartPosition:
    try:
        return StartPosition.parse(text)
    except InvalidStartPositionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _subscription_name(text: str) -> str:
    try:
        check_name(text, "subscription name")
        check_segment(text, "subscription name")
    except DanubeIngestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", type=topic_name, help="topic name, /namespace/topic")
    parser.add_argument("subscription", type=_subscription_name, help="subscription name")


def _handler(action: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            asyncio.run(action(args))
        except grpc.aio.AioRpcError as exc:
            print(f"danube-ingest: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        except (BrokerUnreachableError, ClientError) as exc:
            print(f"danube-ingest: error: {exc}", file=sys.stderr)
            return 1
        return 0

    return run


async def _reset(args: argparse.Namespace) -> None:
    for topic in await _topics(args):
        request = {
            "topic": topic,
            "subscription": args.subscription,
            "start": args.to.to_metadata(),
        }
        answer = await _call_owner(args, topic, RESET, request)
        previous = "none" if answer["previous"] is None else answer["previous"]
        print(
            f"{topic} subscription {args.subscription}: cursor {previous} -> {answer['cursor']} "
            f"({args.to})"
        )


async def _delete(args: argparse.Namespace) -> None:
    for topic in await _topics(args):
        request = {"topic": topic, "subscription": args.subscription}
        await _call_owner(args, topic, DELETE, request)
        print(f"{topic} subscription {args.subscription}: deleted")


async def _topics(args: argparse.Namespace) -> list[str]:
    tls = tls_options(args)
    await check_reachable(args.service_url, args.connect_timeout, tls)
    return await danube_client.partitions(args.service_url, args.topic, tls, token_of(args))


async def _call_owner(
    args: argparse.Namespace, topic: str, method: str, request: dict[str, Any]
) -> dict[str, Any]:
    """``method`` with ``request`` on ``topic``'s owner (looked up again while the broker
    asked answers that it does not own the topic)."""
    tls = tls_options(args)
    metadata = call_metadata(token_of(args))
    for attempt in range(LOOKUP_ATTEMPTS):
        url = await _owner_url(args.service_url, topic, tls, metadata)
        async with open_channel(url, tls) as channel:
            call = channel.unary_unary(method)
            try:
                answer = await call(encode(request), metadata=metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == LOOKUP_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.5)
                continue
        value: dict[str, Any] = json.loads(answer)
        return value
    raise AssertionError("unreachable")


async def _owner_url(service_url: str, topic: str, tls: TlsOptions | None, metadata: Any) -> str:
    """The URL of the broker that serves ``topic`` (``service_url`` when it does, or when it
    cannot tell)."""
    async with open_channel(service_url, tls) as channel:
        lookup = await pb_grpc.DiscoveryStub(channel).TopicLookup(
            pb.TopicLookupRequest(request_id=1, topic=topic), metadata=metadata
        )
    return str(lookup.connect_url or service_url)
