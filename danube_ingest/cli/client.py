"""``danube-ingest produce`` and ``consume``: talk to a broker through the real danube-client."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

import grpc
from danube import (
    ConsumerOptions,
    DanubeClientBuilder,
    DanubeError,
    DispatchStrategy,
    ProducerOptions,
    SubType,
)
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.start import (
    LATEST,
    METADATA_KEY,
    InvalidStartPositionError,
    StartPosition,
)
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter

_SUB_TYPES = {
    "exclusive": SubType.EXCLUSIVE,
    "shared": SubType.SHARED,
    "failover": SubType.FAILOVER,
    "key_shared": SubType.KEY_SHARED,
}


#: Where ``consume`` starts a subscription it creates. Danube (and danube-client) start a new
#: subscription at the newest offset; the CLI starts at the oldest retained one, so that
#: ``produce --count N`` then ``consume --count N`` gets the N messages just sent.
DEFAULT_START = "earliest"

_FROM_HELP = (
    "where a NEW subscription starts: 'earliest' (the oldest retained message), 'latest' "
    "(only messages published from now on; danube-client's own default), OFFSET (a number; "
    "past the end means from the end), or TIME (ISO 8601 such as 2026-11-24T10:00:00Z, naive "
    "means UTC: the first message ingested at or after it). An existing subscription resumes "
    "after its cursor and ignores this."
)


def _start_position(text: str) -> StartPosition:
    try:
        return StartPosition.parse(text)
    except InvalidStartPositionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(commands: Any) -> None:
    produce = commands.add_parser(
        "produce",
        help="publish messages to a topic",
        formatter_class=DefaultsHelpFormatter,
    )
    _common(produce)
    produce.add_argument("--count", type=int, default=10, help="messages to send")
    produce.add_argument("--message", default="hello from danube-ingest", help="payload text")
    produce.add_argument("--size", type=int, help="send payloads of this many bytes instead")
    produce.add_argument("--producer-name", default="cli-producer", help="producer name")
    produce.add_argument(
        "--partitions",
        type=int,
        default=0,
        help="create a topic of N partitions (0: not partitioned)",
    )
    produce.add_argument("--key", help="routing key (for key-shared subscriptions)")
    produce.add_argument(
        "--non-reliable", action="store_true", help="non-reliable topic (no WAL, live only)"
    )
    produce.add_argument(
        "--rate", type=float, default=0.0, help="messages per second (0: as fast as possible)"
    )
    produce.set_defaults(handler=_produce)

    consume = commands.add_parser(
        "consume",
        help="receive (and acknowledge) messages",
        description="Receive and acknowledge messages through danube-client. A subscription "
        "this command creates starts at --from (default: earliest); an existing one resumes "
        "after its cursor.",
        formatter_class=DefaultsHelpFormatter,
    )
    _common(consume)
    consume.add_argument("--subscription", default="cli-subscription", help="subscription")
    consume.add_argument("--consumer-name", default="cli-consumer", help="consumer name")
    consume.add_argument(
        "--type", choices=sorted(_SUB_TYPES), default="exclusive", help="subscription type"
    )
    consume.add_argument(
        "--from",
        dest="start",
        metavar="earliest|latest|OFFSET|TIME",
        type=_start_position,
        default=DEFAULT_START,
        help=_FROM_HELP,
    )
    consume.add_argument("--count", type=int, default=0, help="stop after N (0: forever)")
    consume.add_argument("--quiet", action="store_true", help="show progress, not messages")
    consume.set_defaults(handler=_consume)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--service-url", default="http://127.0.0.1:6650", help="broker URL to start from"
    )
    parser.add_argument("--topic", required=True, help="topic name, /namespace/topic")


class _Progress:
    """One self-overwriting status line on a terminal, plain lines otherwise."""

    def __init__(self, verb: str, total: int) -> None:
        self.verb = verb
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self._last = 0.0
        self._tty = sys.stderr.isatty()

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= (0.2 if self._tty else 2.0) or self.done == self.total:
            self._last = now
            rate = self.done / max(now - self.started, 1e-9)
            total = f"/{self.total}" if self.total else ""
            line = f"{self.verb} {self.done}{total} messages ({rate:,.0f} msg/s)"
            print(
                ("\r" + line) if self._tty else line,
                end="" if self._tty else "\n",
                file=sys.stderr,
                flush=True,
            )

    def finish(self) -> None:
        if self._tty:
            print(file=sys.stderr)


async def _run_produce(args: argparse.Namespace) -> None:
    client = await DanubeClientBuilder().service_url(args.service_url).build()
    builder = (
        client.new_producer()
        .with_topic(args.topic)
        .with_name(args.producer_name)
        .with_dispatch_strategy(
            DispatchStrategy.NON_RELIABLE if args.non_reliable else DispatchStrategy.RELIABLE
        )
        .with_options(ProducerOptions())
    )
    if args.partitions:
        builder = builder.with_partitions(args.partitions)
    producer = builder.build()
    await producer.create()
    payload = b"x" * args.size if args.size else args.message.encode()
    progress = _Progress("sent", args.count)
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic()
    try:
        for i in range(args.count):
            attributes = {"seq": str(i)}
            if args.key is not None:
                await producer.send_with_key(payload, attributes, args.key)
            else:
                await producer.send(payload, attributes)
            progress.step()
            if interval:
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
    finally:
        progress.finish()
        await producer.close()


async def _run_consume(args: argparse.Namespace) -> None:
    client = await DanubeClientBuilder().service_url(args.service_url).build()
    consumer = (
        client.new_consumer()
        .with_topic(args.topic)
        .with_consumer_name(args.consumer_name)
        .with_subscription(args.subscription)
        .with_subscription_type(_SUB_TYPES[args.type])
        .with_options(ConsumerOptions())
        .build()
    )
    start: StartPosition = args.start
    if start != LATEST:
        await _create_subscription(args, start)
    await consumer.subscribe()
    queue = await consumer.receive()
    progress = _Progress("received", args.count)
    try:
        while not args.count or progress.done < args.count:
            message = await queue.get()
            if not args.quiet:
                text = message.payload.decode("utf-8", "replace")
                print(
                    f"{message.msg_id.topic_name}@{message.msg_id.topic_offset} "
                    f"[{message.producer_name}] {text}",
                    flush=True,
                )
            await consumer.ack(message)
            progress.step()
    finally:
        progress.finish()
        await consumer.close()


def _target(url: str) -> str:
    """``host:port`` of a broker URL such as ``http://127.0.0.1:6650``."""
    return url.split("://", 1)[-1].rstrip("/")


