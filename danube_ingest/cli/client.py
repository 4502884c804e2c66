"""``danube-ingest produce`` and ``consume``.

By default through the batch path (``danube_ingest.client``: batches of many messages on one
stream, acknowledged once durable); ``--client danube`` goes through the real danube-client
instead (one RPC per message, see ``cli.danube_client``). Messages sent either way are read by
either. Progress goes to stderr (``cli.progress``); ``consume`` prints messages to stdout.

Exit codes: 0 done; 1 the broker could not be reached, refused messages, or ended a stream
(the message says which and why); 2 bad usage (a malformed topic name, size or count is
refused before anything is sent); 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import zlib
from collections.abc import Coroutine
from typing import Any, Literal

import grpc
from danube import DanubeError

from danube_ingest.broker.names import parse_topic, partition_name
from danube_ingest.broker.start import InvalidStartPositionError, StartPosition
from danube_ingest.cli import danube_client, messages
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.progress import ProgressLine
from danube_ingest.cli.tls_args import add_tls_options, tls_options
from danube_ingest.cli.token import add_token_options, token_of
from danube_ingest.client import (
    Batch,
    ClientError,
    Consumer,
    Producer,
    PublishError,
    TlsOptions,
    open_channel,
    target,
)
from danube_ingest.errors import DanubeIngestError
from danube_ingest.wal.framing import Entry

#: Where ``consume`` starts a subscription it creates. Danube (and danube-client) start a new
#: subscription at the newest offset; the CLI starts at the oldest retained one, so that
#: ``produce --count N`` then ``consume --count N`` gets the N messages just sent.
DEFAULT_START = "earliest"
#: Seconds to wait for the broker to answer a connection before giving up (exit 1): long
#: enough for a broker that is starting, short enough that a wrong URL is reported quickly.
DEFAULT_CONNECT_TIMEOUT = 5.0

CLIENTS = ("ingest", "danube")
#: What ``produce`` sends without ``--message``, ``--size`` or ``--stdin``.
MESSAGE = "hello from danube-ingest"
_CLIENT_HELP = (
    "'ingest': the batch path (danube_ingest.client, many messages per request); 'danube': "
    "the real danube-client (one RPC per message, what Danube applications use)"
)

_FROM_HELP = (
    "where a NEW subscription starts: 'earliest' (the oldest retained message), 'latest' "
    "(only messages published from now on; danube-client's own default), OFFSET (a number; "
    "past the end means from the end), or TIME (ISO 8601 such as 2026-11-24T10:00:00Z, naive "
    "means UTC: the first message ingested at or after it). An existing subscription resumes "
    "after its cursor and ignores this."
)


class BrokerUnreachableError(DanubeIngestError):
    """No broker answered at the given URL within the connect timeout. Retriable: start the
    broker (or fix ``--service-url``) and run the command again."""

    retriable = True


# -- argument types ----------------------------------------------------------------------------


def topic_name(text: str) -> str:
    """A valid ``/namespace/topic`` (checked here, so a bad name sends nothing)."""
    try:
        parse_topic(text)
    except DanubeIngestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _whole(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected a whole number >= {minimum}")
    return value


def positive(text: str) -> int:
    """A whole number >= 1 (batch sizes, concurrency)."""
    return _whole(text, 1, "value")


def non_negative(text: str) -> int:
    """A whole number >= 0 (counts, sizes in bytes)."""
    return _whole(text, 0, "value")


def _start_position(text: str) -> StartPosition:
    try:
        return StartPosition.parse(text)
    except InvalidStartPositionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Given(argparse.Action):
    """Store the value and note that it was given (``DEST_given``): ``produce --stdin`` reads
    every line unless ``--count`` is given, though ``--count`` has a default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


# -- parsers -----------------------------------------------------------------------------------


