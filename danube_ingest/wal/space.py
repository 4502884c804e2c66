"""Free disk space: how the daemon keeps a full disk from ever failing a write.

The WAL, the WAL cleaner and the ``fs`` object store all ask one question through this module
(:func:`disk_free`, or a ``DiskFree`` callable handed in instead): how many bytes may an
unprivileged writer still put on the filesystem holding a path? The policy built on it, with
``F = storage.wal.retention.min_free_bytes``:

* **Publishes stop at F.** ``TopicStore`` refuses appends with ``WalBackpressureError``
  (``RESOURCE_EXHAUSTED``, retriable) once they would leave less than ``F`` free on the WAL's
  filesystem, counting what is staged but not yet written. It measures on a timer, after a
  cleaning pass and whenever its running estimate says an append would cross ``F``, never per
  message; while refused, it measures again after every commit and on the timer, so space freed
  by anyone (the cleaner, an operator deleting files) lifts the backpressure without a restart,
  once a quarter of ``F`` is free above ``F`` (so that it does not flap at the floor).
* **Preallocation stays above F.** A new segment's blocks are reserved only if ``F`` remains
  free afterwards; otherwise the segment grows as it is written, like any file.
* **The lower half of F is for shipping data out.** The ``fs`` object store refuses (retriably)
  a PUT that would leave less than ``F / 2`` free on its filesystem, and removes the partial file
  of a write that failed anyway, so a retried upload never fills the disk. Uploads can thus still
  run while publishes are refused, which is what lets the cleaner delete segments.
* **The cleaner counts free space as retention.** Below ``F`` (and, once there, until a quarter
  of ``F`` is free above it) it prunes like over
  ``retention.max_bytes``: uploaded (``wal_cloud``) or oldest (``local_only``) segments go even
  if a subscription has not consumed them yet (it then reads from objects, or gets
  ``OffsetOutOfRange`` in ``local_only``); ``retention.min_*`` still hold.

**The size limit has a prune level below it.** ``retention.max_bytes`` is a hard limit: a WAL
holding more refuses appends. The cleaner prunes as over the maximum from :func:`prune_level`
on, a few segments below it, and the store wakes the cleaner when the WAL grows past that level:
where pruning is allowed (``local_only`` and ``memory`` modes, or uploaded segments) a WAL at
its maximum makes room before a publish finds it full, instead of refusing publishes at every
seal (measured: a 1 GiB WAL written at 160 MB/s fell from 1.6M to about 1M msg/s, with
refused batches resent, when pruning began only at the limit).

``F`` must cover what is written between two measurements: the active segment's in-flight
batches (``max_batch_bytes``) and, below ``F``, the objects in flight (a segment each), hence
the default of a few segments' worth.

**An ENOSPC that happens anyway** (another process filled the disk faster than the checks, or
``F = 0``) fails the region for good, as any failed write or fsync does (``WalFailedError``,
``INTERNAL``): nothing of the failed group is acknowledged, and the region refuses appends until
the daemon restarts. It does not try to continue in-process: after a failed ``write`` the file
may hold part of a frame, and after a failed ``fdatasync`` the page cache no longer says what is
on disk (Linux marks the pages clean or drops them: "fsyncgate"), so neither the log's positions
nor its offset index can be trusted past the last good sync. Continuing would mean truncating
back to that position and rebuilding every topic's index and offsets under readers, the cache
and the uploader that hold them. Instead the failing writer cuts the segment back to its last
acknowledged byte (never syncing again), and a restart rebuilds everything through the tested
recovery path (a torn tail truncated); with the floor in place it only happens when something
outside the daemon took the space.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

#: Bytes an unprivileged writer may still put on the filesystem holding a path.
DiskFree = Callable[[Path], int]


def disk_free(path: Path) -> int:
    """``statvfs``'s available bytes (``f_bavail * f_frsize``: what non-root may still use) of
    the filesystem holding ``path``, or of its nearest existing parent."""
    while not path.exists() and path.parent != path:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def prune_level(max_bytes: int, segment_bytes: int) -> int:
    """Bytes of WAL above which the cleaner prunes as over ``retention.max_bytes``: four
    segments below it, or a quarter of it when that is less (so it stays above zero)."""
    return max_bytes - min(4 * segment_bytes, max_bytes // 4)


__all__ = ["DiskFree", "disk_free", "prune_level"]
