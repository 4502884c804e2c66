"""``produce`` / ``consume`` with ``--client danube``: through the real danube-client, one
unary RPC per message and one per ack (Danube's own protocol, as any Danube application uses
it)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from typing import Any

import fastavro
import grpc
from danube import (
    ConsumerOptions,
    DanubeClient,
    DispatchStrategy,
    ProducerOptions,
    SubType,
)
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc
from danube.proto import SchemaRegistry_pb2 as schema_pb
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc

from danube_ingest.broker.start import LATEST, METADATA_KEY, StartPosition
from danube_ingest.cli.messages import BadInputError, Message, Record, render
from danube_ingest.cli.progress import ProgressLine
from danube_ingest.cli.tls_args import danube_builder, tls_options
from danube_ingest.cli.token import token_of
from danube_ingest.client import TlsOptions, call_metadata, open_channel

SUB_TYPES = {
    "exclusive": SubType.EXCLUSIVE,
    "shared": SubType.SHARED,
    "failover": SubType.FAILOVER,
    "key_shared": SubType.KEY_SHARED,
}


async def _client(args: argparse.Namespace) -> DanubeClient:
    """A danube-client on ``--service-url`` with the TLS options, and ``--token`` if given
    (danube-client then uses TLS: the system's roots unless ``--ca-file`` says otherwise)."""
    builder = danube_builder(args)
    token = token_of(args)
    if token:
        builder = builder.with_token(token)
    return await builder.build()


async def produce(args: argparse.Namespace, records: list[Record]) -> None:
    """Send ``records`` one by one, each awaited (stored once it returns). With
    ``--schema-subject`` the producer names the subject (the broker binds a topic without one
    to it) and stamps each message with its latest version; an Avro subject's records are JSON
    text, encoded to Avro first (all of them, before the first is sent: ``BadInputError`` if
    one does not fit)."""
    client = await _client(args)
    builder = (
        client.new_producer()
        .with_topic(args.topic)
        .with_name(args.producer_name)
        .with_dispatch_strategy(
            DispatchStrategy.NON_RELIABLE if args.non_reliable else DispatchStrategy.RELIABLE
        )
        .with_options(ProducerOptions())
    )
    if args.schema_subject:
        records = await _encoded(args, records)
        builder = builder.with_schema_subject(args.schema_subject)
    if args.partitions:
        builder = builder.with_partitions(args.partitions)
    producer = builder.build()
    await producer.create()
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    next_at = time.monotonic()
    try:
        with ProgressLine("sent", len(records)) as progress:
            for record in records:
                if record.key is not None:
                    await producer.send_with_key(record.payload, record.attributes, record.key)
                else:
                    await producer.send(record.payload, record.attributes)
                progress.step()
                if interval:
                    next_at += interval
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
    finally:
        await producer.close()


async def _encoded(args: argparse.Namespace, records: list[Record]) -> list[Record]:
    """``records`` as the ``--schema-subject``'s latest version wants them on the wire: Avro
    subjects' JSON lines Avro-encoded, other types unchanged."""
    tls = tls_options(args)
    async with open_channel(args.service_url, tls) as channel:
        stub = schema_grpc.SchemaRegistryStub(channel)
        try:
            latest = await stub.GetLatestSchema(
                schema_pb.GetLatestSchemaRequest(subject=args.schema_subject),
                metadata=call_metadata(token_of(args)),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise BadInputError(
                    f"--schema-subject {args.schema_subject!r}: no such subject; register it "
                    "first (danube-ingest schemas register)"
                ) from None
            raise
    if latest.schema_type != "avro":
        return records
    schema = fastavro.parse_schema(json.loads(latest.schema_definition))
    encoded = []
    for number, record in enumerate(records, start=1):
        try:
            datum = json.loads(record.payload)
            out = io.BytesIO()
            fastavro.schemaless_writer(out, schema, datum)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BadInputError(
                f"message {number}: not a JSON record of Avro subject {args.schema_subject!r} "
                f"version {latest.version}: {exc} (nothing was sent)"
            ) from None
        encoded.append(Record(out.getvalue(), record.key, record.attributes))
    return encoded


async def consume(args: argparse.Namespace) -> None:
    """Receive, print (unless ``--quiet``) and acknowledge messages one by one."""
    client = await _client(args)
    consumer = (
        client.new_consumer()
        .with_topic(args.topic)
        .with_consumer_name(args.consumer_name)
        .with_subscription(args.subscription)
        .with_subscription_type(SUB_TYPES[args.type])
        .with_options(ConsumerOptions())
        .build()
    )
    start: StartPosition = args.start
    if start != LATEST:
        await _create_subscription(args, start)
    await consumer.subscribe()
    queue = await consumer.receive()
    try:
        with ProgressLine("received", args.count) as progress:
            while not args.count or progress.done < args.count:
                message = await queue.get()
                if not args.quiet:
                    sys.stdout.buffer.write(render(_message(message), args.output, args.template))
                    sys.stdout.flush()
                await consumer.ack(message)
                progress.step()
    finally:
        await consumer.close()


def _message(message: Any) -> Message:
    """A danube-client ``StreamMessage`` as the CLI prints it (it carries no ingest time)."""
    return Message(
        topic=message.msg_id.topic_name,
        offset=message.msg_id.topic_offset,
        payload=message.payload,
        producer=message.producer_name,
        key=message.routing_key or None,
        attributes=dict(message.attributes or {}),
        publish_ms=message.publish_time,
        schema_id=message.schema_id or None,
        schema_version=message.schema_version or None,
    )


async def _create_subscription(args: argparse.Namespace, start: StartPosition) -> None:
    """Subscribe once per partition with our start-position metadata, under the consumer name
    danube-client then subscribes with (so it gets the same consumer id and takes over).

    danube-client cannot send the position itself; this call creates the subscription at
    ``start`` if it does not exist yet, and changes nothing for one that does.
    """
    token = token_of(args)
    auth = call_metadata(token) or ()
    metadata = ((METADATA_KEY, start.to_metadata()), *auth)
    tls = tls_options(args)
    async with open_channel(args.service_url, tls) as channel:
        discovery = pb_grpc.DiscoveryStub(channel)
        request = pb.TopicLookupRequest(request_id=1, topic=args.topic)
        answer = await discovery.TopicPartitions(request, metadata=auth or None)
        partitions = list(answer.partitions) or [args.topic]
        for partition in partitions:
            url = args.service_url
            try:
                lookup = await discovery.TopicLookup(
                    pb.TopicLookupRequest(request_id=2, topic=partition), metadata=auth or None
                )
                url = lookup.connect_url or url
            except grpc.aio.AioRpcError:
                pass  # as danube-client does: fall back to the service URL
            async with open_channel(url, tls) as owner:
                await pb_grpc.ConsumerServiceStub(owner).Subscribe(
                    pb.ConsumerRequest(
                        request_id=3,
                        topic_name=partition,
                        consumer_name=args.consumer_name,
                        subscription=args.subscription,
                        subscription_type=int(SUB_TYPES[args.type]),
                    ),
                    metadata=metadata,
                )


async def partitions(
    url: str, topic: str, tls: TlsOptions | None = None, token: str | None = None
) -> list[str]:
    """The topics to read for ``topic``: itself, or its ``-part-N`` partitions (NOT_FOUND as
    ``grpc.aio.AioRpcError`` when neither exists)."""
    async with open_channel(url, tls) as channel:
        discovery = pb_grpc.DiscoveryStub(channel)
        request = pb.TopicLookupRequest(request_id=1, topic=topic)
        answer = await discovery.TopicPartitions(request, metadata=call_metadata(token))
        return list(answer.partitions) or [topic]
