"""What ``produce`` reads and ``consume`` prints: input lines, attributes, output formats.

``produce --stdin`` sends one message per input line (the newline removed); with
``--key-separator SEP`` each line is ``KEY SEP PAYLOAD`` (split at the first ``SEP``), as
``kcat -K`` reads it (an empty KEY: no key). ``--attribute K=V`` adds attributes to every message.

``consume --output`` prints each message as ``text`` (``topic@offset [producer] payload``, the
default), ``json`` (one JSON object per line: the fields of :data:`FIELDS`) or ``raw`` (the
payload bytes and a newline); ``--print TEMPLATE`` formats the same fields with Python's
``str.format`` (``'{offset} {key} {payload}'``), one line per message.
"""

from __future__ import annotations

import argparse
import base64
import json
import string
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from danube_ingest.errors import DanubeIngestError

OUTPUTS = ("text", "json", "raw")

#: The fields ``--print`` templates and ``--output json`` name, and what each holds.
FIELDS = {
    "topic": "the topic (a partition's own name for a partitioned topic)",
    "offset": "the message's offset",
    "key": "its routing key ('' when none; null in JSON)",
    "payload": "the payload as UTF-8 text (undecodable bytes replaced; JSON: base64 then, "
    "with payload_encoding 'base64')",
    "attributes": "its attributes as a JSON object",
    "publish_time": "the producer's time, ISO 8601 UTC",
    "ingest_time": "when the broker stored it, ISO 8601 UTC ('' / null with --client danube, "
    "which does not carry it)",
    "producer": "the producer's name",
    "schema_id": "the schema id it carries ('' / null when none)",
    "schema_version": "the schema version it carries ('' / null when none)",
}


class BadInputError(DanubeIngestError):
    """Input the command refuses before sending anything (exit 2): a malformed line,
    attribute or template. The message names the input and what to change."""


@dataclass(frozen=True, slots=True)
class Message:
    """One received message, whichever client received it."""

    topic: str
    offset: int
    payload: bytes
    producer: str
    key: str | None = None
    attributes: dict[str, str] | None = None
    publish_ms: int = 0
    ingest_ms: int | None = None
    schema_id: int | None = None
    schema_version: int | None = None


# -- produce ----------------------------------------------------------------------------------


def attribute(text: str) -> tuple[str, str]:
    """``K=V`` as ``(K, V)``; an ``argparse`` error for anything else (so nothing is sent)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"attribute {text!r}: expected NAME=VALUE")
    return name, value


@dataclass(frozen=True, slots=True)
class Record:
    """One message to send: payload, routing key, attributes."""

    payload: bytes
    key: str | None
    attributes: dict[str, str]


def read_records(
    data: bytes,
    *,
    key_separator: str | None,
    key: str | None,
    attributes: dict[str, str],
    limit: int = 0,
) -> list[Record]:
    """The messages of ``data`` (one per line, the final newline optional), at most ``limit``
    (0: all). Every line is checked before any is returned: a line without ``key_separator``
    raises :class:`BadInputError` naming its number, so a bad input sends nothing."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if limit:
        lines = lines[:limit]
    records = []
    separator = None if key_separator is None else key_separator.encode()
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix(b"\r")
        line_key = key
        if separator is not None:
            raw_key, found, payload = line.partition(separator)
            if not found:
                raise BadInputError(
                    f"stdin line {number}: no key separator {key_separator!r} in "
                    f"{line[:60]!r}; each line must be KEY{key_separator}PAYLOAD "
                    "(nothing was sent)"
                )
            line_key = raw_key.decode("utf-8", "replace") or None
            line = payload
        records.append(Record(line, line_key, dict(attributes)))
    return records


# -- consume ----------------------------------------------------------------------------------


def check_template(template: str) -> str:
    """``template`` if it names only :data:`FIELDS`; an ``argparse`` error otherwise."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--print {template!r}: {exc}") from None
    for name in names:
        if name not in FIELDS:
            raise argparse.ArgumentTypeError(
                f"--print {template!r}: unknown field {{{name}}}; fields: "
                + ", ".join(f"{{{f}}}" for f in FIELDS)
            )
    return template.replace("\\n", "\n").replace("\\t", "\t")


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def render(message: Message, output: str, template: str | None) -> bytes:
    """The bytes ``consume`` writes for ``message``: the ``template`` line if given, else
    the ``output`` format's; always ending in a newline."""
    if template is not None:
        fields: dict[str, Any] = {
            name: "" if value is None else value for name, value in _fields(message).items()
        }
        fields["attributes"] = json.dumps(message.attributes or {}, sort_keys=True)
        return (template.format_map(fields) + "\n").encode()
    if output == "raw":
        return message.payload + b"\n"
    if output == "json":
        document = _fields(message)
        document["attributes"] = message.attributes or {}
        try:
            document["payload"] = message.payload.decode("utf-8")
        except UnicodeDecodeError:
            document["payload"] = base64.b64encode(message.payload).decode()
            document["payload_encoding"] = "base64"
        return (json.dumps(document, ensure_ascii=False) + "\n").encode()
    text = message.payload.decode("utf-8", "replace")
    return f"{message.topic}@{message.offset} [{message.producer}] {text}\n".encode()


def _fields(message: Message) -> dict[str, Any]:
    return {
        "topic": message.topic,
        "offset": message.offset,
        "key": message.key or None,
        "payload": message.payload.decode("utf-8", "replace"),
        "attributes": message.attributes or {},
        "publish_time": _iso(message.publish_ms),
        "ingest_time": _iso(message.ingest_ms),
        "producer": message.producer,
        "schema_id": message.schema_id,
        "schema_version": message.schema_version or None,
    }