async def _create_subscription(args: argparse.Namespace, start: StartPosition) -> None:
    """Subscribe once per partition with our start-position metadata, under the consumer name
    danube-client then subscribes with (so it gets the same consumer id and takes over).

    danube-client cannot send the position itself; this call creates the subscription at
    ``start`` if it does not exist yet, and changes nothing for one that does.
    """
    metadata = ((METADATA_KEY, start.to_metadata()),)
    async with grpc.aio.insecure_channel(_target(args.service_url)) as channel:
        discovery = pb_grpc.DiscoveryStub(channel)
        request = pb.TopicLookupRequest(request_id=1, topic=args.topic)
        partitions = list((await discovery.TopicPartitions(request)).partitions) or [args.topic]
        for partition in partitions:
            url = args.service_url
            try:
                lookup = await discovery.TopicLookup(
                    pb.TopicLookupRequest(request_id=2, topic=partition)
                )
                url = lookup.connect_url or url
            except grpc.aio.AioRpcError:
                pass  # as danube-client does: fall back to the service URL
            async with grpc.aio.insecure_channel(_target(url)) as owner:
                await pb_grpc.ConsumerServiceStub(owner).Subscribe(
                    pb.ConsumerRequest(
                        request_id=3,
                        topic_name=partition,
                        consumer_name=args.consumer_name,
                        subscription=args.subscription,
                        subscription_type=int(_SUB_TYPES[args.type]),
                    ),
                    metadata=metadata,
                )


def _run(coro: Any) -> int:
    # danube-client logs a warning on every failed stream reopen, and it reopens at once:
    # while a broker is down that is thousands of lines a second.
    logging.getLogger("danube").setLevel(logging.ERROR)
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        return 130
    except grpc.aio.AioRpcError as exc:
        print(f"danube-ingest: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except DanubeError as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _produce(args: argparse.Namespace) -> int:
    return _run(_run_produce(args))


def _consume(args: argparse.Namespace) -> int:
    return _run(_run_consume(args))
