"""A run: consecutive unsettled offsets of one reliable subscription, tracked as one unit.

Reliable dispatch keeps what it reads as runs (one per read batch, split where offsets jump)
as long as nothing needs them one by one, so a batch consumer gets, and acks, a frame of
entries at the cost of one object instead of one per message. A run is either READY (never
delivered, or given back by a consumer that left: waiting for a consumer with room) or
DELIVERED (in one consumer's window, with one ack deadline). Every entry of a run is on the
same attempt: the first delivery, or a redelivery after its consumer left (which is not a
failed delivery). Anything that needs per-message state (a nack, an ack timeout, a consumer
that takes only single messages, KeyShared routing) turns the run into per-message state for
good: see ``ReliableSubscription._explode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_ingest.wal.framing import Entry

if TYPE_CHECKING:
    from danube_ingest.dispatch.consumer import ConsumerHandle


@dataclass(slots=True, eq=False)
class Run:
    """Offsets ``[base, base + len(entries))``, unsettled; ``entries[i]`` has offset
    ``base + i``. Compared and hashed by identity."""

    base: int
    entries: Sequence[Entry]
    consumer: ConsumerHandle | None = None
    """The consumer holding it (DELIVERED), else None (READY)."""
    due: float = 0.0
    """DELIVERED: the ack deadline."""
    dispatched: bool = False
    """Given to a consumer at least once (the Block poison policy still lets these out)."""
    queued: bool = False
    """In its consumer's queue, not yet taken."""
    live: bool = True
    """False once settled or turned into per-message state."""

    @property
    def end(self) -> int:
        """The offset after its last entry."""
        return self.base + len(self.entries)
