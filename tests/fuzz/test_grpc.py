"""Fuzzing every gRPC handler of the daemon with arbitrary field values.

One real daemon (a child process, ``danube-ingest broker`` on a real etcd) serves the whole
module. Requests are drawn from the protobuf descriptors: every field of every request of
danube-client's services (producer, consumer, discovery, health, schema registry) and of our
``IngestService`` (Publish and Consume streams), with integers at and past their widths'
edges, odd and long unicode, arbitrary bytes, unknown enum values; about half the string, id
and bytes fields get a plausible value instead (an existing topic, producer or consumer id, a
valid schema, a valid entry block), so requests also get past the first check.

Properties: every call is answered within ``ANSWER`` seconds (a stream is read to its end after
the client half-closes); no answer (status, or a Publish answer's ``code``) is INTERNAL or
UNKNOWN; the daemon never exits; and after each method's run, a normal publish and consume
through the raw danube-client protocol still works.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from crc32c import crc32c
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc
from danube.proto import SchemaRegistry_pb2 as schema_pb
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import given
from hypothesis import strategies as st

from danube_ingest.broker.start import METADATA_KEY
from danube_ingest.proto import ingest_pb2 as ingest_pb
from danube_ingest.testing import BrokerProcess
from danube_ingest.wal.block import encode_block
from danube_ingest.wal.framing import Entry
from tests.broker.support import consumer_request, message, producer_request

from .support import budget, odd_text

pytestmark = [pytest.mark.fuzz, pytest.mark.slow, pytest.mark.timeout(300)]

#: Seconds within which every call is answered (generous: CI's cores are shared).
ANSWER = 15.0
#: Seconds a server stream (ReceiveMessages) is read before the client gives up on it: an open
#: stream that delivers nothing is an answer, not a hang.
STREAM_READ = 0.5
#: Never an answer to a request, whatever it holds.
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
TOPIC = "/default/fuzz"
#: A topic whose payloads are validated against a JSON Schema (enforced).
JSON_TOPIC = "/default/fuzz-json"
JSON_SCHEMA = b'{"type": "object", "properties": {"a": {"type": "integer"}}}'

F = FieldDescriptor
_INT_RANGES = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1),
    F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1),
    F.TYPE_FIXED64: (0, (1 << 64) - 1),
}

#: Protobuf strings cannot hold lone surrogates; everything else goes, long ones included.
proto_text = (
    odd_text
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=200, max_size=300)
    | st.sampled_from(["a" * 70_000, "\U0001f600" * 20_000])
)


def ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (0, 1, 2, 3, 4, -1, low, high, low + 1, high - 1) if low <= v <= high]
    return st.sampled_from(edges) | st.integers(low, high)


@dataclass
class Known:
    """Ids and names that exist on the daemon, so fuzzed requests sometimes name them."""

    producer_id: int
    consumer_id: int
    json_producer_id: int = 0


def _plausible(name: str, known: Known) -> st.SearchStrategy[Any] | None:
    """A plausible value for a field called ``name`` (None: no special knowledge)."""
    if name in ("topic", "topic_name"):
        return st.sampled_from(
            [TOPIC, JSON_TOPIC, "/default/fuzz2", "/default/", "default/fuzz", "/a/b/c"]
        )
    if name == "producer_id":
        return st.sampled_from([known.producer_id, known.json_producer_id, (1 << 63) | 7])
    if name in ("consumer_id", "id"):
        return st.sampled_from([known.consumer_id, known.producer_id])
    if name in ("subscription", "subscription_name", "consumer_name", "producer_name"):
        return st.sampled_from(["s", "fuzz", "s2"])
    if name in ("subject", "schema_subject"):
        return st.sampled_from(["fuzz", "fuzz-json"])
    if name == "schema_type":
        return st.sampled_from(["json_schema", "avro", "protobuf", "string", "bytes", "number"])
    if name in ("schema_definition", "new_schema_definition"):
        return st.sampled_from(
            [
                JSON_SCHEMA,
                b'{"type": "record", "name": "r", "fields": [{"name": "a", "type": "int"}]}',
                b'{"type": "record", "name": "r", "fields": [{"name": "a", "type": "nope"}]}',
                b"{",
                b"",
                b"[" * 10_000,
            ]
        )
    if name == "payload":
        return st.sampled_from([b'{"a": 1}', b'{"a": "x"}', b"[" * 100_000, b"\xff"])
    if name in ("compatibility_mode", "validation_policy"):
        return st.sampled_from(["BACKWARD", "FORWARD", "FULL", "NONE", "none", "warn", "enforce"])
    return None


@st.composite
def requests(draw: st.DrawFn, descriptor: Descriptor, known: Known, depth: int = 0) -> Any:
    """A message of type ``descriptor`` with every field arbitrary or plausible (or unset)."""
    msg = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if draw(st.integers(0, 5)) == 0:
            continue  # unset (its default)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            for _ in range(draw(st.integers(0, 3))):
                key = draw(_value(key_field, known, depth))
                getattr(msg, field.name)[key] = draw(_value(value_field, known, depth))
            continue
        if field.is_repeated:
            getattr(msg, field.name).extend(draw(st.lists(_value(field, known, depth), max_size=3)))
            continue
        value = draw(_value(field, known, depth))
        if field.message_type is not None:
            getattr(msg, field.name).CopyFrom(value)
        else:
            setattr(msg, field.name, value)
    return msg


def _value(field: FieldDescriptor, known: Known, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None:
        if depth > 3:
            return st.just(message_factory.GetMessageClass(field.message_type)())
        return requests(field.message_type, known, depth + 1)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        anything: st.SearchStrategy[Any] = proto_text
    elif field.type == F.TYPE_BYTES:
        anything = st.binary(max_size=256) | st.sampled_from([b"\0" * 70_000])
    elif field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        anything = st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    else:
        anything = ints(*_INT_RANGES[field.type])
    plausible = _plausible(field.name, known)
    return anything if plausible is None else (plausible | anything)


# -- the daemon -------------------------------------------------------------------------------


@dataclass
class Daemon:
    process: BrokerProcess
    channel: grpc.Channel
    known: Known
    checks: Iterator[int]

    def alive(self) -> None:
        assert self.process.process is not None
        assert self.process.process.poll() is None, self.process.log_text()[-3000:]

    def unary(self, method: MethodDescriptor, request: Any, **kwargs: Any) -> Any:
        call = self.channel.unary_unary(
            f"/{method.containing_service.full_name}/{method.name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=message_factory.GetMessageClass(method.output_type).FromString,
        )
        return call(request, timeout=ANSWER, **kwargs)

    def serves(self) -> None:
        """A normal publish and consume (the raw danube-client protocol) works."""
        n = next(self.checks)
        producers = pb_grpc.ProducerServiceStub(self.channel)
        consumers = pb_grpc.ConsumerServiceStub(self.channel)
        topic = f"/default/after{n}"
        producer = producers.CreateProducer(producer_request(topic, "check"), timeout=ANSWER)
        consumer = consumers.Subscribe(consumer_request(topic, "check"), timeout=ANSWER)
        stream = consumers.ReceiveMessages(
            pb.ReceiveRequest(request_id=1, consumer_id=consumer.consumer_id), timeout=ANSWER
        )
        payload = f"after {n}".encode()
        producers.SendMessage(message(producer.producer_id, topic, payload), timeout=ANSWER)
        try:
            assert next(stream).payload == payload
        finally:
            stream.cancel()
        self.alive()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, etcd_server: str) -> Iterator[Daemon]:
    broker = BrokerProcess(
        tmp_path_factory.mktemp("fuzz-daemon"), etcd_server, prefix=f"/f{uuid.uuid4().hex[:10]}"
    )
    broker.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{broker.port}") as channel:
            producers = pb_grpc.ProducerServiceStub(channel)
            consumers = pb_grpc.ConsumerServiceStub(channel)
            producer = producers.CreateProducer(producer_request(TOPIC, "fuzz"), timeout=ANSWER)
            consumer = consumers.Subscribe(consumer_request(TOPIC, "s", "fuzz"), timeout=ANSWER)
            known = Known(producer.producer_id, consumer.consumer_id)
            registry = schema_grpc.SchemaRegistryStub(channel)
            registry.RegisterSchema(
                schema_pb.RegisterSchemaRequest(
                    subject="fuzz-json", schema_type="json_schema", schema_definition=JSON_SCHEMA
                ),
                timeout=ANSWER,
            )
            known.json_producer_id = producers.CreateProducer(
                producer_request(JSON_TOPIC, "fuzz"), timeout=ANSWER
            ).producer_id
            registry.ConfigureTopicSchema(
                schema_pb.ConfigureTopicSchemaRequest(
                    topic_name=JSON_TOPIC,
                    schema_subject="fuzz-json",
                    validation_policy="enforce",
                    enable_payload_validation=True,
                ),
                timeout=ANSWER,
            )
            yield Daemon(broker, channel, known, itertools.count())
        log = broker.log_text()
        assert "internal error" not in log and "Traceback" not in log, log[-5000:]
    finally:
        broker.stop()


def _status(call: Any) -> grpc.StatusCode:
    """The status ``call()`` ends with (OK if it returns)."""
    try:
        call()
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        assert len(exc.details() or "") < 1000, "error text too long for a gRPC header"
        return code
    return grpc.StatusCode.OK


# -- danube-client's services and the schema registry (unary) ----------------------------------

UNARY = [
    method
    for file in (pb.DESCRIPTOR, schema_pb.DESCRIPTOR)
    for service in file.services_by_name.values()
    for method in service.methods
    if not method.client_streaming and not method.server_streaming
]


@pytest.mark.parametrize("method", UNARY, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_unary_handlers_answer_without_internal_errors(
    daemon: Daemon, method: MethodDescriptor
) -> None:
    start = st.none() | st.sampled_from(["earliest", "latest", "offset:3", "time:1"]) | odd_text

    @budget(100, deadline_ms=None)
    @given(request=requests(method.input_type, daemon.known), start=start)
    def run(request: Any, start: str | None) -> None:
        metadata = None
        if start is not None and start.isascii() and start.isprintable():
            metadata = ((METADATA_KEY, start),)
        code = _status(lambda: daemon.unary(method, request, metadata=metadata))
        assert code not in FORBIDDEN and code != grpc.StatusCode.DEADLINE_EXCEEDED, code
        daemon.alive()

    run()
    daemon.serves()


def test_receive_messages_answers_without_internal_errors(daemon: Daemon) -> None:
    """The server stream: an unknown consumer is refused; a known one's stream stays open."""
    consumers = pb_grpc.ConsumerServiceStub(daemon.channel)
    descriptor = pb.DESCRIPTOR.message_types_by_name["ReceiveRequest"]

    @budget(30, deadline_ms=None)
    @given(request=requests(descriptor, daemon.known))
    def run(request: Any) -> None:
        def read() -> None:
            for _ in consumers.ReceiveMessages(request, timeout=STREAM_READ):
                pass

        code = _status(read)
        assert code not in FORBIDDEN, code
        daemon.alive()

    run()
    daemon.serves()