def register(commands: Any) -> None:
    produce = commands.add_parser(
        "produce",
        help="publish messages to a topic",
        description="Publish messages; by default through the batch path, each batch "
        "acknowledged once it is durable. Exit 1 if the broker refused any message.",
        formatter_class=DefaultsHelpFormatter,
    )
    common(produce)
    produce.add_argument(
        "--count",
        type=non_negative,
        default=10,
        action=_Given,
        help="messages to send; with --stdin only if given: at most this many lines (0: all)",
    )
    produce.add_argument(
        "--stdin",
        action="store_true",
        help="send one message per line of stdin (read to its end and checked first; a bad "
        "line sends nothing) instead of --message/--size",
    )
    produce.add_argument(
        "--key-separator",
        metavar="SEP",
        help="with --stdin: each line is KEY<SEP>PAYLOAD (split at the first SEP), as kcat -K",
    )
    produce.add_argument(
        "-H",
        "--attribute",
        action="append",
        type=messages.attribute,
        default=[],
        metavar="NAME=VALUE",
        help="an attribute of every message (repeat for more)",
    )
    produce.add_argument(
        "--schema-subject",
        help="stamp messages with this schema subject's latest version (needs --client "
        "danube); with an Avro subject each --stdin line is a JSON record, sent Avro-encoded",
    )
    produce.add_argument("--message", default=MESSAGE, help="payload text")
    produce.add_argument(
        "--size", type=non_negative, help="send payloads of this many bytes instead"
    )
    produce.add_argument("--producer-name", default="cli-producer", help="producer name")
    produce.add_argument(
        "--partitions",
        type=non_negative,
        default=0,
        help="publish to a topic of N partitions (0: not partitioned); messages go round-robin, "
        "or by --key",
    )
    produce.add_argument("--key", help="routing key (for key-shared subscriptions)")
    produce.add_argument(
        "--non-reliable",
        action="store_true",
        help="non-reliable topic (no WAL, live only; needs --client danube)",
    )
    produce.add_argument(
        "--rate", type=float, default=0.0, help="messages per second (0: as fast as possible)"
    )
    batching(produce)
    produce.set_defaults(handler=_produce)

    consume = commands.add_parser(
        "consume",
        help="receive (and acknowledge) messages",
        description="Receive and acknowledge messages. A subscription this command creates "
        "starts at --from (default: earliest); an existing one resumes after its cursor.",
        formatter_class=DefaultsHelpFormatter,
    )
    common(consume)
    consume.add_argument("--subscription", default="cli-subscription", help="subscription")
    consume.add_argument("--consumer-name", default="cli-consumer", help="consumer name")
    consume.add_argument(
        "--type",
        choices=sorted(danube_client.SUB_TYPES),
        default="exclusive",
        help="subscription type",
    )
    consume.add_argument(
        "--from",
        dest="start",
        metavar="earliest|latest|OFFSET|TIME",
        type=_start_position,
        default=DEFAULT_START,
        help=_FROM_HELP,
    )
    consume.add_argument("--count", type=non_negative, default=0, help="stop after N (0: forever)")
    consume.add_argument("--quiet", action="store_true", help="show progress, not messages")
    consume.add_argument(
        "--output",
        choices=messages.OUTPUTS,
        default="text",
        help="'text': topic@offset [producer] payload; 'json': one JSON object per message "
        "(topic, offset, key, payload, attributes, publish_time, ingest_time, producer, "
        "schema_id, schema_version); 'raw': the payload bytes and a newline",
    )
    consume.add_argument(
        "--print",
        dest="template",
        type=messages.check_template,
        metavar="TEMPLATE",
        help="print each message with this template instead, e.g. '{offset} {key} {payload}' "
        "(fields: " + ", ".join(messages.FIELDS) + "; \\t and \\n are a tab and a newline)",
    )
    consume.add_argument(
        "--max-batch", type=positive, default=1000, help="most messages per delivered batch"
    )
    consume.set_defaults(handler=_consume)


def common(parser: argparse.ArgumentParser, *, topic_required: bool = True) -> None:
    """Options every client command has: broker URL, topic, client, connect timeout."""
    if topic_required:
        parser.add_argument(
            "--topic", required=True, type=topic_name, help="topic name, /namespace/topic"
        )
    parser.add_argument("--client", choices=CLIENTS, default="ingest", help=_CLIENT_HELP)
    broker_options(parser)


def broker_options(parser: argparse.ArgumentParser) -> None:
    """How a command reaches a broker: its URL, the connect timeout, TLS and the token."""
    parser.add_argument(
        "--service-url", default="http://127.0.0.1:6650", help="broker URL to start from"
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT,
        help="seconds to wait for the broker to answer before giving up (exit 1)",
    )
    add_tls_options(parser)
    add_token_options(parser)


def batching(parser: argparse.ArgumentParser) -> None:
    """The batch client's options (ignored with ``--client danube``)."""
    parser.add_argument(
        "--batch", type=positive, default=1000, help="most messages per batch (batch client)"
    )
    parser.add_argument(
        "--in-flight",
        type=positive,
        default=8,
        help="batches sent and not yet acknowledged, per producer (batch client)",
    )
    parser.add_argument(
        "--linger-ms",
        type=float,
        default=5.0,
        help="send a batch this long after its first message even if not full (batch client)",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "zstd", "lz4"),
        default="none",
        help="batch compression (batch client)",
    )


