"""Upload bandwidth: one token bucket per broker, shared by every upload in flight.

``storage.uploader.max_bytes_per_second`` caps what the uploader sends to the object store, so
that a catch-up over a large WAL backlog (after an outage, or a restart over segments never
uploaded) leaves the network, the disk and the event loop to live publishes. The uploader
streams each object in chunks of :func:`chunk_bytes` and takes each chunk's bytes from the
bucket before handing it to the store, so no object, however large, goes out in one burst.

Guarantees of :class:`TokenBucket`:

- Over any interval of ``t`` seconds after its creation, at most ``burst + rate * t`` bytes
  are granted (the bucket starts full and never holds more than ``burst``).
- Grants are first come, first served across tasks (one waiter at a time under a fair
  ``asyncio.Lock``), so concurrent uploads share the rate chunk by chunk and none starves.
- A waiter that is cancelled is granted nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

__all__ = ["TokenBucket", "chunk_bytes", "paced_chunks"]

#: Largest chunk handed to the store at once: at 20 MiB/s and more, a burst lasts at most
#: 50 ms. Smaller limits use smaller chunks (a twentieth of a second's worth), but not below
#: ``MIN_CHUNK_BYTES``, where the per-chunk overhead of the store's writer starts to show.
MAX_CHUNK_BYTES = 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024


def chunk_bytes(rate: int) -> int:
    """The chunk size for a limit of ``rate`` bytes per second (also the bucket's burst)."""
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, rate // 20))


class TokenBucket:
    """``rate`` bytes per second with bursts of up to ``burst`` bytes; see the module docstring.

    ``clock`` returns seconds (monotonic); tests may inject their own.
    """

    def __init__(
        self, rate: float, *, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes per second (got {rate})")
        if burst <= 0:
            raise ValueError(f"burst must be > 0 bytes (got {burst})")
        self._rate = float(rate)
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = asyncio.Lock()
        self.granted = 0
        """Bytes granted so far."""
        self.waited = 0.0
        """Seconds spent waiting for tokens so far (all tasks; for stats and logs)."""

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def burst(self) -> int:
        return self._burst

    async def take(self, size: int) -> None:
        """Return once ``size`` bytes may be sent. More than ``burst`` is granted in steps of
        ``burst``, each waiting its turn in the rate."""
        if size < 0:
            raise ValueError(f"size must be >= 0 (got {size})")
        async with self._lock:
            remaining = size
            while remaining > 0:
                step = min(remaining, self._burst)
                self._refill()
                while self._tokens < step:
                    delay = (step - self._tokens) / self._rate
                    started = self._clock()
                    await asyncio.sleep(delay)
                    self.waited += self._clock() - started
                    self._refill()
                self._tokens -= step
                self.granted += step
                remaining -= step

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(float(self._burst), self._tokens + (now - self._last) * self._rate)
        self._last = now


async def paced_chunks(data: bytes, bucket: TokenBucket, chunk: int) -> AsyncIterator[bytes]:
    """``data`` in pieces of at most ``chunk`` bytes, each yielded once the bucket grants it."""
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0 (got {chunk})")
    view = memoryview(data)
    for start in range(0, len(view), chunk):
        piece = view[start : start + chunk]
        await bucket.take(len(piece))
        yield bytes(piece)
