"""Streams end when their token expires (as Kafka's re-authentication, KIP-368): an open
ReceiveMessages stream, a batch Publish stream and a batch Consume stream opened with a JWT end
with UNAUTHENTICATED ("token expired ...") at its ``exp``, and clients re-authenticate: the
batch client asks its token provider for a new token and goes on, danube-client subscribes
again with its token supplier's. API keys do not expire. Real short-lived JWTs (``exp`` a few
seconds ahead) against a real broker with ``auth.jwt.clock_skew_seconds: 0``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from danube import DanubeClientBuilder, SubType
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.client import ConsumeError, Consumer, Producer, PublishError
from danube_ingest.proto import ingest_pb2_grpc as ingest_grpc
from danube_ingest.security import TOKEN_EXPIRED
from danube_ingest.testing import broker_config, running_broker
from tests.broker.support import Clients, consumer_request, offsets, payloads, rpc_error
from tests.broker.test_tls import tls_overrides
from tests.certs import Certs

from .conftest import API_KEY, SecureBroker, Signing, auth_overrides, bearer, stored_payloads

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

TOPIC = "/shop/expiring"
#: Lifetime of the short-lived tokens (seconds; ``exp`` is whole seconds, so 2 to 3 s).
LIFETIME = 3
#: How long after its ``exp`` a stream may take to end.
GRACE = 3.0


@pytest.fixture
async def strict(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, signing: Signing, certs: Certs
) -> AsyncIterator[SecureBroker]:
    """``secure`` with no clock skew leeway: a token is refused from its ``exp`` on."""
    overrides = {
        **auth_overrides(signing),
        **tls_overrides(certs),
        "auth.jwt.clock_skew_seconds": 0,
    }
    config = broker_config(tmp_path / "b1", etcd_server, prefix=etcd_prefix, overrides=overrides)
    async with running_broker(config) as broker:
        yield SecureBroker(broker, certs)


def short_token(signing: Signing, sub: str = "alice") -> tuple[str, float]:
    """A JWT for ``sub`` expiring in 2-3 s, and its ``exp``."""
    exp = int(time.time() + LIFETIME)
    return signing.token(sub, expires_in=exp - time.time()), float(exp)


async def until(exp: float) -> None:
    """Sleep until just after ``exp`` (seconds since the epoch)."""
    await asyncio.sleep(max(exp - time.time(), 0) + 0.2)


async def test_receive_messages_stream_ends_unauthenticated_when_its_token_expires(
    strict: SecureBroker, signing: Signing
) -> None:
    """A ReceiveMessages stream opened with a short-lived token delivers while the token is
    valid, then ends with UNAUTHENTICATED saying the token expired, also while it waits for a
    message; what it held goes back to the subscription."""
    token, exp = short_token(signing)
    async with strict.clients(signing.token("alice")) as alice:
        producer = await alice.producer(TOPIC)
        async with strict.stubs() as raw:
            subscribed = await raw.consumers.Subscribe(
                consumer_request(TOPIC, "s", "short", SubType.SHARED), metadata=bearer(token)
            )
            stream = raw.consumers.ReceiveMessages(
                pb.ReceiveRequest(request_id=1, consumer_id=subscribed.consumer_id),
                metadata=bearer(token),
            )
            await producer.send(b"m0")
            first = await asyncio.wait_for(stream.read(), 5)
            assert first.payload == b"m0"
            error = await asyncio.wait_for(rpc_error(stream.read()), exp - time.time() + GRACE)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (error.details() or "").startswith(TOKEN_EXPIRED), error.details()
        assert time.time() >= exp - 0.5

        # m0 was never acked: the subscription gives it to the next consumer.
        other = await alice.consumer(TOPIC, "s", "other", SubType.SHARED)
        assert payloads(await other.take(1)) == [b"m0"]


async def test_danube_client_consumer_resubscribes_with_its_suppliers_new_token(
    strict: SecureBroker, signing: Signing
) -> None:
    """danube-client with ``with_token_supplier``: its stream ends at the token's expiry, it
    subscribes again by itself with the supplier's new token and receives what is published
    after the expiry."""
    token, exp = short_token(signing)
    current = [token]
    builder = (
        DanubeClientBuilder()
        .service_url(strict.url)
        .with_tls(str(strict.certs.ca))
        .with_token_supplier(lambda: current[0])
    )
    async with (
        strict.clients(signing.token("alice")) as alice,
        Clients(strict.url, builder) as renewing,
    ):
        producer = await alice.producer(TOPIC)
        consumer = await renewing.consumer(TOPIC, "s", "renewing")
        await producer.send(b"before")
        before = await consumer.take(1)
        await consumer.ack_all(before)
        current[0] = signing.token("alice")  # the supplier renews the token in time
        await until(exp)
        await producer.send(b"after")
        after = await consumer.take(1, timeout=30)
        assert payloads(after) == [b"after"] and offsets(after) == [1]


async def test_batch_publish_stream_ends_at_expiry_and_the_provider_renews_it(
    strict: SecureBroker, signing: Signing
) -> None:
    """The batch Producer: with a fixed short-lived token, a batch sent after the expiry fails
    UNAUTHENTICATED and nothing more is stored; with a token provider minting short-lived
    tokens, publishing goes on across several expiries, every message stored once, in order."""
    token, exp = short_token(signing)
    async with Producer(strict.url, TOPIC, tls=strict.tls, token=token) as fixed:
        assert await (await fixed.send(b"valid")) == 0
        await until(exp)
        refused = await fixed.send(b"expired")
        with pytest.raises(PublishError) as caught:
            await refused
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN_EXPIRED in str(caught.value)
    assert await stored_payloads(strict.store, TOPIC) == [b"valid"]

    minted: list[float] = []

    def provider() -> str:
        new, new_exp = short_token(signing)
        minted.append(new_exp)
        return new

    sent = [f"p{i}".encode() for i in range(30)]
    async with Producer(strict.url, TOPIC, tls=strict.tls, token=provider) as renewing:
        futures = []
        for payload in sent:
            futures.append(await renewing.send(payload))
            await asyncio.sleep(0.25)  # 7.5 s: across two or three expiries
        assert [await f for f in futures] == list(range(1, 31))
    assert len(minted) >= 3, minted
    assert await stored_payloads(strict.store, TOPIC) == [b"valid", *sent]


async def test_batch_consume_stream_ends_at_expiry_and_the_provider_renews_it(
    strict: SecureBroker, signing: Signing
) -> None:
    """The batch Consumer: with a fixed short-lived token its stream ends UNAUTHENTICATED at
    the expiry (a refusal, not retried); with a token provider it subscribes again with a new
    token and receives what is published after the expiry."""
    async with Producer(strict.url, TOPIC, tls=strict.tls, token=API_KEY) as producer:
        await (await producer.send(b"m0"))
        token, exp = short_token(signing)
        async with Consumer(
            strict.url, TOPIC, "fixed", start="earliest", tls=strict.tls, token=token
        ) as fixed:
            assert (await fixed.receive(timeout=5)).offsets == [0]
            await until(exp)
            await (await producer.send(b"m1"))
            with pytest.raises(ConsumeError) as caught:
                await fixed.receive(timeout=GRACE)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert not caught.value.retriable
        assert caught.value.details.startswith(TOKEN_EXPIRED), caught.value.details

        minted: list[float] = []

        def provider() -> str:
            new, new_exp = short_token(signing)
            minted.append(new_exp)
            return new

        async with Consumer(
            strict.url, TOPIC, "renewing", start="earliest", tls=strict.tls, token=provider
        ) as renewing:
            got: list[int] = []
            while len(got) < 2:
                batch = await renewing.receive(timeout=5)
                renewing.ack(batch)
                got += batch.offsets
            assert got == [0, 1]
            await until(minted[-1])
            await (await producer.send(b"m2"))
            batch = await renewing.receive(timeout=10)
            assert batch.offsets == [2]
            renewing.ack(batch)
            assert renewing.reconnects >= 1 and len(minted) >= 2


async def test_api_key_streams_do_not_expire(strict: SecureBroker) -> None:
    """API keys have no ``exp``: a raw ReceiveMessages stream opened with one outlives
    LIFETIME and still delivers."""
    async with strict.clients(API_KEY) as svc:
        producer = await svc.producer(TOPIC, "svc")
        consumer = await svc.consumer(TOPIC, "s", "svc")
        await asyncio.sleep(LIFETIME + 1)
        await producer.send(b"late")
        assert payloads(await consumer.take(1)) == [b"late"]


async def test_raw_batch_publish_stream_ends_unauthenticated(
    strict: SecureBroker, signing: Signing
) -> None:
    """The batch Publish stream itself (raw gRPC): open and idle, it ends with
    UNAUTHENTICATED once its token expires."""
    token, exp = short_token(signing)
    channel = strict.channel()
    async with channel:
        stub = ingest_grpc.IngestServiceStub(channel)  # type: ignore[no-untyped-call]
        call = stub.Publish(metadata=bearer(token))
        error = await asyncio.wait_for(rpc_error(call.read()), exp - time.time() + GRACE)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (error.details() or "").startswith(TOKEN_EXPIRED)


async def test_batch_producer_loses_no_batch_in_flight_when_its_token_expires(
    strict: SecureBroker, signing: Signing
) -> None:
    """A bulk publish spanning the expiry (batches in flight when the stream ends): they are
    resent on the stream opened with the provider's new token, not failed; every message is
    stored exactly once, in order."""
    minted: list[float] = []

    def provider() -> str:
        new, new_exp = short_token(signing)
        minted.append(new_exp)
        return new

    bulks: list[asyncio.Future[list[range]]] = []
    async with Producer(strict.url, TOPIC, tls=strict.tls, token=provider) as producer:
        assert await (await producer.send(b"first")) == 0
        await asyncio.sleep(max(minted[0] - time.time() - 0.3, 0))
        while time.time() < minted[0] + 0.5:  # bulks of 20 batches, without pause
            bulks.append(await producer.send_many([b"x" * 100] * 20_000))
        stored = [r for bulk in bulks for r in await bulk]
    count = 20_000 * len(bulks)
    assert len(minted) >= 2, "the stream was not opened again"
    assert [o for r in stored for o in r] == list(range(1, count + 1))
    info = strict.store.info(TOPIC)
    assert info is not None and info.high_watermark == count + 1
