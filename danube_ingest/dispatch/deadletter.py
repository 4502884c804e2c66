"""Handing poisoned entries to a subscription's dead-letter callback.

A :class:`DeadLetterQueue` calls the callback for one entry at a time, in the order the entries
were poisoned, and retries a failed call every ``retry_s`` until it succeeds (the dead-letter
topic may be in backpressure, or owned elsewhere for a moment). Only a successful call reports
the entry done, so an entry is never settled without having reached the dead-letter topic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from danube_ingest.dispatch.clock import Clock
from danube_ingest.wal.framing import Entry

log = logging.getLogger(__name__)

DeadLetterCallback = Callable[[Entry, dict[str, str]], Awaitable[None]]
"""Republish a poisoned entry with the given attributes; return once it is durable."""


def dead_letter_attributes(
    entry: Entry, topic: str, subscription: str, attempt: int, reason: str
) -> dict[str, str]:
    """The entry's own attributes plus Danube's ``x-original-*`` ones (which win on a clash)."""
    attributes = dict(entry.attributes or {})
    attributes.update(
        {
            "x-original-topic": topic,
            "x-original-subscription": subscription,
            "x-original-topic-offset": str(entry.offset),
            "x-delivery-attempt": str(attempt),
            "x-failure-reason": reason,
        }
    )
    return attributes


class DeadLetterQueue:
    """Dead-letters entries of one subscription, in order, retrying failures.

    ``wanted(offset)`` is asked before each call (an entry acked meanwhile is skipped);
    ``done(offset)`` is called after each successful call.
    """

    def __init__(
        self,
        topic: str,
        subscription: str,
        callback: DeadLetterCallback,
        *,
        dead_letter_topic: str,
        retry_s: float,
        clock: Clock,
        wanted: Callable[[int], bool],
        done: Callable[[int], None],
    ) -> None:
        self._topic = topic
        self._subscription = subscription
        self._callback = callback
        self._dead_letter_topic = dead_letter_topic
        self._retry_s = retry_s
        self._clock = clock
        self._wanted = wanted
        self._done = done
        self._queue: deque[tuple[Entry, int, str]] = deque()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, entry: Entry, attempt: int, reason: str) -> None:
        """Queue ``entry``, whose delivery number ``attempt`` failed because of ``reason``."""
        self._queue.append((entry, attempt, reason))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"dead-letter {self._topic} {self._subscription}"
            )

    async def close(self) -> None:
        """Stop; entries not yet dead-lettered stay unsettled. Idempotent."""
        task, self._task = self._task, None
        self._queue.clear()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        queue = self._queue
        while queue:
            entry, attempt, reason = queue[0]
            if not self._wanted(entry.offset):
                queue.popleft()
                continue
            attributes = dead_letter_attributes(
                entry, self._topic, self._subscription, attempt, reason
            )
            try:
                await self._callback(entry, attributes)
            except Exception as exc:
                log.warning(
                    "dead-lettering failed, retrying topic=%s subscription=%s offset=%d "
                    "dead_letter_topic=%s retry_in_s=%s error=%r",
                    self._topic,
                    self._subscription,
                    entry.offset,
                    self._dead_letter_topic,
                    self._retry_s,
                    exc,
                )
                await self._sleep(self._retry_s)
                continue
            queue.popleft()
            log.warning(
                "dead-lettered poison message topic=%s subscription=%s offset=%d attempt=%d "
                "dead_letter_topic=%s",
                self._topic,
                self._subscription,
                entry.offset,
                attempt,
                self._dead_letter_topic,
            )
            self._done(entry.offset)
        self._task = None

    async def _sleep(self, seconds: float) -> None:
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def fire() -> None:
            if not wake.done():
                wake.set_result(None)

        timer = self._clock.call_at(self._clock.now() + seconds, fire)
        try:
            await wake
        finally:
            timer.cancel()
