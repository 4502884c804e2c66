"""Helpers shared by the benchmark scripts (not a benchmark itself).

Every benchmark prints human-readable lines and, as its very last line, one JSON object with at
least ``benchmark``, ``value``, ``unit``, ``baseline``, ``ratio`` and ``ratio_meaning``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Make ``danube_ingest`` importable when run as ``.venv/bin/python benchmarks/NAME.py`` from a
# checkout that was not installed.
_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

MIB = 1024 * 1024


def say(*parts: object) -> None:
    """A human-readable progress/result line (flushed, so a slow step is visible)."""
    print(*parts, flush=True)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return math.nan
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@contextlib.contextmanager
def bench_dir(prefix: str) -> Iterator[Path]:
    """A fresh directory under the system temp dir (same disk as /tmp), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"danube-bench-{prefix}-") as name:
        yield Path(name)


class FsyncCounter:
    """Counts ``os.fdatasync`` calls made anywhere in the process while active.

    Used to report how well group commit batches (entries per fdatasync); the wrapper costs
    about 0.1 µs per call against ~200 µs for the sync itself.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._orig: Any = None

    def __enter__(self) -> FsyncCounter:
        self._orig = orig = os.fdatasync

        def counting(fd: int) -> None:
            self.calls += 1
            orig(fd)

        os.fdatasync = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.fdatasync = self._orig


def cpu_pressure() -> float | None:
    """Linux PSI "some" avg10 for CPU: % of the last 10 s some task waited for a CPU."""
    try:
        with open("/proc/pressure/cpu") as f:
            first = f.readline().split()
        return float(first[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def load_note() -> dict[str, Any]:
    """How busy the machine is right now (other processes distort every figure here)."""
    return {"loadavg_1m": os.getloadavg()[0], "cpu_pressure_avg10": cpu_pressure()}


def warn_if_busy(stage: str) -> dict[str, Any]:
    """Print a warning when other processes compete for the CPUs (PSI, else load average)."""
    note = load_note()
    cpus = os.cpu_count() or 1
    pressure = note["cpu_pressure_avg10"]
    busy = pressure > 10.0 if pressure is not None else note["loadavg_1m"] > 0.5 * cpus
    if busy:
        say(
            f"  WARNING ({stage}): CPU pressure {pressure}% (load average "
            f"{note['loadavg_1m']:.2f} on {cpus} CPUs): other processes compete for CPU and "
            "disk; figures will be low and noisy"
        )
    return note


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(terse=True),
    }


def ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else math.nan


def rounded(obj: Any, digits: int = 4) -> Any:
    """Round floats (recursively) so the JSON line stays readable."""
    if isinstance(obj, float):
        if math.isnan(obj) or math.isinf(obj):
            return None
        if abs(obj) >= 100:
            return round(obj, 1)
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def emit(result: dict[str, Any]) -> None:
    """Print the result object as the last line of output."""
    for key in ("benchmark", "value", "unit", "baseline", "ratio", "ratio_meaning"):
        if key not in result:
            raise KeyError(f"benchmark result lacks {key!r}")
    sys.stdout.flush()
    print(json.dumps(rounded(result), separators=(", ", ": ")), flush=True)


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
