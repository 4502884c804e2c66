"""Authentication on the broker's port (``auth.enabled``): every RPC without valid credentials
is refused with UNAUTHENTICATED, saying what was wrong, and nothing is created or stored; valid
JWTs (HMAC, RSA, EC) and API keys are accepted, through danube-client, raw gRPC and the batch
client."""

from __future__ import annotations

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import SchemaRegistry_pb2 as schema_pb
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc

from danube_ingest.broker.server import Broker
from danube_ingest.client import Consumer, Producer, PublishError
from danube_ingest.metadata.records import Records
from tests.broker.support import (
    consumer_request,
    message,
    offsets,
    payloads,
    producer_request,
    raw_stubs,
    rpc_error,
)

from .conftest import API_KEY, Signing, TokenClients, bearer

TOPIC = "/shop/orders"


async def assert_nothing_created(broker: Broker, records: Records, topic: str = TOPIC) -> None:
    assert broker.store is not None
    assert broker.store.info(topic) is None, f"{topic} was created"
    assert await records.find_producer(topic, "raw") is None
    assert await records.list_clients() == []


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ((), "no credentials"),
        ((("authorization", "Bearer garbage"),), "unknown API key"),
        ((("authorization", "Bearer not.a.jwt"),), "malformed token"),
        ((("authorization", "Basic YWxpY2U6cHc="),), "is not 'Bearer <token>'"),
        ((("x-api-key", "guessed-key"),), "unknown API key"),
    ],
    ids=["none", "garbage", "malformed-jwt", "basic-auth", "unknown-api-key"],
)
async def test_missing_or_garbage_credentials_are_unauthenticated(
    secure: Broker, records: Records, metadata: tuple[tuple[str, str], ...], says: str
) -> None:
    async with raw_stubs(secure.url) as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=metadata)
        )
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert says in (error.details() or "")
        lookup = await rpc_error(
            raw.discovery.TopicLookup(
                pb.TopicLookupRequest(request_id=1, topic=TOPIC), metadata=metadata
            )
        )
        assert lookup.code() == grpc.StatusCode.UNAUTHENTICATED
    await assert_nothing_created(secure, records)


async def test_expired_token_is_unauthenticated(
    secure: Broker, records: Records, signing: Signing
) -> None:
    # Beyond auth.jwt.clock_skew_seconds (30 s) in the past.
    expired = signing.token("alice", expires_in=-120)
    async with raw_stubs(secure.url) as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(expired))
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "expired" in (error.details() or "")
    await assert_nothing_created(secure, records)


async def test_token_without_expiry_is_unauthenticated(
    secure: Broker, records: Records, signing: Signing
) -> None:
    forever = signing.token("alice", expires_in=None)
    async with raw_stubs(secure.url) as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(forever))
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "'exp'" in (error.details() or "")
    await assert_nothing_created(secure, records)


@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256"])
async def test_wrong_signature_is_unauthenticated_and_the_right_one_accepted(
    secure: Broker, records: Records, signing: Signing, alg: str
) -> None:
    other = {
        "HS256": "another-secret-0123456789abcdef0123",
        "RS256": signing.other_rsa,
        "ES256": signing.other_ec,
    }[alg]
    forged = signing.token("alice", alg=alg, key=other)
    async with raw_stubs(secure.url) as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(forged))
        )
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "signature does not verify" in (error.details() or "")
        await assert_nothing_created(secure, records)

        good = bearer(signing.token("alice", alg=alg))
        created = await raw.producers.CreateProducer(producer_request(TOPIC), metadata=good)
        await raw.producers.SendMessage(message(created.producer_id, TOPIC), metadata=good)
    assert secure.store is not None
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 1


async def test_every_service_needs_credentials(secure: Broker, signing: Signing) -> None:
    """SendMessage, Subscribe, Receive, Ack, HealthCheck and the schema registry too: the
    interceptor refuses before any handler runs."""
    good = bearer(signing.token("alice"))
    async with raw_stubs(secure.url) as raw:
        created = await raw.producers.CreateProducer(producer_request(TOPIC), metadata=good)
        subscribed = await raw.consumers.Subscribe(consumer_request(TOPIC), metadata=good)
        calls = [
            raw.producers.SendMessage(message(created.producer_id, TOPIC)),
            raw.consumers.Subscribe(consumer_request(TOPIC)),
            raw.consumers.Ack(
                pb.AckRequest(
                    request_id=1,
                    msg_id=pb.MsgID(topic_name=TOPIC, topic_offset=0),
                    subscription_name="s",
                )
            ),
            raw.health.HealthCheck(
                pb.HealthCheckRequest(
                    request_id=1, client=pb.HealthCheckRequest.Producer, id=created.producer_id
                )
            ),
        ]
        async with grpc.aio.insecure_channel(secure.url.removeprefix("http://")) as channel:
            schema = schema_grpc.SchemaRegistryStub(channel)
            error = await rpc_error(
                schema.GetLatestSchema(schema_pb.GetLatestSchemaRequest(subject="orders"))
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        for call in calls:
            error = await rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, call
        stream = raw.consumers.ReceiveMessages(
            pb.ReceiveRequest(request_id=1, consumer_id=subscribed.consumer_id)
        )
        error = await rpc_error(stream.read())
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert secure.store is not None
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 0


@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256"])
async def test_danube_client_with_a_token_produces_and_consumes(
    secure: Broker, signing: Signing, alg: str
) -> None:
    async with TokenClients(secure.url, signing.token("alice", alg=alg)) as clients:
        producer = await clients.producer(TOPIC)
        consumer = await clients.consumer(TOPIC, "s", "c1")
        for i in range(3):
            await producer.send(f"m{i}".encode())
        got = await consumer.take(3)
        assert payloads(got) == [b"m0", b"m1", b"m2"]
        await consumer.ack_all(got)


async def test_api_key_is_accepted_as_bearer_and_as_x_api_key(
    secure: Broker, signing: Signing
) -> None:
    async with TokenClients(secure.url, API_KEY) as clients:  # Bearer <key>
        producer = await clients.producer(TOPIC, "svc")
        consumer = await clients.consumer(TOPIC, "s", "svc")
        await producer.send(b"from-svc")
        got = await consumer.take(1)
        assert payloads(got) == [b"from-svc"] and offsets(got) == [0]
        await consumer.ack_all(got)
    async with raw_stubs(secure.url) as raw:
        created = await raw.producers.CreateProducer(
            producer_request(TOPIC, "svc"), metadata=(("x-api-key", API_KEY),)
        )
    assert created.producer_id


async def test_batch_client_sends_its_token(secure: Broker, signing: Signing) -> None:
    token = signing.token("alice")
    async with Producer(secure.url, TOPIC, token=token) as producer:
        futures = [await producer.send(f"b{i}".encode()) for i in range(10)]
        assert [await f for f in futures] == list(range(10))
    async with Consumer(secure.url, TOPIC, "batch", start="earliest", token=token) as consumer:
        batch = await anext(aiter(consumer))
        assert batch.offsets == list(range(10))
        consumer.ack(batch)

    async with Producer(secure.url, TOPIC, token="wrong") as refused:
        future = await refused.send(b"never stored")
        with pytest.raises(PublishError) as caught:
            await future
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert secure.store is not None
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 10
