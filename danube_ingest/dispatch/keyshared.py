"""Key-shared routing: a consistent hash ring over consumer ids, with glob key filters.

A message's key is its routing key, else its producer's name (Danube's rule). Every consumer
owns ``VIRTUAL_NODES`` points on a 64-bit ring; a key goes to the owner of the first point at or
after the key's hash (wrapping) whose consumer's filters accept the key. Hence:

* the mapping depends only on the set of (consumer id, filters), not on attach order, and is the
  same in every process (BLAKE2b, not Python's salted ``hash``);
* when a consumer joins it takes only keys it accepts, from their previous owners, and about
  ``1/n`` of them; when it leaves, only its own keys move;
* a consumer whose filters reject a key never gets it. Filters are ``fnmatch`` globs matched
  case-sensitively (``*``, ``?``, ``[seq]``, ``[!seq]``); a consumer without filters accepts
  every key.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import re
from collections.abc import Iterable

from danube_ingest.wal.framing import Entry

#: Points per consumer. With 100 points the busiest of 10 consumers gets about 1.3x its fair
#: share of keys; more points smooth that further but make membership changes slower.
VIRTUAL_NODES = 100


def routing_key_of(entry: Entry) -> str:
    """The key a key-shared subscription routes ``entry`` by."""
    return entry.routing_key or entry.producer_name


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class KeyFilter:
    """The keys a consumer accepts: any of some globs, or every key when there are none."""

    __slots__ = ("_regex", "patterns")

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.patterns: tuple[str, ...] = tuple(patterns)
        self._regex = (
            re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in self.patterns))
            if self.patterns
            else None
        )

    @property
    def accepts_all(self) -> bool:
        return self._regex is None

    def matches(self, key: str) -> bool:
        return self._regex is None or self._regex.match(key) is not None

    def __repr__(self) -> str:
        return f"KeyFilter({list(self.patterns)!r})"


class HashRing:
    """Consistent hashing of keys onto consumer ids (see the module docs)."""

    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self._virtual_nodes = virtual_nodes
        self._filters: dict[int, KeyFilter] = {}
        self._points: list[int] = []
        self._owners: list[int] = []

    def __len__(self) -> int:
        return len(self._filters)

    def __contains__(self, consumer_id: object) -> bool:
        return consumer_id in self._filters

    def add(self, consumer_id: int, key_filter: KeyFilter | None = None) -> None:
        """Add (or replace the filters of) a consumer."""
        self._filters[consumer_id] = key_filter or KeyFilter()
        self._rebuild()

    def remove(self, consumer_id: int) -> None:
        """Remove a consumer; a no-op when it is not on the ring."""
        if self._filters.pop(consumer_id, None) is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        points = sorted(
            (_hash(f"{consumer_id}#{i}"), consumer_id)
            for consumer_id in self._filters
            for i in range(self._virtual_nodes)
        )
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def lookup(self, key: str) -> int | None:
        """The consumer id that owns ``key``, or ``None`` when no consumer accepts it."""
        points = self._points
        if not points:
            return None
        start = bisect.bisect_left(points, _hash(key))
        owners = self._owners
        filters = self._filters
        rejected: set[int] = set()
        n = len(points)
        for i in range(n):
            owner = owners[(start + i) % n]
            if owner in rejected:
                continue
            if filters[owner].matches(key):
                return owner
            rejected.add(owner)
            if len(rejected) == len(filters):
                break
        return None