# -- our IngestService (bidirectional streams) -------------------------------------------------


@st.composite
def publish_requests(draw: st.DrawFn, known: Known) -> Any:
    """A PublishRequest: arbitrary, or a valid batch with fields then changed (its CRC
    recomputed or not)."""
    descriptor = ingest_pb.DESCRIPTOR.message_types_by_name["PublishRequest"]
    fuzzed = draw(requests(descriptor, known))
    if draw(st.booleans()):
        return fuzzed
    entries = [
        Entry(draw(st.binary(max_size=32)), producer_name="fuzz", publish_ms=1)
        for _ in range(draw(st.integers(1, 3)))
    ]
    block, sizes = encode_block(entries)
    request = ingest_pb.PublishRequest(
        topic=TOPIC,
        count=len(entries),
        entries=block,
        sizes=sizes,
        crc32c=crc32c(block),
        request_id=draw(ints(0, (1 << 64) - 1)),
    )
    for field in draw(st.lists(st.sampled_from(list(descriptor.fields)), max_size=2)):
        setattr(request, field.name, getattr(fuzzed, field.name))  # (all scalar fields)
    if draw(st.booleans()):
        request.crc32c = crc32c(request.entries)
    return request


@st.composite
def consume_streams(draw: st.DrawFn, known: Known) -> list[Any]:
    """A Consume stream's requests: usually a (fuzzed) Subscribe first, then fuzzed acks."""
    descriptor = ingest_pb.DESCRIPTOR.message_types_by_name["ConsumeRequest"]
    first = draw(requests(descriptor, known))
    if draw(st.integers(0, 3)):
        subscribe = draw(requests(ingest_pb.DESCRIPTOR.message_types_by_name["Subscribe"], known))
        first = ingest_pb.ConsumeRequest(subscribe=subscribe)
    return [first, *draw(st.lists(requests(descriptor, known), max_size=3))]


