"""A test hook: stop the process between two steps of a multi-step operation, for crash tests.

With ``DANUBE_TEST_STOP_AT`` set to ``NAME`` or ``NAME:N`` when a process runs, the N-th
``reached(NAME)`` of that process (the first without ``:N``) sends it ``SIGSTOP``. A fault test
sees it stopped (state ``T`` in ``/proc/PID/stat``) and SIGKILLs it, or its process group (a
Spark job's driver, JVM and workers), there: a crash exactly between the two steps, which
polling from outside cannot hit (tests/faults/test_spark_rotation.py).

The points (each named where it is reached):

* ``rotation.stored``: a rotation group's object is stored and read back, the manifest swap not
  sent (``objects/rotation.py``);
* ``rotation.swapped``: a group's swap applied, before the next group;
* ``convert.committed``: a partition's commit record is stored, its files not yet published
  (``analytics/commit.py``).

Unset (always, outside tests), ``reached`` does one environment lookup and nothing else.
"""

from __future__ import annotations

import logging
import os
import signal

#: The environment variable naming the point to stop at.
ENV = "DANUBE_TEST_STOP_AT"

log = logging.getLogger(__name__)

_counts: dict[str, int] = {}


def reached(name: str) -> None:
    """Stop this process (``SIGSTOP``) if ``DANUBE_TEST_STOP_AT`` names this point and this is
    its N-th time here; otherwise return at once."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    count = _counts[name] = _counts.get(name, 0) + 1
    if count == (int(nth) if nth else 1):
        log.warning("test stop point reached point=%s n=%d pid=%d", name, count, os.getpid())
        os.kill(os.getpid(), signal.SIGSTOP)


__all__ = ["ENV", "reached"]
