"""``verify_topic``: the manifest against the objects it names."""

from __future__ import annotations

import dataclasses

from danube_ingest.metadata.jumps import record_jump
from danube_ingest.metadata.kv import Put
from danube_ingest.metadata.manifest import TopicFloor
from danube_ingest.objects.verify import verify_topic

from .test_reader import Setup, T


async def test_an_intact_topic_verifies_and_a_gap_is_a_problem_unless_a_jump_covers_it() -> None:
    setup = Setup()
    await setup.start()
    await setup.add_object("a", 0, 300)
    await setup.add_object("b", 400, 500)
    await setup.add_object("c", 600, 700)
    report = await verify_topic(setup.manifest, setup.objects, T, deep=True)
    assert (report.ranges, report.entries) == (3, 500)
    assert (report.first_offset, report.end_offset) == (0, 700)
    assert report.gaps == [(300, 400), (500, 600)]
    assert report.unexplained == [(300, 400), (500, 600)] and report.object_problems == []
    assert len(report.problems) == 2 and "offsets 300..399" in report.problems[0]
    assert "no recorded offset jump covers them" in report.problems[0]

    # A new owner's recorded jump covers the first gap whole, the second only in part.
    await record_jump(setup.ownership, T, 300, 400)
    await record_jump(setup.ownership, T, 500, 550)
    report = await verify_topic(setup.manifest, setup.objects, T, deep=True)
    assert report.gaps == [(300, 400), (500, 600)] and report.jumps == 2
    assert report.unexplained == [(550, 600)]
    [problem] = report.problems
    assert "offsets 550..599" in problem and "gap 500..599" in problem

    await record_jump(setup.ownership, T, 550, 600)
    report = await verify_topic(setup.manifest, setup.objects, T, deep=True)
    assert report.problems == [] and report.jumps == 3
    await setup.close()


async def test_the_first_range_must_start_at_the_floor_or_a_covered_jump() -> None:
    setup = Setup()
    await setup.start()
    await setup.add_object("late", 200, 300)
    report = await verify_topic(setup.manifest, setup.objects, T)
    assert report.unexplained == [(0, 200)] and "offsets 0..199" in report.problems[0]
    # Retention removed the ranges below 200: nothing below the floor is a gap.
    floor = TopicFloor(200, 1, "max_age")
    await setup.kv.txn([], [Put(setup.keys.topic_floor(T), floor.encode())])
    report = await verify_topic(setup.manifest, setup.objects, T)
    assert (report.floor, report.gaps, report.problems) == (200, [], [])
    # A floor in the middle of a gap: only what lies above it is one.
    floor = TopicFloor(150, 1, "max_age")
    await setup.kv.txn([], [Put(setup.keys.topic_floor(T), floor.encode())])
    report = await verify_topic(setup.manifest, setup.objects, T)
    assert report.gaps == report.unexplained == [(150, 200)]
    await setup.close()


async def test_every_disagreement_is_reported() -> None:
    setup = Setup()
    await setup.start()
    for name, start in (("missing", 0), ("resized", 100), ("flipped", 200), ("miscounted", 300)):
        await setup.add_object(name, start, start + 100)
    await setup.objects.delete("topics/default/rolled/missing.bin")
    resized = await setup.objects.get("topics/default/rolled/resized.bin")
    await setup.objects.put("topics/default/rolled/resized.bin", resized + b"x")
    flipped = bytearray(await setup.objects.get("topics/default/rolled/flipped.bin"))
    flipped[100] ^= 0xFF  # inside a frame: found by the object CRC
    await setup.objects.put("topics/default/rolled/flipped.bin", bytes(flipped))
    ranges = await setup.manifest.ranges(T)
    wrong = dataclasses.replace(ranges[3], entries=99)
    await setup.kv.txn([], [Put(setup.manifest.key(wrong), wrong.encode())])

    report = await verify_topic(setup.manifest, setup.objects, T)
    assert len(report.problems) == 4, report.problems
    missing, resized_p, flipped_p, miscounted = report.problems
    assert "missing.bin" in missing and "not found" in missing
    assert "bytes, the manifest says" in resized_p
    assert "CRC32C" in flipped_p
    assert "99" in miscounted
    await setup.close()
