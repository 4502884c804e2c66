"""What ``brokers forget`` and ``status`` say a lost takeover lost: up to the skipped range,
about what the lost broker's recorded durable end says (``cli.admin.lost_estimate``)."""

from __future__ import annotations

from danube_ingest.cli.admin import lost_estimate
from danube_ingest.metadata import Keys, MemoryKV
from danube_ingest.metadata.durable import DurableEnd
from danube_ingest.metadata.handover import LOST, Handover

T = "/default/t"


async def test_up_to_the_range_and_about_the_recorded_durable_end() -> None:
    kv, keys = MemoryKV(), Keys("/danube")
    record = Handover(
        T, "broker-a", reserved=1000, committed=100, owner="broker-b", epoch=3, state=LOST, end=1000
    )
    nothing = await lost_estimate(kv, keys, record)
    assert (nothing.at_most, nothing.about) == (900, None)
    assert nothing.text() == "up to 900 acknowledged messages lost"

    key = keys.storage_durable_end(T, "broker-a")
    await kv.put(key, DurableEnd(T, "broker-a", 160, 2, 1_700_000_000_000).encode())
    found = await lost_estimate(kv, keys, record)
    assert (found.at_most, found.about) == (900, 60)
    assert found.text().startswith(
        "up to 900 acknowledged messages lost; about 60 by the broker's last recorded durable "
        "end (160 at 2023-11-14 22:13:20 UTC;"
    ), found.text()

    # A record below the manifest's end is from an earlier tenure: it says nothing.
    await kv.put(key, DurableEnd(T, "broker-a", 50, 1, 1_600_000_000_000).encode())
    stale = await lost_estimate(kv, keys, record)
    assert (stale.at_most, stale.about) == (900, None)
