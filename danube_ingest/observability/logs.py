"""Log formats of the daemon: ``text`` (the default) and ``json`` (``--log-format json``).

Log lines are written as ``message key=value key=value`` (topic, offset, object key, epoch...).
The JSON format writes one object per line with ``ts`` (ISO 8601, UTC, milliseconds),
``level``, ``logger``, ``msg`` (the whole message) and each ``key=value`` pair of the message as
a field of its own, so that a log pipeline can filter on ``topic`` or ``key`` without parsing
text. A field never overwrites the fixed ones; values stay strings, as written. An exception's
traceback goes to ``exc``.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]

#: The text format (what ``danube-ingest`` has always written).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

#: ``key=value`` in a message: a value runs to the next space (or is a quoted string).
_PAIR = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)")
_FIXED = frozenset({"ts", "level", "logger", "msg", "exc"})


def fields(message: str) -> dict[str, str]:
    """The ``key=value`` pairs of a log message (a quoted value without its quotes)."""
    found: dict[str, str] = {}
    for key, value in _PAIR.findall(message):
        if key not in _FIXED and key not in found:
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            found[key] = value
    return found


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        when = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, str] = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": message,
        }
        line.update(fields(message))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def formatter(kind: LogFormat) -> logging.Formatter:
    """The formatter of log format ``kind``."""
    return JsonFormatter() if kind == "json" else logging.Formatter(TEXT_FORMAT)