def _stream(daemon: Daemon, method: str, sent: list[Any], reply: Any) -> tuple[Any, list[Any]]:
    call = daemon.channel.stream_stream(
        f"/danube_ingest.v1.IngestService/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply.FromString,
    )
    answers: list[Any] = []

    def run() -> None:
        answers.extend(call(iter(sent), timeout=ANSWER))

    return _status(run), answers


def test_publish_answers_without_internal_errors(daemon: Daemon) -> None:
    @budget(150, deadline_ms=None)
    @given(sent=st.lists(publish_requests(daemon.known), min_size=1, max_size=3))
    def run(sent: list[Any]) -> None:
        code, answers = _stream(daemon, "Publish", sent, ingest_pb.PublishResponse)
        assert code not in FORBIDDEN and code != grpc.StatusCode.DEADLINE_EXCEEDED, code
        assert len(answers) == len(sent)
        for answer in answers:
            assert grpc.StatusCode.INTERNAL.value[0] != answer.code, answer
            assert grpc.StatusCode.UNKNOWN.value[0] != answer.code, answer
        daemon.alive()

    run()
    daemon.serves()


def test_consume_answers_without_internal_errors(daemon: Daemon) -> None:
    @budget(100, deadline_ms=None)
    @given(sent=consume_streams(daemon.known))
    def run(sent: list[Any]) -> None:
        code, _answers = _stream(daemon, "Consume", sent, ingest_pb.ConsumeResponse)
        assert code not in FORBIDDEN and code != grpc.StatusCode.DEADLINE_EXCEEDED, code
        daemon.alive()

    run()
    daemon.serves()
