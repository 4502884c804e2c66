"""Running ``danube-ingest`` as a child process against a test broker, and the README's
commands as written against it.

``run_cli`` runs one command with optional stdin. ``fake_clone`` makes a directory like a
fresh clone after ``make dev`` (``config/``, ``.venv/bin/danube-ingest``) whose
``danube-ingest`` adds the test broker's address (``--service-url``) or its etcd endpoint and
prefix (``--etcd``, ``--prefix``) to each command, so README lines written for the default
ports run unchanged on free ones (``run_readme_line``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Seconds one command may take.
CLI_TIMEOUT = 60.0

#: Commands that talk to a broker; the other commands the wrapper knows read etcd.
_BROKER_COMMANDS = {"produce", "consume", "bench"}
_ETCD_COMMANDS = {"topics", "subscriptions", "status", "retention", "schemas"}

_WRAPPER = """#!{python}
import sys
from danube_ingest.cli import main

argv = sys.argv[1:]
command = argv[0] if argv else ""
action = argv[1] if len(argv) > 1 else ""
if command in {broker!r} or (command == "schemas" and action != "list"):
    argv += ["--service-url", {url!r}]
elif command in {etcd!r}:
    argv += ["--etcd", {endpoint!r}, "--prefix", {prefix!r}]
sys.exit(main(argv))
"""


async def run_cli(
    *argv: str, stdin: bytes | None = None, cwd: Path | None = None
) -> tuple[int, str, str]:
    """Run ``danube-ingest ARGV`` (``stdin`` fed to it, else empty); return (exit code,
    stdout, stderr). Fails if it runs past ``CLI_TIMEOUT``."""
    return await _run([sys.executable, "-m", "danube_ingest.cli", *argv], stdin, cwd)


async def _run(argv: list[str], stdin: bytes | None, cwd: Path | None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        async with asyncio.timeout(CLI_TIMEOUT):
            out, err = await process.communicate(stdin or b"")
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
        raise AssertionError(f"{argv} did not finish in {CLI_TIMEOUT}s: {err.decode()}") from None
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def fake_clone(path: Path, *, url: str, etcd: str, prefix: str) -> Path:
    """A clone-like directory at ``path`` whose ``.venv/bin/danube-ingest`` reaches the test
    broker at ``url`` and etcd at ``etcd`` under ``prefix``."""
    shutil.copytree(ROOT / "config", path / "config")
    script = path / ".venv" / "bin" / "danube-ingest"
    script.parent.mkdir(parents=True)
    script.write_text(
        _WRAPPER.format(
            python=sys.executable,
            broker=_BROKER_COMMANDS,
            etcd=_ETCD_COMMANDS,
            url=url,
            endpoint=etcd,
            prefix=prefix,
        )
    )
    script.chmod(0o755)
    return path


async def run_readme_line(line: str, clone: Path) -> tuple[int, str, str]:
    """Run one README command line with ``bash -c`` in ``clone``."""
    return await _run(["bash", "-c", line], None, clone)


def readme_block(marker: str) -> list[str]:
    """The command lines of the README's ``bash`` block that contains ``marker`` (line
    continuations joined, as tests/test_readme.py reads them)."""
    text = (ROOT / "README.md").read_text()
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        if marker in body:
            return [line for line in body.replace("\\\n", "").strip().splitlines() if line]
    raise AssertionError(f"no bash block in README.md contains {marker!r}")


def graphql(url: str, query: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """A Dagster UI's answer (``data``) to ``query`` at ``url``; ``None`` while it is not up."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        f"{url}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with opener.open(request, timeout=timeout) as response:
            data: dict[str, Any] = json.loads(response.read())["data"]
            return data
    except OSError:
        return None
