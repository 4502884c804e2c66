"""``danube_ingest.aio``: waiting with a timeout never loses a task's cancellation.

Python 3.11's ``asyncio.wait_for`` does (python/cpython#86296): a background loop woken in
the same turn as it is cancelled carries on, and whoever stops it waits for ever. That is what
left a broker stuck in ``WalCleaner.stop`` at shutdown (its task stack showed the cleaner inside
``wait_for(self._wakeup.wait(), ...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from danube_ingest.aio import BackgroundLoop, wait_event
from danube_ingest.config.models import RetentionConfig
from danube_ingest.objects.cleaner import WalCleaner
from danube_ingest.store import TopicStore


async def _loop(event: asyncio.Event) -> None:
    while True:
        await wait_event(event, 10)
        event.clear()
        await asyncio.sleep(0)


async def test_wait_event_reports_set_and_timeout() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True
    assert await wait_event(event, None) is True


async def test_a_cancellation_arriving_with_the_wakeup_ends_the_loop() -> None:
    for _ in range(200):
        event = asyncio.Event()
        task = asyncio.create_task(_loop(event))
        await asyncio.sleep(0.001)
        event.set()  # the wake-up and the stop land in the same loop turn
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert done, "the loop swallowed its cancellation and never ended"
        assert task.cancelled()


async def test_cleaner_stops_when_woken_just_before(tmp_path: Path) -> None:
    store = await TopicStore.open(tmp_path / "wal", segment_seconds=3600)
    try:
        for _ in range(50):
            cleaner = WalCleaner(
                store,
                broker_id="b1",
                retention=RetentionConfig(),
                kv=None,
                keys=None,
                require_upload=False,
                prune_consumed=False,
                interval=3600,
            )
            cleaner.start()
            await asyncio.sleep(0.001)
            cleaner.wake()  # e.g. an upload finished just as the broker shuts down
            stopping = asyncio.ensure_future(cleaner.stop())
            done, _ = await asyncio.wait({stopping}, timeout=5)
            if not done:
                stopping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stopping
            assert done, "WalCleaner.stop hung: its loop lost the cancellation"
    finally:
        await store.close()


class _Ticker(BackgroundLoop):
    task_name = "ticker"

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.ended = 0

    async def _run(self) -> None:
        self.runs += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.ended += 1


async def test_background_loop_runs_one_task_from_start_to_stop() -> None:
    ticker = _Ticker()
    await ticker.stop()  # not started: nothing to stop
    ticker.start()
    ticker.start()  # already running: still one task
    await asyncio.sleep(0)
    assert [t.get_name() for t in asyncio.all_tasks()].count("ticker") == 1
    await ticker.stop()
    assert (ticker.runs, ticker.ended) == (1, 1), "stop returned before the task ended"
    assert "ticker" not in [t.get_name() for t in asyncio.all_tasks()]
    ticker.start()  # startable again after a stop
    await asyncio.sleep(0)
    await ticker.stop()
    assert (ticker.runs, ticker.ended) == (2, 2)


def test_the_daemon_does_not_use_asyncio_wait_for() -> None:
    """Every timed wait in the package goes through ``asyncio.timeout`` / ``wait_event``."""
    root = Path(__file__).resolve().parents[1] / "danube_ingest"
    users = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "aio.py" and "wait_for(" in path.read_text()
    ]
    assert users == [], f"asyncio.wait_for loses cancellations on Python 3.11: {users}"
