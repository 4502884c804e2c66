"""``danube-ingest produce`` / ``consume`` as child processes against a broker with auth on and
TLS, with ``--ca-file`` and a token (``--token``, ``--token-file``, ``DANUBE_INGEST_TOKEN``),
through both clients: the token is sent on every call (also by ``consume --from``'s
start-position subscribe with ``--client danube``); without a valid one the command fails with
the broker's UNAUTHENTICATED message and stores nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from danube_ingest.cli.token import TOKEN_ENV
from danube_ingest.client import Consumer, TlsOptions
from danube_ingest.testing import BrokerProcess
from tests.broker.support import stop_all
from tests.certs import Certs
from tests.cli.test_client_start import _cli

from .conftest import SecureBroker, Signing, auth_section, stored_payloads


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_cli_sends_its_token(
    secure: SecureBroker, signing: Signing, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = "/shop/cli"
    url = ("--service-url", secure.url, "--ca-file", str(secure.certs.ca))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    code, _, err = await _cli("produce", *url, "--topic", topic, "--count", "3")
    assert code != 0
    assert "UNAUTHENTICATED" in err and "no credentials" in err
    assert secure.store.info(topic) is None

    expired = signing.token("alice", expires_in=-120)
    code, _, err = await _cli("produce", *url, "--topic", topic, "--token", expired)
    assert code != 0
    assert "UNAUTHENTICATED" in err and "expired" in err
    assert secure.store.info(topic) is None

    token_file = tmp_path / "token"
    token_file.write_text(signing.token("alice") + "\n")
    code, _, err = await _cli(
        "produce", *url, "--topic", topic, "--count", "3", "--token-file", str(token_file)
    )
    assert code == 0, err
    assert len(await stored_payloads(secure.store, topic)) == 3
    monkeypatch.setenv(TOKEN_ENV, signing.token("alice"))
    code, out, err = await _cli(
        "consume",
        *url,
        "--topic",
        topic,
        "--subscription",
        "s",
        "--from",
        "earliest",
        "--count",
        "3",
    )
    assert code == 0, err
    assert len(out.splitlines()) == 3


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_cli_with_danube_client_against_a_tls_and_auth_daemon(
    etcd_server: str, etcd_prefix: str, signing: Signing, certs: Certs, tmp_path: Path
) -> None:
    """The daemon in a child process (``danube-ingest broker`` with ``broker.tls`` and
    ``auth``); ``--client danube`` sends ``--token`` over TLS with ``--ca-file``, and
    ``consume --from earliest`` gets the messages published before it subscribed (its
    start-position subscribe carries the token too). A refused token stores nothing."""
    broker = BrokerProcess(
        tmp_path / "b1",
        etcd_server,
        prefix=etcd_prefix,
        tls={"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
        auth=auth_section(signing),
    )
    await asyncio.to_thread(broker.start)
    try:
        assert broker.url.startswith("https://")
        topic = "/shop/danube-cli"
        alice = signing.token("alice")
        common = ("--service-url", broker.url, "--ca-file", str(certs.ca), "--topic", topic)
        forged = signing.token("alice", alg="RS256", key=signing.other_rsa)
        code, _, err = await _cli(
            "produce", *common, "--client", "danube", "--token", forged, "--count", "1"
        )
        assert code != 0
        assert "UNAUTHENTICATED" in err, err

        code, _, err = await _cli(
            "produce", *common, "--client", "danube", "--token", alice, "--count", "3"
        )
        assert code == 0, err
        code, out, err = await _cli(
            "consume",
            *common,
            "--client",
            "danube",
            "--token",
            alice,
            "--from",
            "earliest",
            "--subscription",
            "s",
            "--count",
            "3",
        )
        assert code == 0, err
        assert [line.split(" ", 1)[0] for line in out.splitlines()] == [
            f"{topic}@{offset}" for offset in range(3)
        ]

        # What the daemon stored: exactly the three accepted messages (not the forged one).
        tls = TlsOptions(ca_file=certs.ca)
        got: list[int] = []
        async with Consumer(
            broker.url, topic, "check", start="earliest", tls=tls, token=alice
        ) as c:
            while len(got) < 3:
                batch = await asyncio.wait_for(c.receive(), 10)
                got += batch.offsets
                c.ack(batch)
        assert got == [0, 1, 2]
    finally:
        await stop_all([broker])
