"""The README's claims about test markers are true: every marker it names is registered in
pyproject.toml (and every registered one is named), and ``dagster`` and ``spark`` select
tests."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _registered() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = config["tool"]["pytest"]["ini_options"]["markers"]
    return {line.split(":", 1)[0].strip() for line in lines}


def _readme_markers() -> set[str]:
    """The backquoted names in the README's sentence that starts with "Markers"."""
    text = (ROOT / "README.md").read_text()
    tests = text[text.index("\n## Tests") :]
    claim = tests[tests.index("Markers") : tests.index("CI (")]
    return {name for name in re.findall(r"`([^`]+)`", claim) if "." not in name}


def _selected(marker: str) -> int:
    """How many tests ``pytest --collect-only -m MARKER`` selects."""
    argv = ["pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker]
    result = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode == 5:  # no tests selected
        return 0
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return sum(1 for line in result.stdout.splitlines() if "::" in line)


def test_readme_names_exactly_the_registered_markers() -> None:
    assert _readme_markers() == _registered()


@pytest.mark.slow
def test_dagster_and_spark_select_tests() -> None:
    assert _selected("dagster") >= 1
    assert _selected("spark") >= 1
