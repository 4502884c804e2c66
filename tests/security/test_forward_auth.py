"""A publish forwarded to a topic's new owner (``broker.forward``) carries the caller's token:
the owner authenticates and authorizes the same principal (auth on, plain loopback)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from danube.proto import DanubeApi_pb2 as pb

from danube_ingest.config import BrokerConfig
from danube_ingest.testing import broker_config, running_broker
from tests.broker.support import producer_request, raw_stubs, rpc_error, take_over

from .conftest import Signing, auth_overrides, bearer

pytestmark = [pytest.mark.etcd]

T = "/shop/moved"


@pytest.mark.timeout(60)
async def test_a_forwarded_publish_is_authenticated_by_the_owner_as_its_caller(
    tmp_path: Path, etcd_server: str, etcd_prefix: str, signing: Signing
) -> None:
    def config(name: str) -> BrokerConfig:
        return broker_config(
            tmp_path / name,
            etcd_server,
            broker_id=name,
            prefix=etcd_prefix,
            overrides=auth_overrides(signing),
        )

    async with (
        running_broker(config("b1")) as first,
        running_broker(config("b2")) as second,
        raw_stubs(first.url) as raw,
    ):
        assert first.manager is not None and second.manager is not None
        assert second.store is not None
        alice = bearer(signing.token("alice"))
        created = await raw.producers.CreateProducer(producer_request(T), metadata=alice)
        # The first broker loses the topic as a paused owner does; the second takes it over.
        await take_over(first, second, etcd_server, etcd_prefix, T)
        message = pb.StreamMessage(
            request_id=3, msg_id=pb.MsgID(producer_id=created.producer_id, topic_name=T)
        )
        stored = second.store.next_offset(T)
        answer = await raw.producers.SendMessage(message, metadata=alice)
        assert answer.request_id == 3
        assert second.store.next_offset(T) == stored + 1
        # Another principal is refused (by the first broker, before anything is forwarded).
        mallory = bearer(signing.token("mallory"))
        err = await rpc_error(raw.producers.SendMessage(message, metadata=mallory))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert second.store.next_offset(T) == stored + 1
