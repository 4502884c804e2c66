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
import faulthandler
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any, TextIO

log = logging.getLogger(__name__)

#: Young-generation threshold: allocations between collections (see the module docstring).
GC_GEN0_THRESHOLD = 5_000


def tune_gc() -> None:
    """Apply the daemon's garbage-collection settings to this process. Idempotent."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 100)


#: Seconds after a stop signal without a finished shutdown before the daemon writes every
#: thread's stack to stderr (it keeps waiting: a second signal exits at once).
SHUTDOWN_STACKS_SECONDS = 30.0

#: Exit status after a second stop signal cut the shutdown short.
EXIT_FORCED = 70


def stop_on_signals(stop: asyncio.Event, *, on_force: Callable[[], None] | None = None) -> None:
    """SIGTERM and SIGINT stop the daemon cleanly (``stop`` is set); a second one exits at once.

    The first signal is logged, and should the shutdown not be over within
    ``SHUTDOWN_STACKS_SECONDS`` every asyncio task's and every thread's stack goes to stderr, so
    a stuck shutdown says where it is stuck. A second signal writes the stacks, calls
    ``on_force`` (which stops child processes) and exits with ``EXIT_FORCED``, without the rest
    of the shutdown: acknowledged messages are in the WAL already, cursors not yet written are
    redelivered, the topics' leases expire. Call from the running loop; ``shutdown_done``
    cancels the stack dump.
    """
    loop = asyncio.get_running_loop()

    def handler(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s received: shutting down (send it again to exit at once)", sig.name)
            # Stuck in a coroutine: the loop still runs and lists its tasks. Stuck in a thread
            # or with the loop blocked: the threads' stacks (written whatever the loop does).
            loop.call_later(SHUTDOWN_STACKS_SECONDS, write_task_stacks)
            faulthandler.dump_traceback_later(SHUTDOWN_STACKS_SECONDS, exit=False)
            stop.set()
            return
        log.warning("%s received again: exiting now, without finishing the shutdown", sig.name)
        faulthandler.dump_traceback(all_threads=True)
        if on_force is not None:
            on_force()
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_FORCED)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler, sig)


def write_task_stacks(file: TextIO | None = None) -> None:
    """Write where every asyncio task of the running loop waits (to stderr by default)."""
    out = file or sys.stderr
    tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
    print(f"asyncio tasks ({len(tasks)}), where each one waits:", file=out)
    for task in tasks:
        print(f"task {task.get_name()}:", file=out)
        for frame in _awaiting(task.get_coro()):
            code = frame.f_code
            print(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}', file=out)
    out.flush()


def _awaiting(coro: object) -> Iterator[FrameType]:
    """The frames of a coroutine and of what it awaits, outermost first."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def shutdown_done() -> None:
    """The shutdown finished: no stack dump for it."""
    faulthandler.cancel_dump_traceback_later()


def run_daemon(main: Coroutine[Any, Any, None]) -> None:
    """Run the daemon's main coroutine on uvloop if available, else on asyncio's loop.

    ``SIGUSR1`` writes every thread's stack to stderr at any time, whatever the event loop is
    doing (``kill -USR1 PID``: where is it now?).
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
