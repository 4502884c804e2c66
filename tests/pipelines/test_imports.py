"""The code location under test is this checkout's: ``tests/pipelines`` is not a package, so
it cannot shadow the top-level ``pipelines`` package (with an ``__init__.py`` here, pytest put
``tests/`` first on sys.path, ``import pipelines`` found this directory, and the missing
submodules were then found in whichever checkout the venv was installed from)."""

from __future__ import annotations

from pathlib import Path

import assets
import pipelines.definitions
import pipelines.resources

ROOT = Path(__file__).resolve().parents[2]


def test_pipelines_and_assets_come_from_this_checkout() -> None:
    for module in (pipelines, pipelines.definitions, pipelines.resources, assets):
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().is_relative_to(ROOT), module.__file__
