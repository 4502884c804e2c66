"""MemoryBackend: a region's segments in ``bytearray`` objects (``storage.wal.mode: memory``).

It keeps the contract of :mod:`danube_ingest.wal.backend` within one process: chunks are
stored in submit order, each reported durable on the next event loop iteration (one report per
chunk: no group commit, there is no sync to share), sealed segments keep their final size, and
reads return exactly what was reported. Nothing survives the process: ``recover`` returns an
empty region, so a log reopened on a new MemoryBackend starts again at offset 0 (the caller
keeps the RegionLog open to keep its data), and snapshots are not recorded.
"""

from __future__ import annotations

import asyncio

from danube_ingest.wal.backend import Chunk, LogSink
from danube_ingest.wal.meta import Snapshot
from danube_ingest.wal.recovery import RegionState


class MemoryBackend:
    """Segments in memory: same sequencing, framing and reads as files, no disk."""

    def __init__(self) -> None:
        self._segments: dict[int, bytearray] = {}
        self._active = -1
        self._log: LogSink | None = None

    async def recover(self, index_interval: int) -> RegionState:
        return RegionState()  # nothing survives a restart

    def start(self, sink: LogSink) -> None:
        self._log = sink

    def submit(self, chunk: Chunk) -> None:
        assert self._log is not None
        sealed = None
        if chunk.rotate_to is not None:
            if self._active >= 0:
                sealed = (self._active, len(self._segments[self._active]))
            self._active = chunk.rotate_to
            self._segments[self._active] = bytearray()
        buf = self._segments[self._active]
        for piece in chunk.pieces:
            buf += piece
        self._log.loop.call_soon(self._log.chunks_written, [chunk], sealed)

    async def read(self, seq: int, start: int, size: int) -> bytes:
        return bytes(self._segments[seq][start : start + size])

    def delete(self, seq: int) -> asyncio.Future[None]:
        self._segments.pop(seq, None)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def removed(self) -> None:
        return None

    async def snapshot(self, snapshot: Snapshot) -> None:
        return None  # nothing survives a restart: there is nothing to shorten

    async def close(self) -> None:
        return None
