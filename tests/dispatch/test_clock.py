"""The clock contract, held by the event loop's clock and the manual one."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.dispatch import Clock, LoopClock, ManualClock


async def run_until(clock: Clock, when: float) -> None:
    if isinstance(clock, ManualClock):
        clock.advance(max(0.0, when - clock.now()))
    else:
        await asyncio.sleep(max(0.0, when - clock.now()) + 0.01)


@pytest.mark.parametrize("clock", [LoopClock(), ManualClock(100.0)], ids=["loop", "manual"])
async def test_timers_fire_in_time_order_and_cancel(clock: Clock) -> None:
    fired: list[str] = []
    start = clock.now()
    clock.call_at(start + 0.04, lambda: fired.append("late"))
    clock.call_at(start + 0.02, lambda: fired.append("early"))
    cancelled = clock.call_at(start + 0.03, lambda: fired.append("cancelled"))
    cancelled.cancel()
    cancelled.cancel()
    await run_until(clock, start + 0.025)
    assert fired == ["early"]
    await run_until(clock, start + 0.05)
    assert fired == ["early", "late"]
    assert clock.now() >= start + 0.05


def test_manual_clock_runs_callbacks_at_their_time() -> None:
    clock = ManualClock()
    seen: list[float] = []
    clock.call_at(1, lambda: seen.append(clock.now()))

    def schedule() -> None:
        clock.call_at(0.5, lambda: seen.append(clock.now()))

    clock.call_at(0, schedule)
    assert clock.pending == 2
    clock.advance(2)
    assert seen == [0.5, 1]
    assert clock.now() == 2
    with pytest.raises(ValueError):
        clock.advance(-1)
