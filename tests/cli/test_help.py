"""Every command added for the everyday client and admin work has ``--help`` that exits 0 and
names what it does."""

from __future__ import annotations

import pytest

from danube_ingest.cli import main

HELP = [
    (["schemas"], "attach a subject to a topic"),
    (["schemas", "register"], "compatibility mode"),
    (["schemas", "list"], "--etcd"),
    (["schemas", "show"], "--version"),
    (["schemas", "check"], "nothing is registered"),
    (["schemas", "attach"], "--payload-validation"),
    (["topics", "create"], "--partitions"),
    (["topics", "describe"], "retention"),
    (["subscriptions"], "lag"),
    (["subscriptions", "reset"], "earliest|latest|OFFSET|TIME"),
    (["subscriptions", "delete"], "connected"),
    (["produce"], "--key-separator"),
    (["consume"], "--print"),
]


@pytest.mark.parametrize(("argv", "needle"), HELP)
def test_help(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    assert needle in " ".join(capsys.readouterr().out.split())
