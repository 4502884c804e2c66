"""Topic names: ``/namespace/topic``, exactly two levels of letters, digits, ``_`` and ``-``.

Partitions of a partitioned topic are ordinary topics named ``/namespace/topic-part-{i}``.
"""

from __future__ import annotations

import re

from danube_ingest.broker.validation import shown
from danube_ingest.errors import DanubeIngestError

_TOPIC_RE = re.compile(r"^/([A-Za-z0-9_-]+)/([A-Za-z0-9_-]+)$")
_PARTITION_RE = re.compile(r"^(?P<base>/[A-Za-z0-9_-]+/[A-Za-z0-9_-]+)-part-(?P<index>\d+)$")
#: Longest accepted topic name in bytes (keeps etcd keys and object keys reasonable).
MAX_TOPIC_NAME = 255
DEFAULT_NAMESPACE = "default"


class InvalidTopicNameError(DanubeIngestError, ValueError):
    """A topic name that is not ``/namespace/topic``."""


def parse_topic(name: str) -> tuple[str, str]:
    """Split ``/ns/topic`` into (ns, topic); raise InvalidTopicNameError otherwise.

    A valid name is ASCII, so at most ``MAX_TOPIC_NAME`` bytes; the error echoes at most the
    first 64 characters of an invalid one.
    """
    match = None if len(name) > MAX_TOPIC_NAME else _TOPIC_RE.match(name)
    if match is None:
        raise InvalidTopicNameError(
            f"invalid topic name {shown(name)}: expected /namespace/topic, each part of "
            f"letters, digits, '_' or '-', at most {MAX_TOPIC_NAME} characters in all"
        )
    return match.group(1), match.group(2)


def partition_name(topic: str, index: int) -> str:
    return f"{topic}-part-{index}"


def partition_base(name: str) -> tuple[str, int] | None:
    """(base topic, index) when ``name`` is a partition name, else None."""
    match = _PARTITION_RE.match(name)
    if match is None:
        return None
    return match.group("base"), int(match.group("index"))
