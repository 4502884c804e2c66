"""Process-wide settings for the daemon (applied by ``danube-ingest broker``/``dev``).

Event loop: uvloop when it is installed (it is a dependency on Linux). grpc.aio runs on it
unchanged, and the broker spends 15-20% less CPU per published message than on the default
loop (measured with benchmarks/publish_danube_client.py).

Garbage collection: with CPython's default thresholds (700, 10, 10) the young generation is
collected every 700 allocations; measured on the append path, that was about 15% of the CPU per
message. The daemon freezes what exists after start-up (modules, configuration) and collects
the young generation every 5,000 allocations. A young collection stops the event loop while it
walks (and frees) what was allocated since the last one: at 50,000 that took 9-16 ms in the
broker at 1,000 msg/s (every few seconds, visible in the p99.9 of benchmarks/e2e_latency.py:
16-18 ms against 11-13 ms at 5,000), at 5,000 it takes 0.3 ms on average and under 2 ms at
most, for no measurable difference in CPU per message. (Full collections stay short because
the WAL cache keeps all but its newest blocks as bytes, which the collector does not track.)
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any

#: Young-generation threshold: allocations between collections (see the module docstring).
GC_GEN0_THRESHOLD = 5_000


def tune_gc() -> None:
    """Apply the daemon's garbage-collection settings to this process. Idempotent."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 100)


def run_daemon(main: Coroutine[Any, Any, None]) -> None:
    """Run the daemon's main coroutine on uvloop if available, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
