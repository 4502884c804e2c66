"""Where a table's partitions live: partition bounds, final and staging paths, parsing them back.

A table cuts a topic's ingest time into partitions of ``width_s`` seconds: 3600 (an hour, the
default) or a divisor of 3600 of at least 60 (a minute), so partitions never straddle an hour.
A partition is named by its start ``start_ms`` (ms since the epoch, UTC, a multiple of
``width_s * 1000``) and holds the entries with ingest time in ``[start_ms, start_ms + width)``.

Paths, below a warehouse ``root`` (``"warehouse/"`` by default; empty or ending with ``/``) of an
``ObjectStore``::

    {root}{rendition}/namespace={ns}/topic={topic}/date={YYYY-MM-DD}/hour={HH}/[minute={MM}/]
        part-{first:020}-{last:020}.parquet                       final file
    {root}_staging/{token}/{rendition}/namespace=...              the same tail, staged by a run

``minute=`` appears only in tables narrower than an hour. ``first``/``last`` are the inclusive
offset range of the file's rows, so a rerun writes the same names; an empty partition has no
file. Spark's partition discovery skips directories starting with ``_``, so a plain
``spark.read.parquet`` of a topic's directory (``topic_prefix``) never sees staged files, and
prunes on ``date``/``hour``. Namespace and topic values are escaped the way Hive and Spark
escape partition values (``%XX`` for ``=``, ``%``, ``:``, ...), so Spark reads back the exact
names. Renditions are ``r1``, ``r2``, ..., numbered per table: a rendition directory holds the
topics whose table has that number, not every topic, and the root mixes renditions, so only a
topic's directory in its table's active rendition (``danube-ingest tables path``) is one
topic's whole table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from danube_ingest.analytics.errors import InvalidLayoutError
from danube_ingest.metadata.keys import split_topic

__all__ = [
    "DEFAULT_ROOT",
    "DEFAULT_WIDTH_S",
    "PartitionPath",
    "check_root",
    "check_width",
    "dead_letters_of",
    "file_name",
    "final_of_staging",
    "final_path",
    "parse_path",
    "parse_rendition",
    "partition_dir",
    "partition_end",
    "partition_start",
    "rendition_name",
    "rendition_prefix",
    "staging_path",
    "staging_prefix",
    "topic_prefix",
]

DEFAULT_WIDTH_S = 3600
"""An hour: the partition width of a table unless it says otherwise."""
DEFAULT_ROOT = "warehouse/"
"""The warehouse prefix in the object store unless configured otherwise."""
STAGING_DIR = "_staging"
"""Below the root: where runs stage their files (``_``: ignored by Spark's discovery)."""
DEAD_LETTERS_DIR = "_dead_letters"
"""Below the root: the dead-letter files of renditions that keep rows which do not decode
apart (``dead_letters``), in the same layout as the table's own files."""

#: Characters Hive/Spark escape in partition directory values (ExternalCatalogUtils), plus
#: controls: escaping them the same way makes Spark's discovery return the names unchanged.
_ESCAPED = frozenset("\"#%'*/:=?\\{[]^") | frozenset(chr(c) for c in (*range(0x20), 0x7F))
_RENDITION = re.compile(r"r([1-9][0-9]{0,8})")
_PATH = re.compile(
    r"(?:_staging/(?P<token>[^/]+)/)?(?P<dead>_dead_letters/)?(?P<rendition>r[1-9][0-9]*)/"
    r"namespace=(?P<ns>[^/]+)/topic=(?P<topic>[^/]+)/"
    r"date=(?P<date>\d{4}-\d{2}-\d{2})/hour=(?P<hour>\d{2})/(?:minute=(?P<minute>\d{2})/)?"
    r"part-(?P<first>\d{20})-(?P<last>\d{20})\.parquet"
)


def check_width(width_s: int) -> int:
    """``width_s`` if it is a valid partition width, else ``InvalidLayoutError``."""
    if (
        not isinstance(width_s, int)
        or isinstance(width_s, bool)
        or width_s < 60
        or 3600 % width_s != 0
    ):
        raise InvalidLayoutError(
            f"invalid partition width {width_s!r} s: use 3600 (an hour) or a divisor of 3600 "
            "of at least 60 (e.g. 60, 300, 600, 900, 1800)"
        )
    return width_s


def check_root(root: str) -> str:
    """``root`` if it can prefix warehouse keys (empty, or relative and ending with ``/``)."""
    if root and (root.startswith("/") or not root.endswith("/")):
        raise InvalidLayoutError(
            f"invalid warehouse root {root!r}: use '' or a relative prefix ending with '/'"
        )
    return root


def partition_start(ingest_ms: int, width_s: int) -> int:
    """Start of the partition holding ingest time ``ingest_ms``."""
    width_ms = check_width(width_s) * 1000
    return ingest_ms - ingest_ms % width_ms


def partition_end(start_ms: int, width_s: int) -> int:
    """End (exclusive) of the partition starting at ``start_ms``; ``InvalidLayoutError`` if
    ``start_ms`` is not a partition start."""
    width_ms = check_width(width_s) * 1000
    if start_ms < 0 or start_ms % width_ms:
        raise InvalidLayoutError(
            f"{start_ms} is not the start of a {width_s} s partition: "
            f"use a non-negative multiple of {width_ms} ms"
        )
    return start_ms + width_ms


def rendition_name(number: int) -> str:
    """``r{number}`` for ``number`` >= 1."""
    name = f"r{number}"
    parse_rendition(name)
    return name


def parse_rendition(name: str) -> int:
    """The number of rendition ``name`` (``"r3"`` → 3); ``InvalidLayoutError`` otherwise."""
    match = _RENDITION.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise InvalidLayoutError(f"invalid rendition name {name!r}: expected r1, r2, ...")
    return int(match.group(1))


def _escape(value: str) -> str:
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in value)


