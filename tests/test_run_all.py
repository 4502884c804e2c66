"""``benchmarks/run_all.py --quick`` end to end: a real broker, etcd, redis-server and
danube-client; it writes its table between the markers of a Markdown file (keeping the rest),
two PNG plots, and one JSON line. Speed is not asserted: only that every cell was measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the quick sweep may take here (about 25 s on a loaded 2-core machine).
RUN_TIMEOUT = 150


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_quick_sweep_writes_the_table_the_plots_and_a_json_line(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    before, after = "# Benchmarks\n\nintro\n\n", "\n\n## later section\n\ntext\n"
    doc.write_text(f"{before}<!-- run_all:begin -->\nold table\n<!-- run_all:end -->{after}")
    img = tmp_path / "docs" / "img"
    command = [sys.executable, "benchmarks/run_all.py", "--quick"]
    result = subprocess.run(
        [*command, "--doc", str(doc), "--img-dir", str(img)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = json.loads(result.stdout.splitlines()[-1])
    assert line["benchmark"] == "run_all" and line["unit"] == "msg/s"
    assert {(c["client"], c["batch"], c["concurrency"]) for c in line["cells"]} == {
        ("ingest", 10, 1), ("ingest", 100, 2), ("danube", 1, 1), ("danube", 1, 4),
        ("redis", 10, 1), ("redis", 100, 2),
    }  # fmt: skip
    for cell in line["cells"]:
        assert cell["msg_per_s"] > 0 and cell["p99_ms"] >= cell["p50_ms"] > 0, cell

    text = doc.read_text()
    assert text.startswith(before) and text.endswith(after), text
    assert "old table" not in text and text.count("<!-- run_all:begin -->") == 1
    section = text[text.index("<!-- run_all:begin -->") : text.index("<!-- run_all:end -->")]
    assert "benchmarks/run_all.py --quick" in section and "CPU pressure" in section
    rows = [row for row in section.splitlines() if row.startswith("| ") and "---" not in row]
    assert len(rows) == 1 + 6, section  # header + one row per cell
    for name in ("danube_ingest.client", "Redis Streams", "danube-client"):
        assert sum(row.startswith(f"| {name} |") for row in rows) == 2, section
    for png in ("throughput_vs_batch.png", "latency_vs_concurrency.png"):
        assert (img / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](img/{png})" in section


def test_the_section_is_appended_when_the_markers_are_absent(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from run_all import BEGIN, END, write_section
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    doc = tmp_path / "b.md"
    doc.write_text("# Benchmarks\n")
    write_section(doc, f"{BEGIN}\nfirst\n{END}")
    write_section(doc, f"{BEGIN}\nsecond\n{END}")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## `run_all.py`") and text.count(BEGIN) == 1
    assert "second" in text and "first" not in text
