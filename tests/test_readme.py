"""The README's "Running it" commands, run as written.

Every ``bash`` block of that section is preceded by a ``<!-- readme-test: KIND -->`` comment:

* ``server``: long-running commands. ``make dev`` is stood in for by ``danube-ingest dev
  --no-dagster`` (what it runs, minus the Dagster UI, which ``tests/cli/test_dev.py`` covers) on
  the default ports; every other server command is started verbatim, must come up on its port
  and stop with exit 0 on Ctrl-C (SIGINT).
* ``while make dev runs`` / ``after make dev stopped``: one-shot commands, run verbatim with
  ``bash -c`` in a scratch directory that looks like a fresh clone after ``make dev`` (its
  ``.venv``, ``config/``); each must exit 0 within ``COMMAND_TIMEOUT``.

The commands use the default ports (6650 for the broker, 2379/2380 for etcd), as a user's
would, so the test waits for them to be free first.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

ROOT = Path(__file__).resolve().parent.parent
#: Seconds one one-shot command may take (produce/consume of 1000 messages take a few).
COMMAND_TIMEOUT = 120.0
#: Seconds a server may take to come up or to stop.
SERVER_TIMEOUT = 60.0
#: The default ports the README's commands use.
BROKER_PORT, ETCD_PORT, ETCD_PEER_PORT = 6650, 2379, 2380
#: The broker's metrics port (metrics.listen), free before a broker starts too.
METRICS_PORT = 9650
KINDS = ("server", "while make dev runs", "after make dev stopped")
#: A ``python`` block run as one script with the clone's ``.venv/bin/python`` while make dev
#: runs (after the bash blocks before it).
PYTHON_KIND = "python while make dev runs"
#: The sections whose blocks are run, in order.
SECTIONS = ("Running it", "Analytics")


def readme_blocks() -> list[tuple[str, list[str]]]:
    """(kind, commands) of every bash block in "Running it" and "Analytics", in order; a
    command's ``\\`` continuation lines are joined to it. A python block is one command: its
    whole text."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for title in SECTIONS:
        start = text.index(f"\n## {title}\n")
        end = text.index("\n## ", start + 1)
        section = text[start:end]
        for match in re.finditer(
            r"(?:<!-- readme-test: ([^>]*?) -->\n)?```(bash|python)\n(.*?)```", section, re.S
        ):
            kind, language, body = match.group(1), match.group(2), match.group(3)
            if language == "python":
                assert kind == PYTHON_KIND, f"a python block in {title!r} is not runnable: {body!r}"
                blocks.append((kind, [body]))
                continue
            assert kind in KINDS, f"a bash block in {title!r} has no readme-test kind: {body!r}"
            blocks.append((kind, body.replace("\\\n", "").strip().splitlines()))
    return blocks


def _free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for_default_ports(*ports: int) -> None:
    """Until ``ports`` (default: all the README's) are free."""
    deadline = time.monotonic() + SERVER_TIMEOUT
    ports = ports or (BROKER_PORT, ETCD_PORT, ETCD_PEER_PORT, METRICS_PORT)
    while not all(_free(port) for port in ports):
        busy = [port for port in ports if not _free(port)]
        assert time.monotonic() < deadline, (
            f"ports {busy} stayed busy for {SERVER_TIMEOUT}s: the README's commands need them "
            "(stop what runs there, e.g. a `make dev`)"
        )
        time.sleep(0.5)


