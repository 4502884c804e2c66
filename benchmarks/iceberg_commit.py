"""Iceberg commit latency of our publishes, and files per table per day before and after
maintenance, for a minute-wide table followed at the default 10 s tail step. Run:

    flock /tmp/danube-bench.lock .venv/bin/python benchmarks/iceberg_commit.py   # ~1.5-3 min

(``--minutes 6`` for a short run; ``--rate`` messages per simulated second, default 200.)

Setup, in a temporary directory: a local etcd (``LocalEtcd``), an fs object store, the SQLite
SQL catalog of a broker whose ``broker.data_dir`` is that directory (``IcebergTarget``), and
one topic ``/default/commits`` whose table is 60 s wide (``ensure_table(width_s=60)``, as
``tables convert --width-s 60`` makes it). The topic clock is driven in simulated time, the
way ``tests/analytics/test_tail.py`` drives it: for each 10 s window, one real ``.bin`` object
(``BinWriter``, zstd) of ``--rate`` x 10 entries with 100-byte payloads is written to the store,
then its manifest entry and the topic clock at the window's end to etcd. Then, as the two
sensors would (every code path real, nothing mocked):

* a **tail step**: ``extend_tail`` (one piece of the window under ``warehouse/_tails/``, one
  compare-and-swap of the tail record), then ``iceberg.publish`` (one append snapshot): what
  ``tail_round`` runs for one topic;
* once the clock has passed a partition's end (every sixth step), its **conversion**:
  ``convert`` on the local engine, then ``iceberg.publish`` (one overwrite snapshot: the
  partition's file replaces its six pieces). ``convert(iceberg=target)`` makes the same call
  at its end; it is called here separately so that it is timed alone.

Part 1, commit latency: every ``iceberg.publish`` above is timed (wall clock, and this
process's CPU time, ``time.process_time``: the publish's thread and the event loop; etcd's own
CPU is not in it). The table-creating first publish is reported apart. The baseline, in the
same run and interleaved with it (each of our commits is followed, or in odd rounds preceded,
by one baseline commit): plain pyiceberg ``Table.add_files`` of a copy of the same Parquet file
(same bytes, same size) into a table of the same schema, partition spec, sort order and
properties in the same SQLite catalog: one snapshot, the catalog and metadata cost of a commit
with nothing of ours around it. The baseline table is kept the shape of ours: before it takes
a partition file's copy, the copies of that partition's pieces leave it (an overwrite, not
timed). A round is one partition (six tail commits, one conversion commit, their baselines).
Reported: p50 / p99 over all commits, the median over rounds of each round's p50, and the
ratios ours / baseline of those medians, for tail and conversion commits apart; the p50 of
the first and of the last quarter of the rounds, and the least-squares slope of a commit's
time on the snapshots its table held (the cost follows the table's history); and,
after maintenance (part 2; the baseline's snapshots expired too), one more minute's commits.

Part 2, files: counted right after the last conversion (whole minutes, no open partition) and
again after ``iceberg.maintain`` with ``max_snapshot_age_s=0``, ``orphan_grace_s=0`` and
``tails`` (it expires every snapshot but the current one and deletes every piece no snapshot
or tail record holds), which runs after one more tail step (the next minute's first piece; it
drops the converted pieces from the tail record, as the sensor's next tick does): data files
in the current snapshot, data files under the warehouse (partition files and ``_tails/``
pieces), the table's metadata files (``*.metadata.json``, manifest lists, manifests),
snapshots, the size of the current metadata.json. Per day: each count that grows with ingest
time is scaled by 1,440 / the minutes driven (linear: the same steps repeat every minute); the
metadata.json versions (capped at 21 by the table property) and, after maintenance, the open
minute's pieces, the one snapshot and its manifest list are not scaled.

Memory: bounded by one window's entries (``--rate`` x 10) and one partition's rows while it is
converted, plus two floats per commit; the etcd manifest grows by one entry per simulated 10 s
(``--minutes`` x 6 entries, all read by each step); pyiceberg holds one table's metadata.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from _common import bench_dir, cpu_pressure, emit, machine, median, percentile, say, warn_if_busy

TOPIC = "/default/commits"
ROOT = "warehouse/"
WIDTH_S = 60
STEP_S = 10
PAYLOAD = 100
DAY_S = 86_400
BASELINE = ("bench", "baseline")


@dataclass
class Timings:
    """Wall and CPU seconds of one kind of commit, per round."""

    wall: list[list[float]] = field(default_factory=list)
    cpu: list[list[float]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    """The table's snapshots before each commit (all rounds)."""

    def new_round(self) -> None:
        self.wall.append([])
        self.cpu.append([])

    def add(self, wall: float, cpu: float, held: int) -> None:
        self.wall[-1].append(wall)
        self.cpu[-1].append(cpu)
        self.held.append(held)

    def all_wall(self) -> list[float]:
        return [v for r in self.wall for v in r]

    def all_cpu(self) -> list[float]:
        return [v for r in self.cpu for v in r]

    def round_p50(self, rounds: slice = slice(None)) -> float:
        """Median over ``rounds`` of each round's median wall time."""
        return median([median(r) for r in self.wall[rounds] if r])

    def summary(self) -> dict[str, Any]:
        walls, cpus = self.all_wall(), self.all_cpu()
        quarter = max(1, len(self.wall) // 4)
        return {
            "commits": len(walls),
            "p50_ms": percentile(walls, 50) * 1000,
            "p99_ms": percentile(walls, 99) * 1000,
            "max_ms": max(walls, default=float("nan")) * 1000,
            "round_median_p50_ms": self.round_p50() * 1000,
            "first_quarter_p50_ms": self.round_p50(slice(0, quarter)) * 1000,
            "last_quarter_p50_ms": self.round_p50(slice(-quarter, None)) * 1000,
            "cpu_p50_ms": percentile(cpus, 50) * 1000,
            "cpu_total_s": sum(cpus),
            # Least squares of wall time on the snapshots the table held before the commit
            # (its manifests grow with them: one per partition, i.e. per 7 snapshots).
            "ms_per_100_snapshots": (
                statistics.linear_regression(self.held, walls).slope * 100 * 1000
                if len(set(self.held)) > 1
                else float("nan")
            ),
        }


async def timed(call: Callable[[], Awaitable[Any]], into: Timings, held: int) -> Any:
    """``call()`` awaited, its wall and CPU time added to ``into`` (``held``: the table's
    snapshots before it)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result = await call()
    into.add(time.perf_counter() - wall0, time.process_time() - cpu0, held)
    return result


class Topic:
    """The simulated topic: a real ``.bin`` object, manifest entry and clock per window."""

    def __init__(self, kv: Any, keys: Any, store: Any, rate: int, base_ms: int) -> None:
        self.kv, self.keys, self.store = kv, keys, store
        self.rate, self.base_ms = rate, base_ms
        self.offset = 0
        self.now_ms = base_ms

    async def advance(self) -> None:
        """One window of ``STEP_S`` seconds: its object, manifest entry, then the clock."""
        import crc32c

        from danube_ingest.metadata.clock import TopicClock
        from danube_ingest.metadata.manifest import ObjectRange
        from danube_ingest.objects.binfmt import BinWriter
        from danube_ingest.wal.framing import Entry

        count = self.rate * STEP_S
        start, end_ms = self.offset, self.now_ms + STEP_S * 1000
        entries = []
        for i in range(count):
            at = self.now_ms + i * STEP_S * 1000 // count
            entry = Entry(
                f"{start + i:012d}".encode().ljust(PAYLOAD, b"."),
                producer_name="bench",
                publish_ms=at - 2,
            )
            entry.offset, entry.ingest_ms = start + i, at
            entries.append(entry)
        writer = BinWriter("zstd", frame_target_bytes=64 * 1024)
        writer.add_entries(TOPIC, entries)
        data = writer.finish()
        span = writer.footer.topics[TOPIC]
        key = f"topics/default/commits/{start:020d}.bin"
        await self.store.put(key, data)
        entry_range = ObjectRange(
            topic=TOPIC,
            object_key=key,
            start_offset=start,
            end_offset=start + count,
            entries=count,
            byte_start=span.position,
            byte_length=span.length,
            object_size=len(data),
            object_crc=crc32c.crc32c(data),
            first_ingest_ms=entries[0].ingest_ms,
            last_ingest_ms=entries[-1].ingest_ms,
            kind="topic",
            broker="b1",
            epoch=1,
        )
        await self.kv.put(self.keys.storage_object(TOPIC, start), entry_range.encode())
        self.offset, self.now_ms = start + count, end_ms
        clock = TopicClock(offset=self.offset, ingest_ms=end_ms, broker="b1", epoch=1)
        await self.kv.put(self.keys.topic_clock(TOPIC), clock.encode())


class Baseline:
    """Plain pyiceberg ``add_files`` into a table shaped like ours, in the same catalog."""

    def __init__(self, catalog: Any, ours: Any, directory: Path) -> None:
        from pyiceberg.exceptions import NamespaceAlreadyExistsError

        self.catalog, self.directory = catalog, directory
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(NamespaceAlreadyExistsError):
            catalog.create_namespace(BASELINE[0])
        self.table = catalog.create_table(
            BASELINE,
            schema=ours.schema(),
            partition_spec=ours.spec(),
            sort_order=ours.sort_order(),
            properties=dict(ours.properties),
        )
        self.copies = 0
        self.snapshots = 0
        self.pieces: list[str] = []

    def copy(self, source: Path) -> str:
        """A copy of ``source`` (not timed); its URI."""
        self.copies += 1
        target = self.directory / f"copy-{self.copies:06d}.parquet"
        shutil.copyfile(source, target)
        return f"file://{target}"

    async def add(self, uri: str) -> None:
        """The measured commit: one ``add_files`` snapshot (pyiceberg is synchronous; run in
        a thread as ``publish`` runs its commit)."""

        def commit() -> None:
            self.table = self.catalog.load_table(BASELINE)
            self.table.add_files([uri])

        await asyncio.to_thread(commit)
        self.snapshots += 1

    def expire(self) -> None:
        """Every snapshot but the current one expired (not timed), as ``maintain`` does."""
        table = self.catalog.load_table(BASELINE)
        current = table.current_snapshot()
        assert current is not None
        keep = current.snapshot_id
        ids = [s.snapshot_id for s in table.metadata.snapshots if s.snapshot_id != keep]
        if ids:
            table.maintenance.expire_snapshots().by_ids(ids).commit()
        self.snapshots = 1

    def drop_pieces(self) -> None:
        """Remove the copies of the pieces (not timed): the table keeps ours' shape."""
        table = self.catalog.load_table(BASELINE)
        gone = set(self.pieces)
        files = [t.file for t in table.scan().plan_files() if t.file.file_path in gone]
        if files:
            tx = table.transaction()
            with tx.update_snapshot().overwrite() as update:
                for data_file in files:
                    update.delete_data_file(data_file)
            tx.commit_transaction()
            self.snapshots += 1
        for uri in self.pieces:
            Path(uri[len("file://") :]).unlink(missing_ok=True)
        self.pieces = []


def count_files(target: Any, objects: Path) -> dict[str, int]:
    """Data and metadata files of the topic's table, on storage and in the catalog."""
    from danube_ingest.analytics.iceberg import identifier

    table = target.catalog().load_table(identifier(TOPIC))
    warehouse = objects / ROOT
    parquet = list(warehouse.rglob("*.parquet"))
    pieces = [p for p in parquet if (warehouse / "_tails") in p.parents]
    location = Path(table.location().removeprefix("file://"))
    metadata = [p for p in (location / "metadata").rglob("*") if p.is_file()]
    versions = [p for p in metadata if p.name.endswith(".metadata.json")]
    lists = [p for p in metadata if p.name.startswith("snap-")]
    snapshot = table.current_snapshot()
    current = [t.file.file_path for t in table.scan().plan_files()]
    return {
        "current_data_files": len(current),
        "current_pieces": sum(f"/{ROOT}_tails/" in path for path in current),
        "current_manifests": 0 if snapshot is None else len(snapshot.manifests(table.io)),
        "storage_data_files": len(parquet),
        "storage_pieces": len(pieces),
        "storage_partition_files": len(parquet) - len(pieces),
        "metadata_files": len(metadata),
        "metadata_versions": len(versions),
        "manifest_lists": len(lists),
        "manifests": len(metadata) - len(versions) - len(lists),
        "snapshots": len(table.metadata.snapshots),
        "metadata_json_bytes": Path(table.metadata_location.removeprefix("file://")).stat().st_size,
    }


#: Counts that do not grow with ingest time: metadata.json versions are capped by the table
#: property (20 previous + the current one); after maintenance, what the open partition and
#: the one remaining snapshot make.
CAPPED = {"metadata_versions"}
CONSTANT_AFTER = CAPPED | {
    "current_pieces",
    "storage_pieces",
    "snapshots",
    "manifest_lists",
    "metadata_json_bytes",
}


def per_day(counts: dict[str, int], partitions: int, constant: set[str]) -> dict[str, int]:
    """``counts`` after ``partitions`` minute partitions of ingest, extrapolated to a day of
    1,440: each count that grows with ingest time is scaled by 1,440 / ``partitions``
    (linear: the same steps repeat every minute), ``constant`` ones stay, and the totals are
    the sums of their parts."""
    scale = DAY_S / WIDTH_S / partitions
    day = {k: v if k in constant else round(v * scale) for k, v in counts.items()}
    day["current_data_files"] = day["storage_partition_files"] + day["current_pieces"]
    day["storage_data_files"] = day["storage_partition_files"] + day["storage_pieces"]
    day["metadata_files"] = day["metadata_versions"] + day["manifest_lists"] + day["manifests"]
    return day


async def drive(args: argparse.Namespace, work: Path, endpoint: str) -> dict[str, Any]:
    from danube_ingest.analytics.convert import convert, ensure_table
    from danube_ingest.analytics.iceberg import IcebergTarget, identifier, maintain, publish
    from danube_ingest.analytics.tail import extend_tail, read_tail
    from danube_ingest.config import load_config
    from danube_ingest.metadata import EtcdKV, Keys
    from danube_ingest.metadata.records import Records, TopicRecord
    from danube_ingest.objects.store import ObjectStore

    objects = work / "objects"
    config = load_config(None, {"broker.data_dir": str(work), "storage.cloud.root": str(objects)})
    target = IcebergTarget.from_config(config)
    assert target is not None
    kv = await EtcdKV.connect([endpoint], timeout=5.0)
    keys = Keys("/danube-commit")
    store = ObjectStore("fs", options={"root": str(objects)})
    hour_ms = 3_600_000
    base_ms = (time.time_ns() // 1_000_000) // hour_ms * hour_ms - 24 * hour_ms
    topic = Topic(kv, keys, store, args.rate, base_ms)
    tail_t, convert_t = Timings(), Timings()
    tail_b, convert_b = Timings(), Timings()
    creating, extra = Timings(), Timings()
    post_t, post_b = Timings(), Timings()
    steps: list[float] = []
    conversions: list[float] = []
    holder: list[Baseline] = []
    stepped = [False]  # the first window is written before the table exists
    held = [0]  # our table's snapshots

    async def tail_commit(ours_t: Timings, base_t: Timings, ours_first: bool) -> None:
        """One tail step: the next window, ``extend_tail``, then our publish and the
        baseline's commit of the same piece, both timed."""
        if stepped[0]:
            await topic.advance()
        stepped[0] = True
        wall0 = time.perf_counter()
        step = await extend_tail(kv, keys, TOPIC, store, store, root=ROOT, step_s=STEP_S)
        steps.append(time.perf_counter() - wall0)
        assert step is not None and step.recorded and step.added == 1, step
        tail, _ = await read_tail(kv, keys, TOPIC)
        assert tail is not None and tail.pieces[-1].files
        piece = objects / tail.pieces[-1].files[0].path

        async def ours(into: Timings) -> None:
            done = await timed(lambda: publish(kv, keys, TOPIC, target), into, held[0])
            assert done is not None and done.snapshot_id is not None, done
            held[0] += 1

        if not holder:
            # The first publish creates our table (not a steady-state commit: timed apart);
            # the baseline table copies its schema, spec and properties.
            creating.new_round()
            await ours(creating)
            table = target.catalog().load_table(identifier(TOPIC))
            holder.append(Baseline(target.catalog(), table, objects / "bench-baseline"))
            uri = holder[0].copy(piece)
            await holder[0].add(uri)
        else:
            uri = holder[0].copy(piece)
            base = holder[0]
            pair = [ours(ours_t), timed(partial(base.add, uri), base_t, base.snapshots)]
            for call in pair if ours_first else reversed(pair):
                await call
        holder[0].pieces.append(uri)

    async def conversion(ours_t: Timings, base_t: Timings, ours_first: bool) -> None:
        """The complete partition converted, then our publish (the overwrite) and the
        baseline's commit of the same file, both timed."""
        wall0 = time.perf_counter()
        result = await convert(
            kv=kv, keys=keys, objects=store, warehouse=store, topic=TOPIC, root=ROOT
        )
        conversions.append(time.perf_counter() - wall0)
        assert len(result.partitions) == 1, result
        baseline = holder[0]
        baseline.drop_pieces()
        uri = baseline.copy(objects / result.partitions[0].files[0])

        async def ours() -> None:
            done = await timed(lambda: publish(kv, keys, TOPIC, target), ours_t, held[0])
            assert done is not None and (done.added, done.removed) == (1, 6), done
            held[0] += 1

        pair = [ours(), timed(partial(baseline.add, uri), base_t, baseline.snapshots)]
        for call in pair if ours_first else reversed(pair):
            await call

    rounds = args.minutes
    per_partition = WIDTH_S // STEP_S
    try:
        await Records(kv, keys).create_topic_if_absent(TopicRecord(TOPIC))
        await topic.advance()  # the first window, so the table starts at the topic's start
        await ensure_table(kv, keys, TOPIC, width_s=WIDTH_S)
        say(
            f"driving {rounds} simulated minutes of {TOPIC} ({args.rate} msg/s, {WIDTH_S} s "
            f"partitions, {STEP_S} s tail step); each commit timed with a baseline add_files"
        )
        began = time.perf_counter()
        for number in range(rounds):
            ours_first = number % 2 == 0
            for timings in (tail_t, convert_t, tail_b, convert_b):
                timings.new_round()
            for _ in range(per_partition):
                await tail_commit(tail_t, tail_b, ours_first)
            await conversion(convert_t, convert_b, ours_first)
            if (number + 1) % 5 == 0:
                say(
                    f"  {number + 1} minutes in {time.perf_counter() - began:.0f} s: tail "
                    f"publish p50 {median(tail_t.wall[-1]) * 1000:.0f} ms (baseline "
                    f"{median(tail_b.wall[-1]) * 1000:.0f}), conversion publish "
                    f"{convert_t.wall[-1][0] * 1000:.0f} ms (baseline "
                    f"{convert_b.wall[-1][0] * 1000:.0f})"
                )
        drive_s = time.perf_counter() - began
        simulated_s = (topic.now_ms - base_ms) / 1000
        before = count_files(target, objects)  # whole minutes: no piece of an open one
        # The first step of the next minute drops the converted partition's pieces from the
        # tail record (as the sensor's next tick does): the record then lists only what the
        # current snapshot holds. Not in the latency figures.
        extra.new_round()
        await tail_commit(extra, extra, True)
        wall0 = time.perf_counter()
        maintained = await maintain(
            target, TOPIC, max_snapshot_age_s=0, orphan_grace_s=0, tails=(kv, keys, ROOT)
        )
        maintain_s = time.perf_counter() - wall0
        assert maintained is not None
        held[0] = 1
        after = count_files(target, objects)
        # After maintenance (the baseline's snapshots expired too, not timed): the rest of
        # the open minute and its conversion, timed the same way.
        holder[0].expire()
        for timings in (post_t, post_b):
            timings.new_round()
        for _ in range(per_partition - 1):
            await tail_commit(post_t, post_b, True)
        post_convert, post_convert_b = Timings(), Timings()
        post_convert.new_round()
        post_convert_b.new_round()
        await conversion(post_convert, post_convert_b, True)
        partitions = rounds
    finally:
        await store.close()
        await kv.close()
    return {
        "tail": tail_t.summary(),
        "tail_baseline": tail_b.summary(),
        "conversion": convert_t.summary(),
        "conversion_baseline": convert_b.summary(),
        "create_publish_ms": creating.wall[0][0] * 1000,
        "extend_tail_p50_ms": median(steps) * 1000,
        "convert_p50_ms": median(conversions) * 1000,
        "drive_s": drive_s,
        "after_maintenance": {
            "tail_p50_ms": median(post_t.all_wall()) * 1000,
            "tail_baseline_p50_ms": median(post_b.all_wall()) * 1000,
            "conversion_ms": post_convert.wall[0][0] * 1000,
            "conversion_baseline_ms": post_convert_b.wall[0][0] * 1000,
        },
        "simulated_s": simulated_s,
        "partitions": partitions,
        "before": before,
        "after": after,
        "maintain_s": maintain_s,
        "maintained": {
            "snapshots_expired": maintained.snapshots_expired,
            "files_deleted": maintained.files_deleted,
            "bytes_deleted": maintained.bytes_deleted,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=int, default=30, help="simulated minutes (rounds)")
    parser.add_argument("--rate", type=int, default=200, help="messages per simulated second")
    args = parser.parse_args()
    if args.minutes < 4:
        parser.error("--minutes must be at least 4")
    from danube_ingest.testing import LocalEtcd

    pressure_before = cpu_pressure()
    load_start = warn_if_busy("start")
    with bench_dir("iceberg-commit") as work, LocalEtcd() as etcd:
        got = asyncio.run(drive(args, work, etcd.endpoint))
    load_end = warn_if_busy("end")
    tail, tail_b = got["tail"], got["tail_baseline"]
    conv, conv_b = got["conversion"], got["conversion_baseline"]
    tail_ratio = tail["round_median_p50_ms"] / tail_b["round_median_p50_ms"]
    conv_ratio = conv["round_median_p50_ms"] / conv_b["round_median_p50_ms"]
    say(
        f"tail publish (append, 1 piece): p50 {tail['p50_ms']:.1f} ms, p99 "
        f"{tail['p99_ms']:.1f} ms, CPU p50 {tail['cpu_p50_ms']:.1f} ms over {tail['commits']} "
        f"commits; baseline add_files p50 {tail_b['p50_ms']:.1f} ms, p99 "
        f"{tail_b['p99_ms']:.1f} ms, CPU p50 {tail_b['cpu_p50_ms']:.1f} ms; ratio of the "
        f"median-of-rounds p50s {tail_ratio:.2f}"
    )
    say(
        f"conversion publish (overwrite, 6 pieces -> 1 file): p50 {conv['p50_ms']:.1f} ms, p99 "
        f"{conv['p99_ms']:.1f} ms, CPU p50 {conv['cpu_p50_ms']:.1f} ms over "
        f"{conv['commits']} commits; baseline add_files p50 {conv_b['p50_ms']:.1f} ms, p99 "
        f"{conv_b['p99_ms']:.1f} ms, CPU p50 {conv_b['cpu_p50_ms']:.1f} ms; ratio "
        f"{conv_ratio:.2f}"
    )
    say(
        f"growth with the table's history: tail publish p50 first quarter of the rounds "
        f"{tail['first_quarter_p50_ms']:.1f} ms, last quarter {tail['last_quarter_p50_ms']:.1f} "
        f"ms (baseline {tail_b['first_quarter_p50_ms']:.1f} -> "
        f"{tail_b['last_quarter_p50_ms']:.1f}); conversion {conv['first_quarter_p50_ms']:.1f} "
        f"-> {conv['last_quarter_p50_ms']:.1f} ms; least squares: tail publish +"
        f"{tail['ms_per_100_snapshots']:.0f} ms per 100 snapshots held (baseline +"
        f"{tail_b['ms_per_100_snapshots']:.0f}), conversion +"
        f"{conv['ms_per_100_snapshots']:.0f}"
    )
    say(
        f"context: the first publish (creating the table) {got['create_publish_ms']:.0f} ms; "
        f"extend_tail p50 {got['extend_tail_p50_ms']:.1f} ms; convert (without its publish) "
        f"p50 {got['convert_p50_ms']:.1f} ms"
    )
    post = got["after_maintenance"]
    say(
        f"after maintenance (1 snapshot left, the manifests stay): tail publish p50 "
        f"{post['tail_p50_ms']:.1f} ms (baseline {post['tail_baseline_p50_ms']:.1f}), "
        f"conversion publish {post['conversion_ms']:.1f} ms (baseline "
        f"{post['conversion_baseline_ms']:.1f})"
    )
    partitions = got["partitions"]
    before, after = got["before"], got["after"]
    say(f"files after {partitions} simulated minutes ({partitions} partitions converted):")
    for name in before:
        say(f"  {name:24s} before {before[name]:>10,}  after maintain {after[name]:>10,}")
    day_before = per_day(before, partitions, CAPPED)
    day_after = per_day(after, partitions, CONSTANT_AFTER)
    per_partition = after["storage_partition_files"] / partitions
    say(
        f"per day (x {DAY_S / WIDTH_S / partitions:.0f}): data files on storage "
        f"{day_before['storage_data_files']:,} before maintenance, "
        f"{day_after['storage_data_files']:,} after ({per_partition:.2f} per partition, plus "
        f"{after['storage_pieces']} piece(s) of the open one); snapshots "
        f"{day_before['snapshots']:,} -> {after['snapshots']}; metadata files "
        f"{day_before['metadata_files']:,} -> {day_after['metadata_files']:,}; maintain took "
        f"{got['maintain_s']:.2f} s"
    )
    emit(
        {
            "benchmark": "iceberg_commit",
            "value": tail["round_median_p50_ms"],
            "unit": "ms",
            "baseline": tail_b["round_median_p50_ms"],
            "ratio": tail_ratio,
            "ratio_meaning": (
                "tail-step iceberg.publish p50 / plain pyiceberg add_files of the same file "
                "p50 (median over rounds; same catalog, same table shape)"
            ),
            "conversion_ratio": conv_ratio,
            "tail": tail,
            "tail_baseline": tail_b,
            "conversion": conv,
            "conversion_baseline": conv_b,
            "create_publish_ms": got["create_publish_ms"],
            "extend_tail_p50_ms": got["extend_tail_p50_ms"],
            "convert_p50_ms": got["convert_p50_ms"],
            "rate": args.rate,
            "simulated_s": got["simulated_s"],
            "partitions": partitions,
            "drive_s": got["drive_s"],
            "files_before": before,
            "files_after": after,
            "files_per_day_before": day_before,
            "files_per_day_after": day_after,
            "data_files_per_partition_after": per_partition,
            "after_maintenance": post,
            "maintain_s": got["maintain_s"],
            "maintained": got["maintained"],
            "cpu_pressure_before": pressure_before,
            "cpu_pressure_after": cpu_pressure(),
            "load_start": load_start,
            "load_end": load_end,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
