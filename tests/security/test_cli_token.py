"""``danube-ingest produce`` / ``consume`` (batch client) against a broker with auth on, as
child processes: ``--token-file`` and ``DANUBE_INGEST_TOKEN`` are sent; without a token the
command fails with the broker's UNAUTHENTICATED message and stores nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.cli.token import TOKEN_ENV
from tests.cli.test_client_start import _cli

from .conftest import Signing


@pytest.mark.slow
async def test_cli_sends_its_token(
    secure: Broker, signing: Signing, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic, url = "/shop/cli", ("--service-url", secure.url)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    code, _, err = await _cli("produce", *url, "--topic", topic, "--count", "3")
    assert code != 0
    assert "UNAUTHENTICATED" in err and "no credentials" in err
    assert secure.store is not None and secure.store.info(topic) is None

    token_file = tmp_path / "token"
    token_file.write_text(signing.token("alice") + "\n")
    code, _, err = await _cli(
        "produce", *url, "--topic", topic, "--count", "3", "--token-file", str(token_file)
    )
    assert code == 0, err
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
