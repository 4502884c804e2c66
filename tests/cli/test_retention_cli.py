"""``danube-ingest retention set|show|clear`` against the real etcd."""

from __future__ import annotations

import pytest

from danube_ingest.cli import main
from danube_ingest.metadata import Keys

pytestmark = pytest.mark.etcd


def test_set_show_clear(etcd_server: str, keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--etcd", etcd_server, "--prefix", keys.prefix]
    assert main(["retention", "set", "/ns", "--max-age", "7d", *common]) == 0
    assert capsys.readouterr().out == "/ns: max_age=7d\n"
    assert main(["retention", "set", "/ns", "--max-bytes", "10GiB", *common]) == 0
    assert capsys.readouterr().out == f"/ns: max_age=7d max_bytes={10 * 2**30}\n"
    assert main(["retention", "set", "/ns/t", "--max-age", "12h", *common]) == 0
    capsys.readouterr()
    assert main(["retention", "show", "/ns/t", *common]) == 0
    assert capsys.readouterr().out == (
        f"/ns/t: max_age=12h\neffective (before the job's default): max_age=12h "
        f"max_bytes={10 * 2**30}\n"
    )
    assert main(["retention", "show", *common]) == 0
    assert (
        capsys.readouterr().out == f"/ns: max_age=7d max_bytes={10 * 2**30}\n/ns/t: max_age=12h\n"
    )
    assert main(["retention", "clear", "/ns/t", *common]) == 0
    assert capsys.readouterr().out == "/ns/t: cleared\n"
    assert main(["retention", "clear", "/ns/t", *common]) == 0
    assert capsys.readouterr().out == "/ns/t: had no policy\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["set", "ns", "--max-age", "1d"], "invalid retention scope 'ns'"),
        (["set", "/a/b/c", "--max-age", "1d"], "invalid retention scope '/a/b/c'"),
        (["set", "/ns", "--max-age", "soon"], "--max-age: invalid duration 'soon'"),
        (["set", "/ns", "--max-age", "0s"], "--max-age: '0s' must be above zero"),
        (["set", "/ns", "--max-bytes", "ten"], "--max-bytes: invalid size 'ten'"),
        (["set", "/ns"], "give --max-age, --max-bytes or --table-max-age"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The etcd endpoint is never reached: the input is checked first.
    assert main(["retention", *argv, "--etcd", "http://127.0.0.1:1"]) == 2
    assert message in capsys.readouterr().err
