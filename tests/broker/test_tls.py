"""TLS on the gRPC port: danube-client and our client over TLS and mutual TLS, refusals
(plain client, missing or foreign client certificate), the secure-listen rule, and a broker on
an etcd with TLS and auth."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from danube import DanubeClientBuilder
from danube.proto import DanubeApi_pb2 as pb
from danube.proto import DanubeApi_pb2_grpc as pb_grpc

from danube_ingest.broker.errors import InsecureListenError, TlsSetupError
from danube_ingest.broker.server import Broker
from danube_ingest.cli import main
from danube_ingest.cli.client import BrokerUnreachableError, check_reachable
from danube_ingest.client import Consumer, Producer, TlsOptions, open_channel
from danube_ingest.testing import broker_config, running_broker
from tests.broker.conftest import BrokerFactory
from tests.broker.support import Clients
from tests.certs import Certs
from tests.secure_etcd import PASSWORD, PREFIX, USER, secure_etcd

TOPIC = "/default/tls"


def tls_overrides(certs: Certs, *, mutual: bool = False) -> dict[str, Any]:
    values: dict[str, Any] = {
        "broker.tls.cert_file": str(certs.server_cert),
        "broker.tls.key_file": str(certs.server_key),
    }
    if mutual:
        values["broker.tls.client_ca_file"] = str(certs.ca)
        values["broker.tls.require_client_cert"] = True
    return values


async def test_danube_client_publishes_and_consumes_over_tls(
    make_broker: BrokerFactory, certs: Certs
) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs))
    assert broker.url.startswith("https://")
    builder = DanubeClientBuilder().service_url(broker.url).with_tls(str(certs.ca))
    async with Clients(broker.url, builder) as clients:
        producer = await clients.producer(TOPIC)
        consumer = await clients.consumer(TOPIC, "s", "c")
        await producer.send(b"secret", {})
        [message] = await consumer.take(1)
        assert message.payload == b"secret"
        await consumer.consumer.ack(message)


async def test_lookup_answers_https_urls(make_broker: BrokerFactory, certs: Certs) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs))
    async with Producer(broker.url, TOPIC, tls=TlsOptions(ca_file=certs.ca)) as producer:
        await (await producer.send(b"x"))
    async with open_channel(broker.url, TlsOptions(ca_file=certs.ca)) as channel:
        answer = await pb_grpc.DiscoveryStub(channel).TopicLookup(
            pb.TopicLookupRequest(request_id=1, topic=TOPIC)
        )
    assert answer.connect_url == broker.url
    assert answer.connect_url.startswith("https://")


async def test_batch_client_over_mutual_tls(make_broker: BrokerFactory, certs: Certs) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs, mutual=True))
    tls = TlsOptions(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
    async with Producer(broker.url, TOPIC, tls=tls) as producer:
        offsets = await (await producer.send_many([b"a", b"b", b"c"]))
    assert [len(r) for r in offsets] == [3]
    async with Consumer(broker.url, TOPIC, "s", start="earliest", tls=tls) as consumer:
        batch = await asyncio.wait_for(consumer.receive(), 10)
        assert [e.payload for e in batch.entries] == [b"a", b"b", b"c"]
        consumer.ack(batch)


async def test_danube_client_over_mutual_tls(make_broker: BrokerFactory, certs: Certs) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs, mutual=True))
    builder = (
        DanubeClientBuilder()
        .service_url(broker.url)
        .with_mtls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    )
    async with Clients(broker.url, builder) as clients:
        producer = await clients.producer(TOPIC)
        await producer.send(b"m", {})


@pytest.mark.parametrize("client_cert", ["none", "stranger"])
async def test_mutual_tls_refuses_clients_without_a_trusted_certificate(
    make_broker: BrokerFactory, certs: Certs, client_cert: str
) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs, mutual=True))
    tls = TlsOptions(ca_file=certs.ca)
    if client_cert == "stranger":
        tls = TlsOptions(
            ca_file=certs.ca, cert_file=certs.stranger_cert, key_file=certs.stranger_key
        )
    with pytest.raises(BrokerUnreachableError, match="client certificate"):
        await check_reachable(broker.url, 2.0, tls)
    async with open_channel(broker.url, tls) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.DiscoveryStub(channel).TopicLookup(
                pb.TopicLookupRequest(request_id=1, topic=TOPIC), timeout=5
            )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plain_client_against_tls_port_fails_clearly(
    make_broker: BrokerFactory, certs: Certs
) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs))
    plain = broker.url.replace("https://", "http://")
    with pytest.raises(BrokerUnreachableError, match="does it serve TLS"):
        await check_reachable(plain, 2.0)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_cli_produce_and_consume_over_tls(make_broker: BrokerFactory, certs: Certs) -> None:
    broker: Broker = await make_broker(**tls_overrides(certs, mutual=True))
    tls_args = ["--ca-file", str(certs.ca), "--cert-file", str(certs.client_cert)]
    tls_args += ["--key-file", str(certs.client_key)]
    for client in ("ingest", "danube"):
        topic = f"{TOPIC}-{client}"
        common = ["--service-url", broker.url, "--topic", topic, "--client", client, *tls_args]
        produce = await _cli("produce", *common, "--count", "3")
        assert produce.returncode == 0, produce.stderr
        consume = await _cli("consume", *common, "--count", "3", "--subscription", "s")
        assert consume.returncode == 0, consume.stderr
        assert consume.stdout.count(topic) == 3
    # Without the client certificate: exit 1 and a message naming what is missing.
    refused = await _cli(
        "produce",
        "--service-url",
        broker.url,
        "--topic",
        TOPIC,
        "--ca-file",
        str(certs.ca),
        "--connect-timeout",
        "2",
    )
    assert refused.returncode == 1
    assert "client certificate" in refused.stderr


async def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "danube_ingest.cli", *args]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=45, env=os.environ
    )


async def test_non_loopback_without_tls_refuses_to_start(tmp_path: Path, etcd_server: str) -> None:
    config = broker_config(tmp_path, etcd_server, overrides={"broker.listen": "0.0.0.0:0"})
    with pytest.raises(InsecureListenError, match=r"0\.0\.0\.0:0.*broker\.tls.*allow_insecure"):
        await Broker(config).start()


@pytest.mark.parametrize(
    "overrides", [{"broker.allow_insecure": True}, "tls"], ids=["allow_insecure", "tls"]
)
async def test_non_loopback_starts_with_tls_or_allow_insecure(
    tmp_path: Path, etcd_server: str, certs: Certs, overrides: Any
) -> None:
    values = tls_overrides(certs) if overrides == "tls" else overrides
    config = broker_config(
        tmp_path, etcd_server, overrides={"broker.listen": "0.0.0.0:0", **values}
    )
    async with running_broker(config) as broker:
        assert broker.port > 0


@pytest.mark.parametrize(
    ("loopback", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("[::]", False),
        ("10.1.2.3", False),
        ("broker.example", False),
    ],
)
def test_loopback_rule(loopback: str, allowed: bool) -> None:
    from danube_ingest.broker.tls import check_listen
    from danube_ingest.config import load_config

    section = load_config(None, {"broker.listen": f"{loopback}:6650"}).broker
    if allowed:
        check_listen(section)
    else:
        with pytest.raises(InsecureListenError):
            check_listen(section)


@pytest.mark.parametrize("bad", ["missing", "not_pem", "wrong_key"])
async def test_bad_tls_files_name_the_key(
    tmp_path: Path, etcd_server: str, certs: Certs, bad: str
) -> None:
    values = tls_overrides(certs)
    if bad == "missing":
        values["broker.tls.cert_file"] = str(tmp_path / "nope.pem")
        expected = "broker.tls.cert_file"
    elif bad == "not_pem":
        garbage = tmp_path / "garbage.pem"
        garbage.write_text("hello")
        values["broker.tls.key_file"] = str(garbage)
        expected = "broker.tls.key_file"
    else:
        values["broker.tls.key_file"] = str(certs.client_key)
        expected = "may not be the key of broker.tls.cert_file"
    config = broker_config(tmp_path / "b", etcd_server, overrides=values)
    with pytest.raises(TlsSetupError, match=expected):
        await Broker(config).start()


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_broker_on_etcd_with_tls_and_auth(
    tmp_path: Path, certs: Certs, capsys: pytest.CaptureFixture[str]
) -> None:
    """Everything secured: the broker reaches etcd over TLS with a client certificate as a user
    who may only touch its prefix, and serves its clients over TLS."""
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    with secure_etcd(certs) as etcd:
        config = broker_config(
            tmp_path / "b",
            etcd.endpoint,
            prefix=PREFIX,
            overrides={
                **tls_overrides(certs),
                "etcd.ca_file": str(certs.ca),
                "etcd.cert_file": str(certs.client_cert),
                "etcd.key_file": str(certs.client_key),
                "etcd.user": USER,
                "etcd.password_file": str(password_file),
            },
        )
        async with running_broker(config) as broker:
            builder = DanubeClientBuilder().service_url(broker.url).with_tls(str(certs.ca))
            async with Clients(broker.url, builder) as clients:
                producer = await clients.producer(TOPIC)
                consumer = await clients.consumer(TOPIC, "s", "c")
                await producer.send(b"through secured etcd", {})
                [message] = await consumer.take(1)
                assert message.payload == b"through secured etcd"
            # The admin commands reach the same etcd with the --etcd-* options.
            argv = ["topics", "--etcd", etcd.endpoint, "--prefix", PREFIX]
            argv += ["--etcd-ca-file", str(certs.ca), "--etcd-cert-file", str(certs.client_cert)]
            argv += ["--etcd-key-file", str(certs.client_key), "--etcd-user", USER]
            argv += ["--etcd-password-file", str(password_file)]
            capsys.readouterr()
            assert await asyncio.to_thread(main, argv) == 0
            assert TOPIC in capsys.readouterr().out
