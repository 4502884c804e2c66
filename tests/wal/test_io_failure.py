"""A RegionLog whose segment ``write`` or ``fdatasync`` fails (EIO, ENOSPC), in a child process
under the failio shim (tests/faults/failio.c): fail-stop, and nothing unsynced trusted later.

After a failed ``fdatasync`` Linux may mark the written pages clean while they still hold the
data ("fsyncgate"): a process that reopens the segment reads bytes that may never reach the
disk, and a later ``fdatasync`` of what it appends after them does not write them either. So
the failed group must not be in the segment when the log is reopened: its appends were never
acknowledged, and acknowledged appends must never come to lie behind bytes that are not on disk.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.failio import SYNC, WRITE, FailIO, build_failio

#: The child: 10 appends acknowledged, the fault turned on, 5 more (must fail), one more after
#: the failure (must be refused at once), close; the fault turned off and the region reopened.
CHILD = """
import asyncio, json, os, sys, time
from pathlib import Path
from danube_ingest.errors import WalFailedError
from danube_ingest.wal import Entry
from danube_ingest.wal.log import RegionLog

region_dir, trigger = Path(sys.argv[1]), Path(sys.argv[2])
SHIM_DELAY = 0.02  # the shim looks at its trigger every 2 ms

async def main():
    out = {}
    log = await RegionLog.open(region_dir, fsync="always")
    await asyncio.gather(*(log.stage("/ns/t", Entry(b"a" * 100)) for _ in range(10)))
    out["acked"] = 10
    trigger.touch()
    time.sleep(SHIM_DELAY)
    try:
        await asyncio.gather(*(log.stage("/ns/t", Entry(b"b" * 100)) for _ in range(5)))
        out["failed_group"] = "acknowledged"
    except WalFailedError as exc:
        out["failed_group"] = str(exc)
    try:
        await log.stage("/ns/t", Entry(b"c" * 100))
        out["after"] = "acknowledged"
    except WalFailedError as exc:
        out["after"] = str(exc)
    await log.close()
    trigger.unlink()
    time.sleep(SHIM_DELAY)
    reopened = await RegionLog.open(region_dir, fsync="always")
    out["recovered_hwm"] = reopened.topic("/ns/t").hwm
    await asyncio.gather(*(reopened.stage("/ns/t", Entry(b"d" * 100)) for _ in range(3)))
    out["hwm_after_restart"] = reopened.topic("/ns/t").hwm
    await reopened.close()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def failio_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_failio(tmp_path_factory.mktemp("failio"))


def _run(tmp_path: Path, library: Path, code: int, ops: tuple[str, ...]) -> dict[str, object]:
    region_dir = tmp_path / "r0"
    region_dir.mkdir()
    fault = FailIO(library, region_dir, tmp_path / "fault-on", code, ops)
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(region_dir), str(fault.trigger)],
        env={**os.environ, **fault.env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return out


@pytest.mark.parametrize(
    ("code", "ops", "message"),
    [
        (errno.EIO, (SYNC,), "Input/output error"),
        (errno.ENOSPC, (SYNC,), "No space left on device"),
        (errno.EIO, (WRITE,), "Input/output error"),
    ],
    ids=["eio-fdatasync", "enospc-fdatasync", "eio-write"],
)
@pytest.mark.timeout(90)
def test_a_failed_write_or_fdatasync_fails_stop_and_leaves_nothing_unsynced(
    tmp_path: Path, failio_library: Path, code: int, ops: tuple[str, ...], message: str
) -> None:
    out = _run(tmp_path, failio_library, code, ops)
    assert out["acked"] == 10
    # Nothing of the failed group acknowledged; its error named; the log refuses what follows.
    assert message in str(out["failed_group"]), out
    assert "region r0" in str(out["failed_group"]), out
    assert message in str(out["after"]), out
    # Reopened: exactly what was acknowledged, not the failed group the page cache may hold.
    assert out["recovered_hwm"] == 10, out
    assert out["hwm_after_restart"] == 13, out
