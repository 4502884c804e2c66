"""``TopicStore.adopt_producers``: a producer table handed over by a topic's previous owner is
in the WAL once the call returns (it survives a SIGKILL right after), and it answers re-sent
batches as duplicates with their original offsets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from danube_ingest.store import TopicStore
from danube_ingest.wal.block import IDEMPOTENT_BIT, BlockLimits, check_block, encode_block
from danube_ingest.wal.framing import Entry

TOPIC = "/default/adopted"
PID = IDEMPOTENT_BIT | 11
N = 50
LIMITS = BlockLimits(max_payload_bytes=1000, max_attributes=4)


async def append(store: TopicStore, pid: int, seq: int) -> tuple[range, bool]:
    block, sizes = encode_block([Entry(b"%d-%d" % (seq, i)) for i in range(N)])
    staged = store.append_block(TOPIC, check_block(bytearray(block), sizes, N, LIMITS), pid, seq)
    await staged.future
    return staged.offsets, staged.duplicate


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from danube_ingest.store import TopicStore

    async def main() -> None:
        store = await TopicStore.open(sys.argv[1], segment_seconds=600)
        await store.ensure_topic(%(topic)r, min_next_offset=500)
        table = {%(pid)d: [(seq, seq * 50, 50) for seq in range(10)]}
        await store.adopt_producers(%(topic)r, table)
        print("adopted", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


async def test_an_adopted_table_survives_a_sigkill_right_after(tmp_path: Path) -> None:
    script = CHILD % {"topic": TOPIC, "pid": PID}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", script, str(tmp_path / "wal")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout == "adopted\n", done.stderr
    assert done.returncode == -9
    store = await TopicStore.open(tmp_path / "wal", segment_seconds=600)
    try:
        assert await append(store, PID, 9) == (range(450, 500), True)
        assert await append(store, PID, 10) == (range(500, 550), False)
        assert store.producer_table(TOPIC, 550)[PID][-2:] == [(9, 450, 50), (10, 500, 50)]
    finally:
        await store.close()


async def test_adopting_replaces_the_table_and_an_empty_one_clears_it(tmp_path: Path) -> None:
    store = await TopicStore.open(tmp_path / "wal", segment_seconds=600)
    try:
        other = IDEMPOTENT_BIT | 12
        assert await append(store, other, 0) == (range(0, 50), False)
        await store.adopt_producers(TOPIC, {PID: [(3, 0, 50)]})
        assert store.producer_table(TOPIC, 50) == {PID: [(3, 0, 50)]}
        assert await append(store, PID, 3) == (range(0, 50), True)
        await store.adopt_producers(TOPIC, {})
        assert store.producer_table(TOPIC, 50) == {}
        # A producer the topic does not know may start at any sequence.
        assert await append(store, PID, 3) == (range(50, 100), False)
    finally:
        await store.close()
