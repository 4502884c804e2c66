"""docs/configuration.md documents every configuration key and is current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_config_doc", ROOT / "tools/gen_config_doc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = (ROOT / "docs/configuration.md").read_text()
    assert current == module.render(), "run: .venv/bin/python tools/gen_config_doc.py"
