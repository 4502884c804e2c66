"""Progress of the client commands (``produce``, ``consume``, ``bench``) on stderr.

On a terminal: a rich progress bar (count, rate, elapsed), redrawn at most 10 times a second by
the caller's own ``step`` calls (no refresh thread competing with the client for the GIL).
Otherwise (stderr piped or redirected, as in scripts and tests): one plain line every
``PLAIN_INTERVAL_S`` seconds and a last one at the end, so logs stay readable. stdout is left
to the command's results (messages, figures, JSON).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

#: Seconds between plain progress lines (often enough to see a stall, rare enough for a log).
PLAIN_INTERVAL_S = 2.0
#: Seconds between redraws of the bar on a terminal.
BAR_INTERVAL_S = 0.1


class ProgressLine:
    """Counts messages for one phase (``sent``, ``received``...) and shows the count.

    ``total`` 0 means open-ended (no bar length, no percentage). Use as a context manager;
    ``step(n)`` is cheap (one clock read) and may be called per message.
    """

    def __init__(self, verb: str, total: int, stream: IO[str] | None = None) -> None:
        self.verb = verb
        self.total = total
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        self._last = self._started
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        if self._stream.isatty():
            columns = [
                TextColumn(f"{verb}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} msg/s"),
                TimeElapsedColumn(),
            ]
            self._bar = Progress(
                *columns,
                console=Console(file=self._stream),
                auto_refresh=False,
                transient=False,
            )
            self._task = self._bar.add_task(verb, total=total or None, rate="0")

    def __enter__(self) -> Self:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._show(time.monotonic())
        if self._bar is not None:
            self._bar.stop()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def step(self, n: int = 1) -> None:
        """Count ``n`` more messages; redraw if it is time to."""
        self.done += n
        now = time.monotonic()
        interval = BAR_INTERVAL_S if self._bar is not None else PLAIN_INTERVAL_S
        if now - self._last >= interval:
            self._show(now)

    def _show(self, now: float) -> None:
        self._last = now
        rate = self.done / max(now - self._started, 1e-9)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done, rate=f"{rate:,.0f}")
            self._bar.refresh()
            return
        total = f"/{self.total}" if self.total else ""
        print(
            f"{self.verb} {self.done}{total} messages ({rate:,.0f} msg/s)",
            file=self._stream,
            flush=True,
        )
