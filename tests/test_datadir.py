"""``danube_ingest.datadir``: one process per data directory, and the directory's identity.

The holder is a real child process (flock is per open file, so a lock taken in this process
would also conflict, but only another process shows what a second daemon sees).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.datadir import DataDirLock, check_metadata_store, data_dir_id
from danube_ingest.errors import DanubeIngestError, DataDirLockedError, MetadataStoreMismatchError

_HOLD = """
import sys, time
from danube_ingest.datadir import DataDirLock
lock = DataDirLock.acquire(*sys.argv[1:])
print("locked", flush=True)
time.sleep(600)
"""


def _holder(*dirs: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLD, *map(str, dirs)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "locked"
    return process


def test_second_process_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    holder = _holder(data)
    try:
        started = time.monotonic()
        with pytest.raises(DataDirLockedError) as caught:
            DataDirLock.acquire(data)
        assert time.monotonic() - started < 1.0  # never waits for the holder
        message = str(caught.value)
        assert f"pid {holder.pid}" in message, message
        assert str(data) in message and "stop that process" in message, message
        assert isinstance(caught.value, DanubeIngestError) and not caught.value.retriable
        # The failed attempt did not erase the holder's pid from the lock file.
        assert f"pid={holder.pid}" in (data / "LOCK").read_text()
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with DataDirLock.acquire(tmp_path) as lock:
        assert lock.holds(tmp_path)
        assert f"pid={os.getpid()}" in (tmp_path / "LOCK").read_text()


def test_all_or_none_and_release(tmp_path: Path) -> None:
    free, held = tmp_path / "free", tmp_path / "held"
    holder = _holder(held)
    try:
        with pytest.raises(DataDirLockedError):
            DataDirLock.acquire(free, held)
        # The directory locked first was given up again when the second failed.
        with DataDirLock.acquire(free) as lock:
            assert lock.dirs == [free.resolve()]
    finally:
        holder.kill()
        holder.wait()
    lock = DataDirLock.acquire(free, held)
    with pytest.raises(DataDirLockedError):  # also within one process
        DataDirLock.acquire(held)
    lock.release()
    lock.release()
    DataDirLock.acquire(held).release()


def test_data_dir_id_is_created_once_and_kept(tmp_path: Path) -> None:
    first = data_dir_id(tmp_path)
    assert len(first) == 32 and int(first, 16) >= 0
    assert data_dir_id(tmp_path) == first
    assert (tmp_path / "ID").read_text().strip() == first
    other = tmp_path / "other"
    other.mkdir()
    assert data_dir_id(other) != first


def test_metadata_store_is_recorded_on_first_use_and_another_refused(tmp_path: Path) -> None:
    etcd = "etcd cluster 00000000000000aa prefix /danube"
    check_metadata_store(tmp_path, etcd)
    assert (tmp_path / "METADATA").read_text().strip() == etcd
    check_metadata_store(tmp_path, etcd)  # the same store again: fine
    for other in ("memory", "etcd cluster 00000000000000aa prefix /other"):
        with pytest.raises(MetadataStoreMismatchError) as caught:
            check_metadata_store(tmp_path, other)
        message = str(caught.value)
        assert etcd in message and other in message, message
        assert "--data-dir" in message and str(tmp_path / "METADATA") in message, message
        assert not caught.value.retriable
        # Refusing changed nothing.
        assert (tmp_path / "METADATA").read_text().strip() == etcd
