"""Authentication on the broker's TLS port (``auth.enabled``): every RPC without valid
credentials (none, garbage, expired, wrong signature) is refused with UNAUTHENTICATED, saying what
was wrong, and nothing is created, stored, acknowledged or delivered; valid JWTs (HMAC, RSA, EC)
and API keys are accepted, through danube-client (``with_tls`` + ``with_token`` or
``with_token_supplier``), raw gRPC and the batch client. Auth without TLS on loopback works too."""

from __future__ import annotations

import grpc
import pytest
from danube import DanubeClientBuilder, SubType
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import SchemaRegistry_pb2 as schema_pb
from danube.proto import SchemaRegistry_pb2_grpc as schema_grpc

from danube_ingest.broker.server import Broker
from danube_ingest.client import Consumer, Producer, PublishError
from danube_ingest.metadata.records import Records
from tests.broker.support import (
    Clients,
    consumer_request,
    eventually,
    message,
    offsets,
    payloads,
    producer_request,
    raw_stubs,
    rpc_error,
)

from .conftest import API_KEY, SecureBroker, Signing, bearer, stored_payloads, subscription

TOPIC = "/shop/orders"


async def assert_nothing_created(
    broker: SecureBroker, records: Records, topic: str = TOPIC
) -> None:
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
    secure: SecureBroker, records: Records, metadata: tuple[tuple[str, str], ...], says: str
) -> None:
    async with secure.stubs() as raw:
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
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    # Beyond auth.jwt.clock_skew_seconds (30 s) in the past.
    expired = signing.token("alice", expires_in=-120)
    async with secure.stubs() as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(expired))
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "expired" in (error.details() or "")
    await assert_nothing_created(secure, records)


async def test_token_without_expiry_is_unauthenticated(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    forever = signing.token("alice", expires_in=None)
    async with secure.stubs() as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(forever))
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "'exp'" in (error.details() or "")
    await assert_nothing_created(secure, records)


@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256"])
async def test_wrong_signature_is_unauthenticated_and_the_right_one_accepted(
    secure: SecureBroker, records: Records, signing: Signing, alg: str
) -> None:
    other = {
        "HS256": "another-secret-0123456789abcdef0123",
        "RS256": signing.other_rsa,
        "ES256": signing.other_ec,
    }[alg]
    forged = signing.token("alice", alg=alg, key=other)
    async with secure.stubs() as raw:
        error = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC), metadata=bearer(forged))
        )
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "signature does not verify" in (error.details() or "")
        await assert_nothing_created(secure, records)

        good = bearer(signing.token("alice", alg=alg))
        created = await raw.producers.CreateProducer(producer_request(TOPIC), metadata=good)
        await raw.producers.SendMessage(message(created.producer_id, TOPIC), metadata=good)
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 1


async def test_every_service_needs_credentials(secure: SecureBroker, signing: Signing) -> None:
    """SendMessage, Subscribe, Receive, Ack, HealthCheck and the schema registry too: the
    interceptor refuses before any handler runs."""
    good = bearer(signing.token("alice"))
    async with secure.stubs() as raw:
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
        async with secure.channel() as channel:
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
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 0


@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256"])
async def test_danube_client_with_a_token_produces_and_consumes(
    secure: SecureBroker, signing: Signing, alg: str
) -> None:
    async with secure.clients(signing.token("alice", alg=alg)) as clients:
        producer = await clients.producer(TOPIC)
        consumer = await clients.consumer(TOPIC, "s", "c1")
        for i in range(3):
            await producer.send(f"m{i}".encode())
        got = await consumer.take(3)
        assert payloads(got) == [b"m0", b"m1", b"m2"]
        await consumer.ack_all(got)


async def test_api_key_is_accepted_as_bearer_and_as_x_api_key(
    secure: SecureBroker, signing: Signing
) -> None:
    async with secure.clients(API_KEY) as clients:  # Bearer <key>
        producer = await clients.producer(TOPIC, "svc")
        consumer = await clients.consumer(TOPIC, "s", "svc")
        await producer.send(b"from-svc")
        got = await consumer.take(1)
        assert payloads(got) == [b"from-svc"] and offsets(got) == [0]
        await consumer.ack_all(got)
    async with secure.stubs() as raw:
        created = await raw.producers.CreateProducer(
            producer_request(TOPIC, "svc"), metadata=(("x-api-key", API_KEY),)
        )
    assert created.producer_id


async def test_batch_client_sends_its_token(secure: SecureBroker, signing: Signing) -> None:
    token = signing.token("alice")
    async with Producer(secure.url, TOPIC, tls=secure.tls, token=token) as producer:
        futures = [await producer.send(f"b{i}".encode()) for i in range(10)]
        assert [await f for f in futures] == list(range(10))
    async with Consumer(
        secure.url, TOPIC, "batch", start="earliest", tls=secure.tls, token=token
    ) as consumer:
        batch = await anext(aiter(consumer))
        assert batch.offsets == list(range(10))
        consumer.ack(batch)

    async with Producer(secure.url, TOPIC, tls=secure.tls, token="wrong") as refused:
        future = await refused.send(b"never stored")
        with pytest.raises(PublishError) as caught:
            await future
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    info = secure.store.info(TOPIC)
    assert info is not None and info.high_watermark == 10


def bad_credentials(signing: Signing, kind: str) -> str | None:
    """A credential the broker must refuse: none, expired (beyond the 30 s clock skew), signed
    with a key it does not trust, or garbage."""
    if kind == "none":
        return None
    if kind == "expired":
        return signing.token("alice", expires_in=-120)
    if kind == "wrong-signature":
        return signing.token("alice", alg="RS256", key=signing.other_rsa)
    return "garbage"


