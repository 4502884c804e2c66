"""WALCache: the most recent durable entries of each topic, in memory, bounded in bytes.

Each topic keeps a contiguous run of its newest entries (a suffix of its log) as the blocks in
which they were committed, so a reader positioned anywhere in that run is served without
touching segment files. Two bounds hold at all times: ``topic_max_bytes`` per topic and
``max_bytes`` over all topics (the least recently appended topics give up their oldest blocks
first). A block's size is the size of the WAL frame its entries were written in, which counts
payloads, header fields and producer names; a block is evicted whole.

Only the newest blocks (``hot_max_bytes`` over all topics, 4 MiB by default) are kept as the
``Entry`` objects they were appended as, which is what live readers at the tail of a topic
read. Older blocks are kept as the bytes of their WAL frame body (``bytes`` objects, which the
garbage collector does not track) and decoded when read. A cache of ``Entry`` objects alone
made every full garbage collection scan each cached message: with the default 256 MiB of
100-byte messages, ~1.9 million objects and ~450 ms with the process stopped, each time a
quarter of the cache had turned over.

A reader that feeds a frame consumer reads with ``stored=True`` and gets
:class:`~danube_ingest.wal.stored.StoredEntries`: slices of the blocks' frame bodies, no
``Entry`` built. A hot block such a reader reads is cooled on the spot (its body parts joined
once), so that it is served as bytes from then on; a block appended without its body (kept
as entries) is read as entries.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from danube_ingest.observability.metrics import CACHE_HITS, CACHE_MISSES
from danube_ingest.wal.block import BlockEntries
from danube_ingest.wal.framing import Entry, decode_messages
from danube_ingest.wal.meta import TopicMeta
from danube_ingest.wal.stored import StoredEntries, entry_bounds

#: Drop evicted list slots in one go once this many have accumulated.
_COMPACT_AFTER = 1024

#: Bytes of the newest blocks, over all topics, kept as ``Entry`` objects (see module docs).
DEFAULT_HOT_MAX_BYTES = 4 * 1024 * 1024

#: A block: its entries (hot) or its MESSAGES frame body (cold).
Block = Sequence[Entry] | bytes


class _TopicCache:
    __slots__ = (
        "blocks",
        "bodies",
        "bounds",
        "firsts",
        "head",
        "nbytes",
        "next_offset",
        "resume",
        "sizes",
    )

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        # The frame body parts of a hot block, to cool it with (None: cold, or none given).
        self.bodies: list[Sequence[bytes] | None] = []
        self.firsts: list[int] = []
        self.sizes: list[int] = []
        self.head = 0
        self.nbytes = 0
        self.next_offset = -1
        # Where the last read of a cold block stopped: (block, entry index, byte position), so
        # that the next read of it (a reader going on from there) does not walk the block from
        # its start again.
        self.resume: tuple[bytes, int, int] | None = None
        # The entry bounds of the cold block last read as stored entries (a reader reads a
        # block in several batches): (block, its entry_bounds).
        self.bounds: tuple[bytes, Any] | None = None

    def entries(self, i: int, skip: int, limit: int, stored: bool = False) -> Sequence[Entry]:
        """Entries ``[skip, skip + limit)`` of block ``i``, decoded if it is cold; with
        ``stored``, as :class:`StoredEntries` when the block has (or is cooled to) its frame
        body."""
        block = self.blocks[i]
        if stored:
            if not isinstance(block, bytes) and self.bodies[i] is not None:
                self.cool_at(i)
                block = self.blocks[i]
            if isinstance(block, bytes):
                memo = self.bounds
                if memo is None or memo[0] is not block:
                    memo = self.bounds = (block, entry_bounds(block))
                return StoredEntries.of_body(block, skip, limit, memo[1])
        if not isinstance(block, bytes):
            return block[skip : skip + limit]
        resume = self.resume
        hint = (resume[1], resume[2]) if resume is not None and resume[0] is block else None
        part = decode_messages(block, skip, limit, resume=hint)[1]
        if part:
            self.resume = (block, skip + len(part), part[-1]._end)
        return part

    def evict_one(self) -> int:
        head = self.head
        size = self.sizes[head]
        if self.resume is not None and self.resume[0] is self.blocks[head]:
            self.resume = None
        if self.bounds is not None and self.bounds[0] is self.blocks[head]:
            self.bounds = None
        self.blocks[head] = ()
        self.bodies[head] = None
        self.head = head + 1
        self.nbytes -= size
        if self.head >= _COMPACT_AFTER and self.head * 2 >= len(self.blocks):
            del self.blocks[: self.head]
            del self.bodies[: self.head]
            del self.firsts[: self.head]
            del self.sizes[: self.head]
            self.head = 0
        return size

    def cool(self, first: int) -> None:
        """Keep the block starting at offset ``first`` (if still cached) as its frame body."""
        i = bisect_right(self.firsts, first, self.head) - 1
        if i < self.head or self.firsts[i] != first:
            return  # evicted, or dropped with the whole run
        self.cool_at(i)

    def cool_at(self, i: int) -> None:
        """Keep block ``i`` as its frame body (if it has one and is still hot)."""
        parts = self.bodies[i]
        if parts is not None:
            self.blocks[i] = b"".join(parts)
            self.bodies[i] = None

    def clear(self) -> None:
        self.resume = None
        self.bounds = None
        self.blocks = []
        self.bodies = []
        self.firsts = []
        self.sizes = []
        self.head = 0
        self.nbytes = 0

    @property
    def nblocks(self) -> int:
        return len(self.blocks) - self.head


class WALCache:
    """Per-topic cache of recent entries. Not thread-safe: used from the event loop."""

    def __init__(
        self, max_bytes: int, topic_max_bytes: int, hot_max_bytes: int = DEFAULT_HOT_MAX_BYTES
    ) -> None:
        if topic_max_bytes > max_bytes:
            raise ValueError("topic_max_bytes must not exceed max_bytes")
        self.max_bytes = max_bytes
        self.topic_max_bytes = topic_max_bytes
        self.hot_max_bytes = hot_max_bytes
        self.nbytes = 0
        self._topics: OrderedDict[TopicMeta, _TopicCache] = OrderedDict()
        # Blocks that can still be cooled, oldest first: (topic cache, first offset, size).
        self._hot: deque[tuple[_TopicCache, int, int]] = deque()
        self.hot_bytes = 0

    def extend(
        self,
        topic: TopicMeta,
        entries: Sequence[Entry],
        nbytes: int,
        body: Sequence[bytes] | None = None,
    ) -> None:
        """Add ``entries`` (consecutive offsets, ``nbytes`` encoded) as ``topic``'s newest.

        ``body``: the parts of the MESSAGES frame body they were written in, so that the block
        can be kept as bytes once it is no longer among the newest ``hot_max_bytes`` (without
        it the block stays as entries).
        """
        cache = self._topics.get(topic)
        if cache is None:
            cache = self._topics[topic] = _TopicCache()
        else:
            self._topics.move_to_end(topic)
        # (A block's first offset without decoding it.)
        first = entries.base_offset if isinstance(entries, BlockEntries) else entries[0].offset
        if cache.next_offset != first:
            self.nbytes -= cache.nbytes
            cache.clear()
        cache.blocks.append(entries)
        cache.bodies.append(body)
        cache.firsts.append(first)
        cache.sizes.append(nbytes)
        cache.next_offset = first + len(entries)
        cache.nbytes += nbytes
        self.nbytes += nbytes
        limit = self.topic_max_bytes
        # A block above a bound on its own is evicted too: readers then use the segment files.
        while cache.nbytes > limit:
            self.nbytes -= cache.evict_one()
        if self.nbytes > self.max_bytes:
            self._evict_global()
        if body is not None:
            hot = self._hot
            hot.append((cache, first, nbytes))
            self.hot_bytes += nbytes
            while self.hot_bytes > self.hot_max_bytes and hot:
                old, old_first, size = hot.popleft()
                self.hot_bytes -= size
                old.cool(old_first)

    def _evict_global(self) -> None:
        # Least recently appended topics first; the topic just extended is the last one.
        for other in list(self._topics.values()):
            while self.nbytes > self.max_bytes and other.nblocks:
                self.nbytes -= other.evict_one()
            if self.nbytes <= self.max_bytes:
                return

    def read(
        self, topic: TopicMeta, offset: int, limit: int, stored: bool = False
    ) -> Sequence[Entry]:
        """Up to ``limit`` cached entries from ``offset`` on; empty if ``offset`` is not cached.

        ``stored``: as :class:`StoredEntries` when every block read has its frame body (see
        module docs), else as a list."""
        cache = self._topics.get(topic)
        if cache is None or cache.nblocks == 0 or offset >= cache.next_offset:
            CACHE_MISSES.inc()
            return []
        firsts = cache.firsts
        i = bisect_right(firsts, offset, cache.head) - 1
        if i < cache.head:
            CACHE_MISSES.inc()
            return []
        CACHE_HITS.inc()
        nblocks = len(cache.blocks)
        if stored:
            parts = [cache.entries(i, offset - firsts[i], limit, True)]
            count = len(parts[0])
            i += 1
            while count < limit and i < nblocks:
                parts.append(cache.entries(i, 0, limit - count, True))
                count += len(parts[-1])
                i += 1
            if all(isinstance(part, StoredEntries) for part in parts):
                return StoredEntries.join(parts)  # type: ignore[arg-type]
            return [entry for part in parts for entry in part]
        out = list(cache.entries(i, offset - firsts[i], limit))
        i += 1
        while len(out) < limit and i < nblocks:
            out.extend(cache.entries(i, 0, limit - len(out)))
            i += 1
        return out

    def first_offset(self, topic: TopicMeta) -> int | None:
        """The oldest cached offset of ``topic``, or None when nothing is cached."""
        cache = self._topics.get(topic)
        if cache is None or cache.nblocks == 0:
            return None
        return cache.firsts[cache.head]

    def drop(self, topic: TopicMeta) -> None:
        cache = self._topics.pop(topic, None)
        if cache is not None:
            self.nbytes -= cache.nbytes
