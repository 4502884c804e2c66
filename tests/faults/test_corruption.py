"""Mid-segment corruption: 64 bytes in the middle of a WAL segment are overwritten while the
daemon is down (SIGKILLed). It must be detected, never silently skipped: either the daemon
refuses to start naming the file (``WalCorruptionError``), or it serves the offsets before the
damage and stops there, naming the file in its log; a reader never receives an offset past
the damage without everything before it, and never a damaged payload."""

from __future__ import annotations

import asyncio

import pytest

from danube_ingest.testing import History, check
from tests.broker.test_both_clients import create_topic

from .conftest import BrokerFactory
from .harness import KINDS, Kind, Load, Reader, record

pytestmark = [pytest.mark.fault, pytest.mark.slow, pytest.mark.etcd]

TOPIC = "/default/corrupt"
MESSAGES = {"danube": 1500, "batch": 60_000}
DAMAGE = 64


@pytest.mark.parametrize("where", ["newest", "sealed"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(120)
async def test_mid_segment_corruption_is_detected_not_skipped(
    brokers: BrokerFactory, history: History, kind: Kind, where: str
) -> None:
    broker = brokers()
    await asyncio.to_thread(broker.start)
    await create_topic(broker.url, TOPIC)
    audit = Reader(kind, broker.url, TOPIC, "audit", history, name="audit")
    await audit.start()
    await audit.close()
    load = Load(kind, broker.url, TOPIC, history, "p1")
    await load.start()
    await load.wait_acked(MESSAGES[kind] // 2)
    await asyncio.sleep(2.5)  # the segment seals by age (2 s): a sealed and a newest one
    await load.wait_acked(MESSAGES[kind])
    await load.stop()
    broker.kill()
    segments = sorted(p for p in (broker.data_dir / "wal").rglob("*.wal") if p.stat().st_size)
    assert len(segments) >= 2, f"need a sealed segment and a newest one, got {segments}"
    target = segments[-1] if where == "newest" else segments[len(segments) // 2 - 1]
    size = target.stat().st_size
    with target.open("r+b") as f:
        f.seek(size // 2)
        original = f.read(DAMAGE)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in original))
    history.fault("corrupt", f"{target.name} at {size // 2}")

    try:
        await asyncio.to_thread(broker.start)
    except RuntimeError as exc:
        assert "WalCorruptionError" in str(exc) or "corrupt" in str(exc).lower(), exc
        assert target.name in broker.log_text(), "the refusal does not name the damaged file"
        record("mid-segment-corruption", kind, check(history), where=where, outcome="refused")
        return
    reader = Reader(kind, broker.url, TOPIC, "audit", history, name="audit")
    await reader.start()
    try:
        await reader.settle(quiet=2.0, timeout=30)
    finally:
        await reader.close()
    report = check(history, subscriptions=[(TOPIC, "audit")])
    assert report["skipped"] == 0 and report["non_monotonic"] == 0, report.summary()
    assert report["duplicated_writes"] == 0, report.summary()
    assert report["lost"], f"the damage in {target} was not noticed: everything was delivered"
    # Stopped at the damage: it must say where (the read path names the region directory and
    # the segment's number, recovery the file).
    log = broker.log_text()
    seq = int(target.stem)
    assert "WalCorruptionError" in log, log[-3000:]
    assert target.name in log or f"segment {seq} at byte" in log, log[-3000:]
    record(
        "mid-segment-corruption",
        kind,
        report,
        where=where,
        outcome=f"served {len(reader.offsets)} offsets, stopped at the damage",
    )
