"""``verify_topic``: the manifest against the objects it names."""

from __future__ import annotations

import dataclasses

from danube_ingest.metadata.kv import Put
from danube_ingest.objects.verify import verify_topic

from .test_reader import Setup, T


async def test_an_intact_topic_verifies_and_gaps_are_listed() -> None:
    setup = Setup()
    await setup.start()
    await setup.add_object("a", 0, 300)
    await setup.add_object("b", 400, 500)
    report = await verify_topic(setup.manifest, setup.objects, T, deep=True)
    assert report.problems == []
    assert (report.ranges, report.entries) == (2, 400)
    assert (report.first_offset, report.end_offset) == (0, 500)
    assert report.gaps == [(300, 400)]
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
