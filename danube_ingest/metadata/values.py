"""Parsing the JSON values that metadata records are stored as.

Every record decoder reads a stored value through :func:`loads`, so whatever bytes a key holds
(written by another version, by an operator with ``etcdctl``, or damaged), a decoder sees
either a plain JSON value or a ``ValueError`` it turns into ``MetadataError`` naming the key.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a value a record holds")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def loads(data: bytes | str) -> Any:
    """The JSON value ``data`` holds.

    Raises ``ValueError`` for anything else, including what ``json.loads`` lets through or
    raises otherwise: ``NaN`` and ``Infinity`` (and numbers that overflow to them), which no
    record stores and which ``int()`` refuses with ``OverflowError``; nesting deeper than the
    interpreter's recursion limit (``RecursionError``).
    """
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
