"""``metadata.durable``: one transaction per interval per broker, only for ends that moved."""

from __future__ import annotations

from danube_ingest.metadata import KV, Keys
from danube_ingest.metadata.durable import DurableEndRecorder, read_durable_end


async def test_only_moved_ends_are_written_in_one_transaction(kv: KV, keys: Keys) -> None:
    ends = {"/default/a": (10, 1), "/default/b": (5, 2)}
    recorder = DurableEndRecorder(kv, keys, "broker-1", lambda: dict(ends), clock=lambda: 7.5)
    assert await recorder.flush() == 2
    assert recorder.writes == 1
    a = await read_durable_end(kv, keys, "/default/a", "broker-1")
    assert a is not None and (a.end, a.epoch, a.at_ms) == (10, 1, 7500)

    # Idle: nothing moved, nothing written.
    assert await recorder.flush() == 0
    assert recorder.writes == 1

    # One topic moved: one transaction holding that topic alone.
    ends["/default/b"] = (9, 2)
    stored_a = await kv.get(keys.storage_durable_end("/default/a", "broker-1"))
    assert await recorder.flush() == 1
    assert recorder.writes == 2
    assert await kv.get(keys.storage_durable_end("/default/a", "broker-1")) == stored_a
    b = await read_durable_end(kv, keys, "/default/b", "broker-1")
    assert b is not None and b.end == 9

    # Another broker's record of the same topic is its own key.
    assert await read_durable_end(kv, keys, "/default/a", "broker-2") is None

    # A topic no longer owned is dropped; owned again later, it is written again.
    del ends["/default/a"]
    assert await recorder.flush() == 0
    ends["/default/a"] = (10, 3)
    assert await recorder.flush() == 1
    a = await read_durable_end(kv, keys, "/default/a", "broker-1")
    assert a is not None and a.epoch == 3