# -- running -----------------------------------------------------------------------------------


async def check_reachable(url: str, timeout: float, tls: TlsOptions | None = None) -> None:
    """Return once the broker at ``url`` accepts a connection (with ``tls``, a TLS one);
    ``BrokerUnreachableError`` after ``timeout`` seconds (both clients would otherwise retry
    for ever), saying whether the port answered at all (then TLS is the likely mismatch)."""
    async with open_channel(url, tls) as channel:
        try:
            async with asyncio.timeout(timeout):
                await channel.channel_ready()
        except TimeoutError:
            if await _port_open(target(url)):
                secure = tls is not None or url.startswith("https://")
                hint = (
                    "does it serve TLS with a certificate this CA signed (--ca-file), and "
                    "does it require a client certificate (--cert-file, --key-file)?"
                    if secure
                    else "does it serve TLS? then use --ca-file or an https:// --service-url"
                )
                raise BrokerUnreachableError(
                    f"the broker at {url} accepts connections but no gRPC session was "
                    f"established within {timeout:g} s: {hint}"
                ) from None
            raise BrokerUnreachableError(
                f"no broker answered at {url} within {timeout:g} s: start one (e.g. `make dev`) "
                "or pass its address with --service-url"
            ) from None


async def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, ValueError, TimeoutError):
        return False
    writer.close()
    return True


def run(coro: Coroutine[Any, Any, None]) -> int:
    """Run a client command; map its failures to a message on stderr and an exit code."""
    # danube-client logs a warning on every failed stream reopen, and it reopens at once:
    # while a broker is down that is thousands of lines a second.
    logging.getLogger("danube").setLevel(logging.ERROR)
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        return 130
    except messages.BadInputError as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"danube-ingest: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (DanubeError, ClientError, BrokerUnreachableError) as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 1
    return 0


class Tally:
    """Counts a producer's answers: stored messages (stepping ``progress``) and refusals (the
    first error kept, to report)."""

    def __init__(self, progress: ProgressLine) -> None:
        self.progress = progress
        self.stored = 0
        self.refused = 0
        self.first_error: BaseException | None = None

    def answered(self, future: asyncio.Future[int]) -> None:
        error = future.exception() if not future.cancelled() else asyncio.CancelledError()
        if error is None:
            self.stored += 1
            self.progress.step()
            return
        self.refused += 1
        if self.first_error is None:
            self.first_error = error

    def raise_refusals(self, topic: str) -> None:
        """Raise the first refusal, saying how many messages were refused in all."""
        if self.first_error is None:
            return
        if isinstance(self.first_error, PublishError):
            error = self.first_error
            raise PublishError(
                error.code,
                f"{error.details} ({self.refused} messages refused, {self.stored} stored)",
                error.topic,
            )
        raise self.first_error


async def _produce_ingest(args: argparse.Namespace, records: list[messages.Record]) -> None:
    tls = tls_options(args)
    await check_reachable(args.service_url, args.connect_timeout, tls)
    topics = [partition_name(args.topic, i) for i in range(args.partitions)] or [args.topic]
    largest = max((len(record.payload) for record in records), default=0)
    producers = [
        Producer(
            args.service_url,
            topic,
            producer_name=args.producer_name,
            max_batch_messages=args.batch,
            max_batch_bytes=max(1 << 20, args.batch * largest),
            max_in_flight=args.in_flight,
            linger_ms=args.linger_ms,
            compression=args.compression,
            tls=tls,
            token=token_of(args),
        )
        for topic in topics
    ]
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic()
    for producer in producers:
        await producer.start()
    try:
        with ProgressLine("sent", len(records)) as progress:
            tally = Tally(progress)
            for i, record in enumerate(records):
                if record.key is None:
                    producer = producers[i % len(topics)]
                else:
                    producer = producers[zlib.crc32(record.key.encode()) % len(topics)]
                future = await producer.send(
                    record.payload, routing_key=record.key, attributes=record.attributes or None
                )
                future.add_done_callback(tally.answered)
                if interval:
                    next_at += interval
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
            for producer in producers:
                await producer.flush()
    finally:
        for producer in producers:
            await producer.close()
    tally.raise_refusals(args.topic)


