"""The danube-ingest image for the tests: ``make image``'s script (cached by its inputs, so a
second build of the same tree reuses it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(**env: str) -> str:
    """``tools/image/build.sh`` with ``env`` over ours; its tag."""
    run = subprocess.run(
        ["bash", "tools/image/build.sh"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]
