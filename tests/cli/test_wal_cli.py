"""``danube-ingest wal verify|repair`` on real WAL directories."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from danube_ingest.cli import main
from danube_ingest.store import TopicStore
from danube_ingest.testing import free_port
from danube_ingest.wal import Entry
from danube_ingest.wal.framing import checkpoint_frame, messages_frame, topic_frame
from danube_ingest.wal.segment import list_segments, segment_path


def _write_wal(wal_dir: Path, count: int = 50) -> None:
    async def write() -> None:
        store = await TopicStore.open(wal_dir, segment_bytes=64 * 1024)
        for i in range(count):
            await store.append("/default/cli", Entry(b"payload-%d" % i))
        store.regions[0].rotate()
        await store.append("/default/cli", Entry(b"last"))
        await store.close()

    asyncio.run(write())


def test_verify_intact_wal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_wal(tmp_path / "wal")
    assert main(["wal", "verify", "--wal-dir", str(tmp_path / "wal")]) == 0
    out = capsys.readouterr().out
    assert "topic /default/cli: offsets 0..50" in out
    assert "CORRUPT" not in out


def test_verify_reports_corruption_and_repair_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wal = tmp_path / "wal"
    _write_wal(wal)
    region = wal / "r0"
    first = segment_path(region, list_segments(region)[0])
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0xFF
    first.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in region.glob("*.wal")}

    assert main(["wal", "verify", "--wal-dir", str(wal)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and first.name in out
    assert {p.name: p.read_bytes() for p in region.glob("*.wal")} == before  # unchanged

    assert main(["wal", "repair", "--wal-dir", str(wal)]) == 0  # dry run without --yes
    assert "would truncate" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in region.glob("*.wal")} == before

    assert main(["wal", "repair", "--wal-dir", str(wal), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "quarantined" in out
    assert any((region / "quarantine").iterdir())
    assert main(["wal", "verify", "--wal-dir", str(wal)]) == 0

    async def reopen() -> int:
        store = await TopicStore.open(wal)
        info = store.info("/default/cli")
        offset = await store.append("/default/cli", Entry(b"after-repair"))
        await store.close()
        assert info is not None and offset == info.high_watermark
        return offset

    assert 0 < asyncio.run(reopen()) < 51


def test_missing_wal_dir_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["wal", "verify", "--wal-dir", str(tmp_path / "nope")]) == 2
    assert "no WAL directory" in capsys.readouterr().err


def _settled(region: Path) -> dict[str, bytes]:
    """The region's segments once the broker's own start-up work on them (a new active
    segment, its checkpoint) is over: two reads half a second apart agree."""
    deadline = time.monotonic() + 20
    previous = None
    while True:
        current = {p.name: p.read_bytes() for p in region.glob("*.wal")}
        if current == previous:
            return current
        assert time.monotonic() < deadline, "the broker kept changing its WAL"
        previous = current
        time.sleep(0.5)


@pytest.mark.parametrize("flag", ["--wal-dir", "--data-dir"])
def test_repair_refuses_a_wal_in_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """A running broker holds the WAL directory's lock: repair must not rewrite its segments.
    The holder is a real broker process (``danube-ingest broker --etcd memory``)."""
    wal = tmp_path / "wal"
    _write_wal(wal)
    port = free_port()
    log = tmp_path / "broker.log"
    # No upload, cleaning or time-based segment roll while the test compares the segments.
    config = tmp_path / "broker.yml"
    config.write_text("storage:\n  mode: local_only\n  wal:\n    segment_seconds: 3600\n")
    with log.open("wb") as out:
        broker = subprocess.Popen(
            [
                *(sys.executable, "-m", "danube_ingest.cli", "broker", "--etcd", "memory"),
                *("--config", str(config)),
                *("--data-dir", str(tmp_path), "--listen", f"127.0.0.1:{port}"),
                *("--metrics-listen", "127.0.0.1:0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving on" not in log.read_text(errors="replace"):
            assert broker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        before = _settled(wal / "r0")
        target = str(wal) if flag == "--wal-dir" else str(tmp_path)
        assert main(["wal", "repair", flag, target, "--yes"]) == 2
        err = capsys.readouterr().err
        assert f"in use by pid {broker.pid}" in err, err
        assert {p.name: p.read_bytes() for p in (wal / "r0").glob("*.wal")} == before
        # verify only reads: it may run while the broker does.
        assert main(["wal", "verify", flag, target]) == 0
    finally:
        broker.terminate()
        broker.wait(30)


def test_offset_gap_is_listed_not_corrupt_and_repair_keeps_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the old poisoned WAL looked like: offsets 2..4 in no frame, frames after them."""
    region = tmp_path / "wal" / "r0"
    region.mkdir(parents=True)
    segment = segment_path(region, 0)
    segment.write_bytes(
        b"".join(
            [
                checkpoint_frame(0, 0, "r0"),
                topic_frame(1, "/default/cli"),
                *messages_frame(1, 0, [Entry(b"0"), Entry(b"1")]),
                *messages_frame(1, 5, [Entry(b"5")]),
            ]
        )
    )
    before = segment.read_bytes()

    assert main(["wal", "verify", "--wal-dir", str(tmp_path / "wal")]) == 0
    out = capsys.readouterr().out
    assert "gap (kept, not damage): offset gap in topic /default/cli: offsets 2..4" in out
    assert "CORRUPT" not in out
    assert main(["wal", "repair", "--wal-dir", str(tmp_path / "wal"), "--yes"]) == 0
    assert "intact (1 offset gaps kept: not damage)" in capsys.readouterr().out
    assert segment.read_bytes() == before and not (region / "quarantine").exists()
