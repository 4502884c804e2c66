"""The region write-ahead log: framing, segments, group commit, snapshots and recovery.

``log`` is the sequencer (offsets, framing, completions); ``backend`` states what a backend
must do; ``local`` (segment files) and ``memory`` are the two backends.
"""

from danube_ingest.wal.framing import Entry, Kind
from danube_ingest.wal.log import RegionLog, Sealed
from danube_ingest.wal.recovery import RegionState, recover_region, repair_region, verify_region

__all__ = [
    "Entry",
    "Kind",
    "RegionLog",
    "RegionState",
    "Sealed",
    "recover_region",
    "repair_region",
    "verify_region",
]
