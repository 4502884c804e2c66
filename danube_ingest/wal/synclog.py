"""A test hook: a side file of how much of each segment file is known to be on disk.

With ``DANUBE_TEST_SYNC_LOG`` set to a path when the daemon starts, the WAL writer appends one
line ``SEGMENT_PATH SYNCED_LENGTH`` to that file after every ``fdatasync`` of a segment (one
small ``O_APPEND`` write each, so a SIGKILLed daemon leaves whole lines). A fault test then cuts
each segment back to its last synced length after a kill, which is what a power cut could
leave (page-cache contents that were never synced are gone), and checks that nothing
acknowledged is lost (tests/faults/test_unsynced.py).

Unset (always, outside tests), ``open_sync_log`` returns ``None`` and the writer does nothing
more than test that for ``None`` after a sync.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The environment variable naming the side file.
ENV = "DANUBE_TEST_SYNC_LOG"


class SyncLog:
    """An open side file; ``synced(path, length)`` appends one line."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def synced(self, segment: Path, length: int) -> None:
        """Record that ``segment``'s first ``length`` bytes are on disk."""
        os.write(self._fd, f"{segment} {length}\n".encode())

    def close(self) -> None:
        os.close(self._fd)


def open_sync_log() -> SyncLog | None:
    """The side file named by ``DANUBE_TEST_SYNC_LOG``, or ``None`` when it is not set."""
    path = os.environ.get(ENV)
    return SyncLog(path) if path else None


def read_synced(path: Path) -> dict[Path, int]:
    """Each segment's last recorded synced length, from a side file (a torn last line, which a
    killed writer cannot leave but a reader racing it could see, is ignored)."""
    synced: dict[Path, int] = {}
    for line in path.read_text().splitlines():
        name, _, length = line.rpartition(" ")
        if name and length.isdigit():
            synced[Path(name)] = int(length)
    return synced
