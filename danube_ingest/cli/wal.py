"""``danube-ingest wal verify|repair``: inspect and repair the write-ahead log offline.

Run them while the broker is stopped. ``verify`` changes nothing and exits 1 when a region is
corrupt (the broker would refuse to open it); it also lists offset gaps (offsets in no frame:
never written, so never acknowledged), which are not damage. ``repair`` truncates each damaged
region at its first damage, moving the cut bytes and every later segment into
``{region}/quarantine/``; it never moves a frame for an offset gap.

``repair`` takes the WAL directory's lock (``danube_ingest.datadir``; a running broker holds it)
and refuses, naming the broker's pid, while a broker uses the WAL. ``verify`` takes no lock and
only reads, so it may be run on a live WAL: the newest segment may then show a "torn tail"
that is only a write in progress.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from danube_ingest.config import load_config
from danube_ingest.datadir import DataDirLock
from danube_ingest.errors import ConfigError
from danube_ingest.wal.recovery import repair_region, verify_region


def register(commands: Any) -> None:
    group = commands.add_parser("wal", help="inspect or repair the write-ahead log (offline)")
    sub = group.add_subparsers(dest="wal_command", required=True, metavar="ACTION")
    for name, handler, text in (
        ("verify", _verify, "check every segment's frames and CRCs; change nothing"),
        ("repair", _repair, "truncate damaged regions at their first damage (quarantining)"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--config", help="broker config file (for broker.data_dir/wal.dir)")
        cmd.add_argument("--data-dir", help="broker data directory (WAL under DATA_DIR/wal)")
        cmd.add_argument("--wal-dir", help="WAL directory (overrides --data-dir)")
        if name == "repair":
            cmd.add_argument(
                "--yes", action="store_true", help="do it (without it, only show what would change)"
            )
        cmd.set_defaults(handler=handler)


def _wal_dir(args: argparse.Namespace) -> Path:
    if args.wal_dir:
        return Path(args.wal_dir)
    overrides = {"broker.data_dir": args.data_dir} if args.data_dir else None
    return load_config(args.config, overrides).wal_dir()


def _regions(wal_dir: Path) -> list[Path]:
    if not wal_dir.is_dir():
        raise ConfigError(
            f"no WAL directory at {wal_dir} (check --wal-dir, --data-dir or --config)"
        )
    return sorted(p for p in wal_dir.iterdir() if p.is_dir())


def _verify(args: argparse.Namespace) -> int:
    bad = 0
    for region in _regions(_wal_dir(args)):
        report = verify_region(region)
        print(
            f"region {region.name}: {report.segments} segments, {report.frames} frames, "
            f"{report.bytes} bytes, {len(report.topics)} topics"
        )
        for topic, (first, nxt) in sorted(report.topics.items()):
            print(f"  topic {topic}: offsets {first}..{nxt - 1}" if nxt > first else f"  {topic}")
        for gap in report.gaps:
            print(f"  gap (kept, not damage): {gap}")
        if report.torn_tail is not None:
            path, position = report.torn_tail
            print(f"  torn tail at {path}:{position} (recovery truncates it; nothing acknowledged)")
        if report.corruption is not None:
            bad += 1
            print(f"  CORRUPT: {report.corruption}")
    return 1 if bad else 0


def _repair(args: argparse.Namespace) -> int:
    wal_dir = _wal_dir(args)
    regions = _regions(wal_dir)
    with DataDirLock.acquire(wal_dir):
        return _repair_regions(args, regions)


def _repair_regions(args: argparse.Namespace, regions: list[Path]) -> int:
    for region in regions:
        report = verify_region(region)
        damage = report.corruption
        if damage is None and report.torn_tail is None:
            kept = f" ({len(report.gaps)} offset gaps kept: not damage)" if report.gaps else ""
            print(f"region {region.name}: intact{kept}")
            continue
        where = (damage.path, damage.position) if damage else report.torn_tail
        assert where is not None
        if not args.yes:
            print(f"region {region.name}: would truncate at {where[0]}:{where[1]} (use --yes)")
            continue
        moved = repair_region(region)
        print(f"region {region.name}: truncated at {where[0]}:{where[1]}")
        for path in moved:
            print(f"  quarantined {path}")
    return 0