BAD = ["none", "expired", "wrong-signature", "garbage"]


@pytest.mark.parametrize("kind", BAD)
async def test_danube_client_without_valid_credentials_is_refused(
    secure: SecureBroker, records: Records, signing: Signing, kind: str
) -> None:
    """danube-client over TLS, set up as documented but with no (valid) token: its producer and
    consumer are refused UNAUTHENTICATED and nothing is created."""
    async with secure.clients(bad_credentials(signing, kind)) as clients:
        with pytest.raises(grpc.aio.AioRpcError) as producer:
            await clients.producer(TOPIC)
        assert producer.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as consumer:
            await clients.consumer(TOPIC, "s", "c")
        assert consumer.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await assert_nothing_created(secure, records)
    assert await records.list_subscriptions(TOPIC) == []


@pytest.mark.parametrize("kind", BAD)
async def test_bad_credentials_store_acknowledge_and_receive_nothing(
    secure: SecureBroker, records: Records, signing: Signing, kind: str
) -> None:
    """alice has a producer and a consumer holding three unacknowledged messages. A caller
    without valid credentials, on a TLS connection of its own, is refused UNAUTHENTICATED
    whatever it tries with her ids: publishing, acking, nacking, taking her stream or her
    consumer name. Nothing is stored, nothing settled, nothing delivered to it."""
    token = bad_credentials(signing, kind)
    metadata = bearer(token) if token is not None else ()
    async with secure.clients(signing.token("alice")) as alice:
        producer = await alice.producer(TOPIC)
        victim = await alice.consumer(TOPIC, "s", "victim", SubType.SHARED)
        for i in range(3):
            await producer.send(f"m{i}".encode())
        held = await victim.take(3)
        victim_record = await records.find_consumer(TOPIC, "s", "victim")
        producer_record = await records.find_producer(TOPIC, "p1")
        assert victim_record is not None and producer_record is not None

        async with secure.stubs(own_connection=True) as raw:
            refusals = [
                raw.producers.SendMessage(
                    message(producer_record.client_id, TOPIC, b"forged"), metadata=metadata
                ),
                raw.consumers.Subscribe(
                    consumer_request(TOPIC, "s", "victim", SubType.SHARED), metadata=metadata
                ),
            ]
            for m in held:
                ack = pb.AckRequest(request_id=1, msg_id=m.msg_id, subscription_name="s")
                refusals.append(raw.consumers.Ack(ack, metadata=metadata))
                nack = pb.NackRequest(request_id=1, msg_id=m.msg_id, subscription_name="s")
                refusals.append(raw.consumers.Nack(nack, metadata=metadata))
            for call in refusals:
                error = await rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED, call
            stream = raw.consumers.ReceiveMessages(
                pb.ReceiveRequest(request_id=1, consumer_id=victim_record.client_id),
                metadata=metadata,
            )
            error = await rpc_error(stream.read())
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED

        async with Producer(secure.url, TOPIC, tls=secure.tls, token=token) as batch:
            future = await batch.send(b"batch forged")
            with pytest.raises(PublishError) as refused:
                await future
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED

        assert await stored_payloads(secure.store, TOPIC) == [b"m0", b"m1", b"m2"]
        sub = subscription(secure, "s", TOPIC)
        assert (sub.cursor, sub.unacked) == (0, 3)  # nothing acknowledged (nor nacked)
        assert victim.queue.empty()  # no nack made the broker send them again
        # alice's consumer still owns them: her acks settle them.
        await victim.ack_all(held)
        await eventually(lambda: sub.cursor == 3, "alice's acks to settle her messages")


async def test_token_supplier_expired_token_is_refused_and_a_fresh_one_accepted(
    secure: SecureBroker, signing: Signing
) -> None:
    """danube-client with ``with_token_supplier`` (called on every request): while it hands out
    an expired token every call is refused UNAUTHENTICATED and nothing is stored; once it
    hands out a fresh one the same producer goes on."""
    current = [signing.token("alice")]
    builder = (
        DanubeClientBuilder()
        .service_url(secure.url)
        .with_tls(str(secure.certs.ca))
        .with_token_supplier(lambda: current[0])
    )
    async with Clients(secure.url, builder) as clients:
        producer = await clients.producer(TOPIC)
        await producer.send(b"fresh")
        current[0] = signing.token("alice", expires_in=-120)
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await producer.send(b"while expired")
        assert expired.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "expired" in (expired.value.details() or "")
        assert await stored_payloads(secure.store, TOPIC) == [b"fresh"]
        current[0] = signing.token("alice")
        await producer.send(b"renewed")
    assert await stored_payloads(secure.store, TOPIC) == [b"fresh", b"renewed"]


async def test_auth_without_tls_on_loopback(
    loopback_auth: Broker, records: Records, signing: Signing
) -> None:
    """Auth on a plain loopback port (allowed without TLS): the batch client's token is checked
    the same way; without one nothing is created."""
    async with raw_stubs(loopback_auth.url) as raw:
        error = await rpc_error(raw.producers.CreateProducer(producer_request(TOPIC)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert loopback_auth.store is not None and loopback_auth.store.info(TOPIC) is None
    assert await records.list_clients() == []
    async with Producer(loopback_auth.url, TOPIC, token=signing.token("alice")) as producer:
        assert await (await producer.send(b"over loopback")) == 0
    assert await stored_payloads(loopback_auth.store, TOPIC) == [b"over loopback"]
