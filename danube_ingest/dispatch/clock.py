"""Time for the dispatch timers (ack timeouts, redelivery delays), swappable for tests.

:class:`LoopClock` is the event loop's monotonic clock; :class:`ManualClock` only moves when a
test calls :meth:`ManualClock.advance`, which runs every timer that came due, in time order,
before it returns. Both share one contract (``tests/dispatch/test_clock.py``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None:
        """Stop the timer; its callback will not run. Idempotent."""


class Clock(Protocol):
    """Monotonic seconds and one-shot timers, used from the event loop's thread only."""

    def now(self) -> float:
        """The current time in seconds (monotonic, arbitrary origin)."""

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` once ``now() >= when`` (as soon as possible if it already is)."""


class LoopClock:
    """The running event loop's clock (``loop.time()`` / ``loop.call_at``)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_at(when, callback)


class _ManualTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that stands still until :meth:`advance` moves it.

    A timer set for a time already past runs at the next :meth:`advance` (``advance(0)``
    included), not at once: callbacks only ever run inside ``advance``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = _ManualTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, running due timers in time order (each sees its own due time)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback()
        self._now = target

    @property
    def pending(self) -> int:
        """Timers not yet run or cancelled."""
        return sum(1 for _, _, timer in self._timers if not timer.cancelled)
