"""Regenerate docs/configuration.md from the config models' field descriptions.

Run: .venv/bin/python tools/gen_config_doc.py   (tests/test_config_doc.py checks it is current)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from danube_ingest.config import BrokerConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

HEADER = """# Configuration reference

One YAML file (`danube-ingest broker --config FILE`); every key is optional. String values may
use `${VAR}` or `${VAR:-default}`. Sizes accept `64KiB`, `8MiB`, `1GiB` (or `MB`, powers of
1000) or plain bytes; durations in `_ms`/`_seconds`/`_minutes` keys accept a number in that unit
or a string such as `500ms`, `10s`, `5m`. Unknown keys and invalid values are rejected with a
`ConfigError` naming the dotted key. A complete example with every default:
[`config/danube_broker.yml`](../config/danube_broker.yml).

This page is generated from the models in `danube_ingest/config/models.py` by
`tools/gen_config_doc.py`.

| key | default | meaning |
| --- | --- | --- |
"""


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_rows(annotation, f"{prefix}{name}."))
            continue
        default = info.get_default(call_default_factory=True)
        shown = "null" if default is None else str(default)
        text = " ".join((info.description or "").split()).replace("|", "\\|")
        rows.append((f"{prefix}{name}", shown, text))
    return rows


def render() -> str:
    lines = [HEADER.rstrip("\n")]
    for key, default, text in _rows(BrokerConfig):
        lines.append(f"| `{key}` | `{default}` | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
