"""WAL prune marks, and the subscription cursors they are computed from.

``wal/{broker}/{region}/floor/{ns}/{topic}`` = ``{"offset": N, "updated_ms": T}``: every offset
of the topic below ``N`` may be deleted from that broker region's WAL, because it is uploaded,
committed to the manifest and consumed by every subscription, or past retention. The control
plane (Dagster) computes and writes marks; the daemon's cleaner reads them and deletes segments
wholly below every topic's mark (CeresDB's mark + clean split).

A mark only moves forward: ``set_mark`` is a compare-and-swap on the stored value, so a stale
or concurrent run can never move a mark back and expose deleted data as retained.
"""

from __future__ import annotations

import json
import logging

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import InvalidNameError, MetadataError
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV, Compare, Get, Put
from danube_ingest.metadata.records import decode_cursor, now_ms

log = logging.getLogger(__name__)

#: Lost races in a row before ``set_mark`` gives up. Each lost race means another writer moved
#: the mark (forward) in between, so only a swarm of concurrent writers could trip it.
_SET_ATTEMPTS = 16


class PruneMarks:
    """Per broker, region and topic prune marks (see the module docstring)."""

    def __init__(self, kv: KV, keys: Keys) -> None:
        self.kv = kv
        self.keys = keys

    async def marks(self, broker: str, region: str) -> dict[str, int]:
        """Every mark of one broker's WAL region: topic name (``/ns/topic``) → offset.

        One prefix read. A topic without a mark may not be pruned at all.
        """
        head = self.keys.wal_floors_prefix(broker, region)
        found: dict[str, int] = {}
        for stored in await self.kv.get_prefix(head):
            topic = "/" + stored.key[len(head) :]
            try:
                split_topic(topic)
            except InvalidNameError as exc:
                raise MetadataError(f"unexpected key {stored.key} among prune marks") from exc
            found[topic] = _decode_mark(stored.value, stored.key)
        return found

    async def set_mark(self, broker: str, region: str, topic: str, offset: int) -> bool:
        """Raise the topic's mark to ``offset``; a mark already there or beyond stays.

        Returns whether the mark changed. Safe under concurrent writers: the highest wins.
        """
        if offset < 0:
            raise MetadataError(f"invalid prune mark {offset} for {topic}: offsets start at 0")
        key = self.keys.wal_floor(broker, region, topic)
        value = json.dumps({"offset": offset, "updated_ms": now_ms()}).encode()
        seen = await self.kv.get(key)
        for _ in range(_SET_ATTEMPTS):
            if seen is not None and _decode_mark(seen.value, key) >= offset:
                return False
            result = await self.kv.txn(
                [Compare.unchanged(key, seen)], [Put(key, value)], [Get(key)]
            )
            if result.succeeded:
                log.info(
                    "prune mark set broker=%s region=%s topic=%s offset=%s",
                    broker,
                    region,
                    topic,
                    offset,
                )
                return True
            seen = result.kv(0)
        raise MetadataError(
            f"prune mark {key} changed {_SET_ATTEMPTS} times while setting it; try again"
        )

    async def delete_mark(self, broker: str, region: str, topic: str) -> bool:
        """Delete the topic's mark (the topic left the region); returns whether it existed."""
        return await self.kv.delete(self.keys.wal_floor(broker, region, topic)) > 0


async def subscription_cursors(kv: KV, keys: Keys, topic: str) -> dict[str, int | None]:
    """Every subscription of ``topic`` → its cursor, ``None`` while it has none. One read.

    A subscription exists while its record does; a cursor left without a record (a progress
    write racing the subscription's deletion) is ignored, so it cannot hold pruning back.
    """
    head = keys.subscriptions_prefix(topic)
    names: list[str] = []
    cursors: dict[str, int] = {}
    for stored in await kv.get_prefix(head):
        name, slash, rest = stored.key[len(head) :].partition("/")
        if not slash:
            names.append(name)
        elif rest == "cursor":
            cursors[name] = decode_cursor(stored.value, stored.key)
    return {name: cursors.get(name) for name in names}


def _decode_mark(data: bytes, key: str) -> int:
    try:
        offset = int(values.loads(data)["offset"])
    except (ValueError, TypeError, KeyError) as exc:
        raise MetadataError(f"malformed prune mark at {key}: {data!r}") from exc
    if offset < 0:
        raise MetadataError(f"malformed prune mark at {key}: negative offset {offset}")
    return offset
