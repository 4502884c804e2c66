"""``subscriptions reset|delete`` need the ``admin`` permission on the topic: a token that may
only consume is refused (PERMISSION_DENIED) and the cursor stays; an operator's resets it."""

from __future__ import annotations

import pytest

from danube_ingest.broker.server import Broker
from danube_ingest.metadata.records import Records
from tests.cli.cli_support import run_cli

from .conftest import Signing


@pytest.mark.slow
async def test_reset_and_delete_need_admin(
    loopback_auth: Broker, signing: Signing, records: Records
) -> None:
    topic = "/shop/admin_reset"
    url = ("--service-url", loopback_auth.url)
    alice = ("--token", signing.token("alice"))
    code, _, err = await run_cli("produce", *url, *alice, "--topic", topic, "--count", "4")
    assert code == 0, err
    code, _, err = await run_cli(
        "consume", *url, *alice, "--topic", topic, "--subscription", "s", "--count", "4"
    )
    assert code == 0, err

    for argv in (["reset", topic, "s", "--to", "earliest"], ["delete", topic, "s"]):
        code, _, err = await run_cli("subscriptions", *argv, *url, *alice)
        assert code == 1, err
        assert "PERMISSION_DENIED" in err, err
        code, _, err = await run_cli("subscriptions", *argv, *url)
        assert code == 1 and "UNAUTHENTICATED" in err, err
    assert await records.get_subscription(topic, "s") is not None

    operator = ("--token", signing.token("bob", roles=["ops"]))
    code, out, err = await run_cli(
        "subscriptions", "reset", topic, "s", "--to", "earliest", *url, *operator
    )
    assert code == 0, err
    assert out.endswith("-> 0 (earliest)\n"), out
    assert await records.get_cursor(topic, "s") == 0
    code, _, err = await run_cli("subscriptions", "delete", topic, "s", *url, *operator)
    assert code == 0, err
    assert await records.get_subscription(topic, "s") is None
