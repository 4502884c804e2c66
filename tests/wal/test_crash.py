"""The WAL under process death and write failure, through the TopicStore, in child processes.

* SIGKILL at random moments (repeatedly, on one WAL directory): every acknowledged append is
  there afterwards, intact and in order, and offsets go on without a gap.
* A write failing with EFBIG (RLIMIT_FSIZE): appends fail with WalFailedError, none is
  acknowledged that is not on disk, and reopening finds everything acknowledged.

The children run ``crash_child.py`` (beside this file), which derives every payload from its
topic and offset so that the log can be checked entry by entry.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from danube_ingest.store import TopicStore
from danube_ingest.wal import Entry

CHILD_PATH = Path(__file__).with_name("crash_child.py")


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crash_child", CHILD_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()
Acked = dict[str, dict[int, str]]


class Child:
    """A running crash_child.py whose stdout lines are collected by a thread as they come."""

    def __init__(self, tmp_path: Path, *args: object) -> None:
        self.stderr_path = tmp_path / f"child-{time.monotonic_ns()}.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD_PATH), *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode()
            if not line.endswith("\n"):
                break  # cut by the kill: never reported as a whole line, so not an ack
            self.lines.append(line.rstrip("\n"))
            if line == "ready\n":
                self.ready.set()

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.finish(10)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"child did not finish in {timeout} s; stderr:\n{self.stderr()}")
        self._thread.join(10)
        return code

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]


def record(acked: Acked, lines: list[str]) -> None:
    """Fold a child's ``open`` and ``ack`` lines into ``acked``, checking them as they come."""
    for line in lines:
        kind, *fields = line.split(" ")
        assert kind != "bad", line
        if kind == "open":
            topic, hwm = fields[0], int(fields[1])
            known = acked.setdefault(topic, {})
            assert hwm > max(known, default=-1), f"acknowledged entries of {topic} lost: {line}"
        elif kind == "ack":
            topic, offset, digest = fields[0], int(fields[1]), fields[2]
            known = acked.setdefault(topic, {})
            assert offset not in known, f"offset {offset} of {topic} acknowledged twice"
            assert digest == child.digest(child.payload(topic, offset)), line
            known[offset] = digest


async def verify_log(wal_dir: Path, acked: Acked) -> dict[str, int]:
    """Reopen the log: every acknowledged entry is there, every entry is the payload its offset
    derives, offsets run from 0 without a gap, and appends continue; return the topics' hwm."""
    store = await TopicStore.open(wal_dir, **child.STORE_OPTIONS)
    try:
        hwms = {}
        for topic in child.TOPICS:
            info = store.info(topic)
            known = acked.get(topic, {})
            if info is None:
                assert not known
                continue
            assert info.first_offset == 0
            assert info.high_watermark > max(known, default=-1), f"{topic} lost acked entries"
            hwms[topic] = info.high_watermark
            reader = store.create_reader(topic, 0)
            offset = 0
            last_ms = 0
            async with asyncio.timeout(30):
                while offset < info.high_watermark:
                    for entry in await reader.next_batch():
                        assert entry.offset == offset, f"{topic}: gap or reorder at {offset}"
                        assert entry.payload == child.payload(topic, offset), (topic, offset)
                        assert entry.ingest_ms >= last_ms
                        last_ms = entry.ingest_ms
                        offset += 1
        for topic, hwm in hwms.items():
            assert await store.append(topic, Entry(child.payload(topic, hwm))) == hwm
            assert await store.append_batch(
                topic, [Entry(child.payload(topic, hwm + 1)), Entry(child.payload(topic, hwm + 2))]
            ) == range(hwm + 1, hwm + 3)
    finally:
        await store.close()
    return {topic: hwm + 3 for topic, hwm in hwms.items()}


@pytest.mark.slow
def test_acknowledged_appends_survive_sigkill(tmp_path: Path) -> None:
    rng = random.Random(0xC0FFEE)
    wal_dir = tmp_path / "wal"
    acked: Acked = {}
    rounds = 24
    killed_while_appending = 0
    for round_no in range(rounds):
        proc = Child(tmp_path, "run", wal_dir, round_no)
        if round_no % 6 == 5:
            # Now and then the kill lands while the child starts or recovers.
            time.sleep(rng.uniform(0.0, 0.5))
        else:
            assert proc.ready.wait(20), f"round {round_no}: child never ready\n{proc.stderr()}"
            time.sleep(rng.uniform(0.05, 0.5))
            killed_while_appending += 1
        code = proc.kill()
        assert code == -signal.SIGKILL, f"round {round_no}: child exited {code}\n{proc.stderr()}"
        record(acked, proc.lines)

    total = sum(len(known) for known in acked.values())
    assert killed_while_appending >= 20 and total > 2000, (killed_while_appending, total)
    hwms = asyncio.run(verify_log(wal_dir, acked))

    # A fresh child after all that recovers the same log and continues it.
    proc = Child(tmp_path, "run", wal_dir, rounds)
    assert proc.ready.wait(20), proc.stderr()
    proc.kill()
    opened = {line.split()[1]: int(line.split()[2]) for line in proc.lines if line[:5] == "open "}
    assert all(opened[topic] >= hwm for topic, hwm in hwms.items()), (opened, hwms)


def run_fsize_child(tmp_path: Path, wal_dir: Path, limit: int) -> list[str]:
    proc = Child(tmp_path, "fsize", wal_dir, 1, limit)
    code = proc.finish(60)
    assert code == 0, f"fsize child exited {code}\n{proc.stderr()}"
    return proc.lines


def test_write_failure_fails_appends_and_keeps_acknowledged(tmp_path: Path) -> None:
    wal_dir = tmp_path / "wal"
    acked: Acked = {}
    # Some history first, ended by a kill, so that the failing run starts from recovery.
    proc = Child(tmp_path, "run", wal_dir, 0)
    assert proc.ready.wait(20), proc.stderr()
    time.sleep(0.2)
    proc.kill()
    record(acked, proc.lines)

    limit = 1024 * 1024
    lines = run_fsize_child(tmp_path, wal_dir, limit)
    assert lines[-1] == "closed", lines[-5:]
    failed_at = lines.index("failed")
    record(acked, lines)
    acks = [line for line in lines if line.startswith("ack ")]
    fails = [line for line in lines if line.startswith("fail ")]
    assert acks and len(fails) >= 50
    assert all("File too large" in line for line in fails), fails[0]
    # Nothing is acknowledged once a failure was seen: later appends fail.
    assert not [line for line in lines[failed_at:] if line.startswith("ack ")]
    segments = sorted((wal_dir / "r0").glob("*.wal"))
    assert max(path.stat().st_size for path in segments) <= limit

    # Without the limit, everything acknowledged is there and the log goes on.
    asyncio.run(verify_log(wal_dir, acked))


def test_close_after_write_failure_fails_waiting_appends(tmp_path: Path) -> None:
    """Regression: close() (a task) handed the pending batch to the failed writer and failed
    it from inside the task; the batch could not wake its waiters there, so they hung, and
    not even cancelling them helped."""
    proc = Child(tmp_path, "close-after-failure", tmp_path / "wal", 0, 64 * 1024)
    code = proc.finish(30)
    assert code == 0, f"child exited {code}\n{proc.stderr()}"
    assert proc.lines == ["waiters " + " ".join(["WalFailedError"] * 4), "closed"]