def produce_records(args: argparse.Namespace) -> list[messages.Record]:
    """The messages ``produce`` sends: stdin's lines (``--stdin``), else ``--count`` copies of
    ``--message`` (or ``--size`` bytes) with a ``seq`` attribute; each with ``--key`` and the
    ``--attribute`` pairs. ``BadInputError`` (nothing sent) for a malformed line."""
    attributes = dict(args.attribute)
    if args.stdin:
        return messages.read_records(
            sys.stdin.buffer.read(),
            key_separator=args.key_separator,
            key=args.key,
            attributes=attributes,
            limit=args.count if getattr(args, "count_given", False) else 0,
        )
    payload = b"x" * args.size if args.size else str(args.message).encode()
    return [
        messages.Record(payload, args.key, {"seq": str(i), **attributes}) for i in range(args.count)
    ]


def consumer_start(
    start: StartPosition,
) -> Literal["latest", "earliest"] | int | tuple[Literal["time"], int]:
    """``StartPosition`` (the CLI's ``--from``) as ``Consumer``'s ``start`` argument."""
    if start.kind == "offset":
        return start.value
    if start.kind == "time":
        return ("time", start.value)
    return "earliest" if start.kind == "earliest" else "latest"


async def _consume_ingest(args: argparse.Namespace) -> None:
    tls = tls_options(args)
    await check_reachable(args.service_url, args.connect_timeout, tls)
    topics = await danube_client.partitions(args.service_url, args.topic, tls, token_of(args))
    consumers = [
        Consumer(
            args.service_url,
            topic,
            args.subscription,
            consumer_name=args.consumer_name,
            sub_type=args.type,
            start=consumer_start(args.start),
            max_batch=args.max_batch,
            tls=tls,
            token=token_of(args),
        )
        for topic in topics
    ]
    batches: asyncio.Queue[tuple[Consumer, Batch] | BaseException] = asyncio.Queue()

    async def read(consumer: Consumer) -> None:
        try:
            await consumer.start()
            async for batch in consumer:
                batches.put_nowait((consumer, batch))
        except Exception as exc:
            batches.put_nowait(exc)

    readers = [asyncio.ensure_future(read(consumer)) for consumer in consumers]
    try:
        with ProgressLine("received", args.count) as progress:
            while not args.count or progress.done < args.count:
                item = await batches.get()
                if isinstance(item, BaseException):
                    raise item
                consumer, batch = item
                entries = batch.entries
                if args.count:
                    entries = entries[: args.count - progress.done]
                if not args.quiet:
                    sys.stdout.buffer.write(
                        b"".join(
                            messages.render(
                                _message(batch.topic, entry), args.output, args.template
                            )
                            for entry in entries
                        )
                    )
                    sys.stdout.flush()
                consumer.ack(Batch(batch.topic, entries))
                progress.step(len(entries))
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for consumer in consumers:
            await consumer.close()


def _message(topic: str, entry: Entry) -> messages.Message:
    return messages.Message(
        topic=topic,
        offset=entry.offset,
        payload=entry.payload,
        producer=entry.producer_name,
        key=entry.routing_key,
        attributes=entry.attributes,
        publish_ms=entry.publish_ms,
        ingest_ms=entry.ingest_ms,
        schema_id=entry.schema_id,
        schema_version=entry.schema_version or None,
    )


def _produce(args: argparse.Namespace) -> int:
    problem = _produce_usage(args)
    if problem is not None:
        print(f"danube-ingest: error: {problem}", file=sys.stderr)
        return 2
    try:
        records = produce_records(args)
    except messages.BadInputError as exc:
        print(f"danube-ingest: error: {exc}", file=sys.stderr)
        return 2
    if args.client == "danube":
        return run(_with_check(args, danube_client.produce(args, records)))
    return run(_produce_ingest(args, records))


def _produce_usage(args: argparse.Namespace) -> str | None:
    """Why the options of ``produce`` do not go together, None if they do."""
    if args.client != "danube" and args.non_reliable:
        return "--non-reliable needs --client danube (the batch path creates topics reliable)"
    if args.client != "danube" and args.schema_subject:
        return "--schema-subject needs --client danube (the batch path does not carry schema ids)"
    if args.key_separator is not None and not args.stdin:
        return "--key-separator applies to --stdin lines: add --stdin"
    if args.key_separator == "":
        return "--key-separator must not be empty"
    if args.stdin and (args.size or args.message != MESSAGE):
        return "--stdin sends stdin's lines: drop --message/--size"
    return None


def _consume(args: argparse.Namespace) -> int:
    if args.client == "danube":
        return run(_with_check(args, danube_client.consume(args)))
    return run(_consume_ingest(args))


async def _with_check(args: argparse.Namespace, command: Coroutine[Any, Any, None]) -> None:
    try:
        await check_reachable(args.service_url, args.connect_timeout, tls_options(args))
    except BaseException:
        command.close()
        raise
    await command