def _unescape(value: str) -> str:
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), value)


def _topic_dir(rendition: str, topic: str) -> str:
    parse_rendition(rendition)
    return f"{rendition}/{topic_subdir(topic)}"


def topic_subdir(topic: str) -> str:
    """``namespace=.../topic=.../``: the topic's part of every path of its files."""
    ns, name = split_topic(topic)
    return f"namespace={_escape(ns)}/topic={_escape(name)}/"


def topic_prefix(root: str, rendition: str, topic: str) -> str:
    """Every final file of ``topic`` in ``rendition`` starts with this."""
    return f"{check_root(root)}{_topic_dir(rendition, topic)}"


def partition_dir(rendition: str, topic: str, start_ms: int, width_s: int) -> str:
    """The partition's directory below the root, ending with ``/``:
    ``{rendition}/namespace=/topic=/date=/hour=/[minute=/]``."""
    partition_end(start_ms, width_s)
    at = datetime.fromtimestamp(start_ms / 1000, tz=UTC)
    tail = f"date={at:%Y-%m-%d}/hour={at:%H}/"
    if width_s < 3600:
        tail += f"minute={at:%M}/"
    return f"{_topic_dir(rendition, topic)}{tail}"


def file_name(first: int, last: int) -> str:
    """``part-{first:020}-{last:020}.parquet``: the file of rows with offsets first..last."""
    if not 0 <= first <= last:
        raise InvalidLayoutError(f"invalid offset range {first}..{last} for a Parquet file")
    return f"part-{first:020d}-{last:020d}.parquet"


def dead_letters_of(root: str, final: str) -> str:
    """Where the dead letters of the table's file or directory ``final`` (below ``root``)
    go: the same path below ``{root}_dead_letters/``."""
    root = check_root(root)
    if not final.startswith(root):
        raise InvalidLayoutError(f"{final!r} is not below the warehouse root {root!r}")
    return f"{root}{DEAD_LETTERS_DIR}/{final[len(root) :]}"


def rendition_prefix(root: str, rendition: str) -> str:
    """Every final file of ``rendition`` starts with this."""
    parse_rendition(rendition)
    return f"{check_root(root)}{rendition}/"


def staging_prefix(root: str, token: str | None = None) -> str:
    """The staging area of the warehouse, or of one run (``token``)."""
    base = f"{check_root(root)}{STAGING_DIR}/"
    if token is None:
        return base
    if not token or "/" in token:
        raise InvalidLayoutError(f"invalid run token {token!r}")
    return f"{base}{token}/"


def final_path(
    root: str, rendition: str, topic: str, start_ms: int, width_s: int, first: int, last: int
) -> str:
    """The published key of a partition's file holding offsets ``first..last``."""
    directory = partition_dir(rendition, topic, start_ms, width_s)
    return f"{check_root(root)}{directory}{file_name(first, last)}"


def staging_path(root: str, token: str, final: str) -> str:
    """Where run ``token`` stages the file to be published at ``final`` (a ``final_path``)."""
    root = check_root(root)
    if not final.startswith(root):
        raise InvalidLayoutError(f"{final!r} is not below the warehouse root {root!r}")
    return f"{staging_prefix(root, token)}{final[len(root) :]}"


def final_of_staging(root: str, staged: str) -> str:
    """The final key of a staged file (the inverse of ``staging_path``)."""
    parsed = parse_path(root, staged)
    if parsed.token is None:
        raise InvalidLayoutError(f"{staged!r} is not a staged file")
    return f"{root}{staged[len(staging_prefix(root, parsed.token)) :]}"


@dataclass(frozen=True, slots=True)
class PartitionPath:
    """What a warehouse file's key says."""

    rendition: str
    topic: str
    """``/ns/topic``."""
    start_ms: int
    """Start of the hour, or of the minute for ``minute=`` directories."""
    minute: bool
    """Whether the path has a ``minute=`` level (a table narrower than an hour)."""
    first_offset: int
    last_offset: int
    token: str | None
    """The staging run's token, ``None`` for a final file."""
    dead_letters: bool = False
    """A dead-letter file (below ``_dead_letters/``)."""


def parse_path(root: str, path: str) -> PartitionPath:
    """Parse a final or staged file key; ``InvalidLayoutError`` naming it if it is neither."""
    root = check_root(root)
    match = _PATH.fullmatch(path[len(root) :]) if path.startswith(root) else None
    if match is None:
        raise InvalidLayoutError(
            f"{path!r} is not a warehouse file below {root!r} "
            "({rendition}/namespace=/topic=/date=/hour=/[minute=/]part-{first}-{last}.parquet)"
        )
    try:
        at = datetime.strptime(
            f"{match['date']} {match['hour']}:{match['minute'] or '00'}", "%Y-%m-%d %H:%M"
        ).replace(tzinfo=UTC)
    except ValueError as exc:
        raise InvalidLayoutError(f"{path!r}: invalid date or time: {exc}") from exc
    first, last = int(match["first"]), int(match["last"])
    if first > last:
        raise InvalidLayoutError(f"{path!r}: first offset {first} is after the last {last}")
    topic = f"/{_unescape(match['ns'])}/{_unescape(match['topic'])}"
    split_topic(topic)
    return PartitionPath(
        rendition=match["rendition"],
        topic=topic,
        start_ms=int(at.timestamp()) * 1000,
        minute=match["minute"] is not None,
        first_offset=first,
        last_offset=last,
        token=match["token"],
        dead_letters=match["dead"] is not None,
    )
