"""Identity binding: producer and consumer ids, consumer names and in-flight messages belong to
the caller that created or received them. Another principal (mallory, who may produce and
consume in the same namespace) is refused with PERMISSION_DENIED and nothing is stored,
acknowledged or taken over; with auth off, acks are still bound to the receiving connection."""

from __future__ import annotations

import grpc
import pytest
from danube import SubType
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.broker.server import Broker
from danube_ingest.client import Producer, PublishError
from danube_ingest.metadata.records import Records
from tests.broker.support import (
    Clients,
    Subscribed,
    consumer_request,
    eventually,
    message,
    offsets,
    producer_request,
    raw_stubs,
    rpc_error,
)

from .conftest import (
    SecureBroker,
    Signing,
    bearer,
    other_process_stubs,
    stored_payloads,
    subscription,
)

TOPIC = "/shop/orders"
IN_FLIGHT = 16


async def test_forged_producer_id_is_refused_and_nothing_stored(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    alice, mallory = bearer(signing.token("alice")), bearer(signing.token("mallory"))
    async with secure.stubs() as raw:
        created = await raw.producers.CreateProducer(producer_request(TOPIC, "p"), metadata=alice)
        producer_id = created.producer_id
        stored = await records.get_client(producer_id)
        assert stored is not None and stored.principal == "alice"  # persisted with its owner
        await raw.producers.SendMessage(message(producer_id, TOPIC, b"a"), metadata=alice)
        assert await stored_payloads(secure.store, TOPIC) == [b"a"]

        forged = await rpc_error(
            raw.producers.SendMessage(message(producer_id, TOPIC, b"forged"), metadata=mallory)
        )
        assert forged.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "belongs to another principal" in (forged.details() or "")
        assert "'mallory'" in (forged.details() or "")
        health = await rpc_error(
            raw.health.HealthCheck(
                pb.HealthCheckRequest(
                    request_id=1, client=pb.HealthCheckRequest.Producer, id=producer_id
                ),
                metadata=mallory,
            )
        )
        assert health.code() == grpc.StatusCode.PERMISSION_DENIED
        # Nor can mallory get alice's producer by registering its name.
        same_name = await rpc_error(
            raw.producers.CreateProducer(producer_request(TOPIC, "p"), metadata=mallory)
        )
        assert same_name.code() == grpc.StatusCode.PERMISSION_DENIED
        assert await stored_payloads(secure.store, TOPIC) == [b"a"]

        # alice goes on; her own health check is answered.
        await raw.producers.SendMessage(message(producer_id, TOPIC, b"b"), metadata=alice)
        ok = await raw.health.HealthCheck(
            pb.HealthCheckRequest(
                request_id=1, client=pb.HealthCheckRequest.Producer, id=producer_id
            ),
            metadata=alice,
        )
        assert ok.status == pb.HealthCheckResponse.OK
    assert await stored_payloads(secure.store, TOPIC) == [b"a", b"b"]


async def crash(clients: Clients, consumer: Subscribed) -> None:
    """What a killed client process leaves: its receive stream and connection gone, no acks."""
    for task in consumer.consumer._tasks:
        task.cancel()
    for connection in list(clients.client.connection_manager._connections.values()):
        await connection.channel.close()


async def test_foreign_ack_is_refused_and_the_victims_messages_are_redelivered_after_its_crash(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    alice = signing.token("alice")
    mallory = bearer(signing.token("mallory"))
    async with secure.clients(alice) as victim_side:
        producer = await victim_side.producer(TOPIC)
        victim = await victim_side.consumer(TOPIC, "s", "victim", SubType.SHARED)
        for i in range(IN_FLIGHT):
            await producer.send(f"m{i}".encode())
        held = await victim.take(IN_FLIGHT)
        assert offsets(held) == list(range(IN_FLIGHT))
        victim_record = await records.find_consumer(TOPIC, "s", "victim")
        assert victim_record is not None

        async with secure.stubs(own_connection=True) as raw:
            for m in held:
                ack = pb.AckRequest(request_id=1, msg_id=m.msg_id, subscription_name="s")
                error = await rpc_error(raw.consumers.Ack(ack, metadata=mallory))
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "dispatched to another consumer" in (error.details() or "")
            nack = pb.NackRequest(request_id=1, msg_id=held[0].msg_id, subscription_name="s")
            error = await rpc_error(raw.consumers.Nack(nack, metadata=mallory))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            # Nor may mallory take the victim's stream (and with it the victim's messages).
            stream = raw.consumers.ReceiveMessages(
                pb.ReceiveRequest(request_id=1, consumer_id=victim_record.client_id),
                metadata=mallory,
            )
            error = await rpc_error(stream.read())
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED

        sub = subscription(secure, "s", TOPIC)
        assert sub.cursor == 0 and sub.unacked == IN_FLIGHT  # nothing acknowledged
        assert victim.queue.empty()  # nor redelivered by the refused nack
        expected = [f"m{i}".encode() for i in range(IN_FLIGHT)]
        assert await stored_payloads(secure.store, TOPIC) == expected
        await crash(victim_side, victim)

    # The victim's replacement (alice again, same consumer name) gets every message again.
    async with secure.clients(alice) as again:
        back = await again.consumer(TOPIC, "s", "victim", SubType.SHARED)
        redelivered = await back.take(IN_FLIGHT)
        assert sorted(offsets(redelivered)) == list(range(IN_FLIGHT))
        await back.ack_all(redelivered)


async def test_foreign_ack_is_refused_with_auth_off(open_broker: Broker) -> None:
    """The issue's probe, on a broker without auth: another client's acks of a consumer's
    in-flight messages are refused (they come over another connection), so its crash loses
    nothing."""
    async with Clients(open_broker.url) as victim_side:
        producer = await victim_side.producer(TOPIC)
        victim = await victim_side.consumer(TOPIC, "s", "victim", SubType.SHARED)
        for i in range(IN_FLIGHT):
            await producer.send(f"m{i}".encode())
        held = await victim.take(IN_FLIGHT)
        async with other_process_stubs(open_broker.url) as raw:
            for m in held:
                ack = pb.AckRequest(request_id=1, msg_id=m.msg_id, subscription_name="s")
                error = await rpc_error(raw.consumers.Ack(ack))
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert subscription(open_broker, "s", TOPIC).cursor == 0
        await crash(victim_side, victim)

    async with Clients(open_broker.url) as others:
        survivor = await others.consumer(TOPIC, "s", "other", SubType.SHARED)
        redelivered = await survivor.take(IN_FLIGHT)
        assert sorted(offsets(redelivered)) == list(range(IN_FLIGHT))
        await survivor.ack_all(redelivered)


async def test_exclusive_subscription_is_not_taken_over_by_reusing_the_holders_name(
    secure: SecureBroker, records: Records, signing: Signing
) -> None:
    """mallory subscribing under the holder's name (through danube-client over TLS, and raw)
    is refused PERMISSION_DENIED: the holder keeps its stream and its unacknowledged message,
    and mallory receives nothing."""
    alice = signing.token("alice")
    mallory = bearer(signing.token("mallory"))
    async with secure.clients(alice) as holder_side:
        producer = await holder_side.producer(TOPIC)
        holder = await holder_side.consumer(TOPIC, "s", "holder", SubType.EXCLUSIVE)
        await producer.send(b"in flight")
        in_flight = await holder.take(1)
        async with secure.clients(signing.token("mallory")) as attacker:
            with pytest.raises(grpc.aio.AioRpcError) as taken:
                await attacker.consumer(TOPIC, "s", "holder", SubType.EXCLUSIVE)
            assert taken.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with secure.stubs(own_connection=True) as raw:
            error = await rpc_error(
                raw.consumers.Subscribe(
                    consumer_request(TOPIC, "s", "holder", SubType.EXCLUSIVE), metadata=mallory
                )
            )
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "consumer name 'holder'" in (error.details() or "")
            other = await rpc_error(
                raw.consumers.Subscribe(
                    consumer_request(TOPIC, "s", "mallory", SubType.EXCLUSIVE), metadata=mallory
                )
            )
            assert other.code() == grpc.StatusCode.PERMISSION_DENIED  # Exclusive is held
        record = await records.find_consumer(TOPIC, "s", "holder")
        assert record is not None and record.principal == "alice"
        sub = subscription(secure, "s", TOPIC)
        assert (sub.cursor, sub.unacked) == (0, 1)  # the holder's message is still its own
        # The holder still has its stream.
        await producer.send(b"still mine")
        got = await holder.take(1)
        assert offsets(in_flight + got) == [0, 1]
        await holder.ack_all(in_flight + got)
        await eventually(lambda: sub.cursor == 2, "the holder's acks to settle")
    assert await stored_payloads(secure.store, TOPIC) == [b"in flight", b"still mine"]

    # alice reconnecting under the same name takes over, as danube-client relies on.
    async with secure.clients(alice) as again:
        back = await again.consumer(TOPIC, "s", "holder", SubType.EXCLUSIVE)
        assert back.queue.empty()


async def test_ids_are_random_not_sequential(open_broker: Broker) -> None:
    async with raw_stubs(open_broker.url) as raw:
        ids = [
            (await raw.producers.CreateProducer(producer_request(TOPIC, f"p{i}"))).producer_id
            for i in range(5)
        ]
        ids.append((await raw.consumers.Subscribe(consumer_request(TOPIC, "s", "c"))).consumer_id)
    assert len(set(ids)) == len(ids)
    assert all(0 < i < 2**63 for i in ids)
    assert not {i + 1 for i in ids} & set(ids)
    assert max(ids) > 2**32


async def test_batch_producer_id_of_another_principal_is_refused(
    secure: SecureBroker, signing: Signing
) -> None:
    """An idempotent producer's id is delivered to consumers with its messages; reusing it must
    not let anyone make the producer's next batches look like duplicates (acknowledged, not
    stored)."""
    async with Producer(secure.url, TOPIC, tls=secure.tls, token=signing.token("alice")) as alice:
        assert await (await alice.send(b"a0")) == 0
        async with Producer(
            secure.url, TOPIC, tls=secure.tls, token=signing.token("mallory")
        ) as mallory:
            mallory.producer_id = alice.producer_id  # learnt from a delivered message
            future = await mallory.send(b"forged")
            with pytest.raises(PublishError) as refused:
                await future
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "idempotent producer id" in refused.value.details
        assert await (await alice.send(b"a1")) == 1
    assert await stored_payloads(secure.store, TOPIC) == [b"a0", b"a1"]