def _serving(port: int, grpc_ready: bool) -> bool:
    if grpc_ready:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
            except grpc.FutureTimeoutError:
                return False
            return True
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Server:
    """A long-running command in a process group of its own, as a terminal job."""

    def __init__(self, argv: list[str] | str, cwd: Path, log: Path) -> None:
        self.what = argv if isinstance(argv, str) else " ".join(argv)
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv,
                shell=isinstance(argv, str),
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_serving(self, port: int, *, grpc_ready: bool) -> None:
        """Until the port answers and the command itself said it serves (so another process
        on the port is never taken for it)."""
        deadline = time.monotonic() + SERVER_TIMEOUT
        while "serving on" not in self.output() or not _serving(port, grpc_ready):
            assert self.process.poll() is None, f"{self.what} exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"{self.what} not serving:\n{self.output()}"
            time.sleep(0.2)

    def stop(self) -> int:
        """Ctrl-C; the exit code (the group is killed if it does not stop in time)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(SERVER_TIMEOUT)
        except subprocess.TimeoutExpired:
            # Where it is stuck: the daemon writes every thread's stack on SIGUSR1.
            os.killpg(self.process.pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"{self.what} did not stop on SIGINT:\n{self.output()}") from None


def run_command(
    command: str, cwd: Path, *, python: bool = False, outputs: dict[str, str] | None = None
) -> float:
    """Run one README line verbatim (or a python block with the clone's ``.venv/bin/python``);
    its duration in seconds (fails unless exit 0 in time). Its stdout goes to ``outputs``."""
    started = time.monotonic()
    argv = [str(cwd / ".venv" / "bin" / "python"), "-c", command] if python else []
    try:
        result = subprocess.run(
            argv or ["bash", "-c", command],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{command!r} did not finish in {COMMAND_TIMEOUT}s") from exc
    assert result.returncode == 0, f"{command!r} exit {result.returncode}:\n{result.stderr}"
    if outputs is not None:
        outputs[command] = result.stdout
    return time.monotonic() - started


def _scratch_clone(tmp_path: Path) -> Path:
    """A directory like a fresh clone after ``make dev`` created ``.venv``: the commands use
    ``.venv/bin/...`` and ``config/``, and write ``./data``."""
    clone = tmp_path / "clone"
    clone.mkdir()
    venv = ROOT / ".venv"
    (clone / ".venv").symlink_to(venv if venv.exists() else Path(sys.prefix))
    shutil.copytree(ROOT / "config", clone / "config")
    return clone


def test_readme_blocks_are_all_classified() -> None:
    blocks = readme_blocks()
    kinds = [kind for kind, _ in blocks]
    assert kinds[0] == "server" and blocks[0][1] == ["make dev"], blocks[0]
    assert "while make dev runs" in kinds and "after make dev stopped" in kinds
    commands = [c for kind, lines in blocks if kind != "server" for c in lines]
    produce = next(i for i, c in enumerate(commands) if " produce " in c and "--count 1000" in c)
    consume = next(i for i, c in enumerate(commands) if " consume " in c and "--count 1000" in c)
    assert produce < consume, commands


def test_running_it_commands_finish(tmp_path: Path) -> None:
    blocks = readme_blocks()
    clone = _scratch_clone(tmp_path)
    _wait_for_default_ports()
    durations: dict[str, float] = {}
    outputs: dict[str, str] = {}
    dev_block, *rest = blocks
    assert dev_block == ("server", ["make dev"])
    # What `make dev` runs (see the Makefile), without the Dagster UI.
    dev = Server(
        [str(clone / ".venv" / "bin" / "danube-ingest"), "dev", "--no-dagster"],
        clone,
        tmp_path / "dev.log",
    )
    try:
        dev.wait_serving(BROKER_PORT, grpc_ready=True)
        for kind, commands in rest:
            if kind in ("while make dev runs", PYTHON_KIND):
                assert dev.process.poll() is None, dev.output()
                for command in commands:
                    python = kind == PYTHON_KIND
                    durations[command] = run_command(command, clone, python=python, outputs=outputs)
    finally:
        code = dev.stop()
    assert code == 0, dev.output()
    # The Analytics examples count the 100 messages it produced, all committed: through
    # read_topic, then by name from the Iceberg catalog.
    scripts = [c for kind, lines in rest if kind == PYTHON_KIND for c in lines]
    assert len(scripts) == 2 and "catalog_session" in scripts[1], scripts
    for script in scripts:
        assert re.search(r"\|\s*100\|\s*99\|", outputs[script]), outputs[script]

    for kind, commands in rest:
        if kind == "after make dev stopped":
            for command in commands:
                durations[command] = run_command(command, clone)

    servers: list[Server] = []
    try:
        for kind, commands in rest:
            if kind != "server":
                continue
            for n, command in enumerate(commands):
                words = command.split()
                assert words[0] == ".venv/bin/danube-ingest", command
                if words[1] == "broker":
                    # One broker at a time on the default port: stop the previous one first.
                    for server in [s for s in servers if " broker " in s.what]:
                        assert server.stop() == 0, server.output()
                        servers.remove(server)
                    port, grpc_ready = BROKER_PORT, True
                else:
                    assert words[1] == "etcd", f"no stand-in known for {command!r}"
                    port, grpc_ready = ETCD_PORT, False
                _wait_for_default_ports(port, *([METRICS_PORT] if port == BROKER_PORT else []))
                server = Server(f"exec {command}", clone, tmp_path / f"server{n}.log")
                servers.append(server)
                server.wait_serving(port, grpc_ready=grpc_ready)
        for server in reversed(servers):
            assert server.stop() == 0, server.output()
    finally:
        for server in reversed(servers):
            server.stop()
    print({command: round(seconds, 2) for command, seconds in durations.items()})


def test_readme_and_docs_link_only_files_of_the_project() -> None:
    """Relative links in the README and docs/ name files in this repository (a clone has
    nothing outside it), and the README links the architecture page."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (page.name, target)
        assert "../shared" not in text, page.name
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()
