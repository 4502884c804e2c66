"""asyncio helpers that never lose a task's cancellation.

On Python 3.11, ``asyncio.wait_for`` loses a cancellation that arrives in the same event-loop
turn as the awaited thing completes (python/cpython#86296, fixed in 3.12 where ``wait_for`` is
built on ``asyncio.timeout``): the waiting task carries on as if nothing happened. A background
loop that sleeps with ``wait_for(event.wait(), interval)`` and is woken just as it is stopped
(``wake()`` then ``stop()``, as at shutdown after an upload) then never ends, and whoever awaits
it waits for ever: measured, 300 of 300 such stops hung with ``wait_for`` and 0 of 300 with
``asyncio.timeout``. The daemon therefore uses ``asyncio.timeout`` (or :func:`wait_event`)
everywhere instead of ``asyncio.wait_for``.

:class:`BackgroundLoop` is the start/stop scaffold of the daemon's periodic background loops
(the WAL cleaner, the clock keeper, the tail handover): one named task, stopped by cancelling
it and waiting for it to end.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import ClassVar


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


class BackgroundLoop:
    """A component that runs one background task, its :meth:`_run`, from :meth:`start` to
    :meth:`stop`. Use from one event loop.

    Subclasses set :attr:`task_name` and implement :meth:`_run` (normally a ``while True``
    loop that logs and survives its own failures); only a cancellation ends it."""

    task_name: ClassVar[str]
    """The asyncio task's name (seen in task dumps and asyncio's debug messages)."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start the task on the running event loop; a no-op while it runs."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended; a no-op when it is not running.
        ``start`` may be called again afterwards. A cancellation of the caller that arrives
        while it waits is absorbed as well, on purpose: a shutdown that calls ``stop`` goes on
        to its next steps (closing the WAL, revoking the lease) rather than ending half-way."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


__all__ = ["BackgroundLoop", "wait_event"]
