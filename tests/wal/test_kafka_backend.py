"""The Kafka backend's own promises (the shared ones are in ``test_backend_contract.py``):
Kafka alone is the durable copy, a second tenure fences the first, deletion is two steps
(snapshot, then DeleteRecords) and a crash between them is harmless, and settings that would
lose data are refused. Against a real single-node KRaft Kafka (the session's ``kafka_server``).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from danube_ingest.errors import ConfigError, WalFailedError
from danube_ingest.wal import Entry, RegionLog
from danube_ingest.wal.kafka import KafkaBackend, KafkaWal, KafkaWalError
from danube_ingest.wal.kafka import backend as kafka_backend
from danube_ingest.wal.kafka.topics import read_topic

pytestmark = pytest.mark.kafka

TOPIC = "/ns/t"
ANSWER = 20.0


def _settings(kafka_server: str, **options: object) -> KafkaWal:
    options.setdefault("replication_factor", 1)
    return KafkaWal(kafka_server, wal=f"test-{uuid.uuid4().hex[:12]}", **options)  # type: ignore[arg-type]


async def _payloads(log: RegionLog, topic: str = TOPIC) -> list[tuple[int, bytes]]:
    from tests.wal.test_backend_contract import stored

    return (await stored(log)).get(topic, [])


def _low_watermark(kafka_server: str, topic: str) -> int:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": kafka_server, "group.id": "wm", "log_level": 0})
    try:
        low, _high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        return int(low)
    finally:
        consumer.close()


async def test_kafka_alone_recovers_the_region_after_its_cache_is_deleted(
    kafka_server: str, tmp_path: Path
) -> None:
    """Appends acknowledged, the process gone without closing, the cache directory deleted:
    a new tenure rebuilds every acknowledged entry from Kafka and continues the offsets."""
    settings = _settings(kafka_server)
    log = await RegionLog.open(tmp_path / "r0", kafka=settings, segment_bytes=64 * 1024)
    entries = [Entry(b"m%05d" % i + b"x" * 200) for i in range(2000)]
    for start in range(0, 2000, 100):
        await asyncio.wait_for(log.stage_batch(TOPIC, entries[start : start + 100]), ANSWER)
    assert len(log.sealed) >= 3, "the entries span several segments"
    # No close(): like a SIGKILL, nothing is written after the last acknowledgement.
    shutil.rmtree(tmp_path / "r0")

    again = await RegionLog.open(tmp_path / "r0", kafka=settings, segment_bytes=64 * 1024)
    try:
        assert await _payloads(again) == [(i, bytes(e.payload)) for i, e in enumerate(entries)]
        after = Entry(b"after")
        again.stage(TOPIC, after)
        assert await asyncio.wait_for(after, ANSWER) == 2000
    finally:
        await again.close()


@pytest.mark.parametrize("commits", [1, 2])
async def test_a_second_tenure_fences_the_first(
    kafka_server: str, tmp_path: Path, commits: int
) -> None:
    """Two processes opening one region (a paused owner and its successor): once the second
    has opened it, the first acknowledges nothing more (its appends fail), and the second
    holds everything the first acknowledged. The writer takes the region's transactional ids
    in turn, so 1 and 2 commits before the successor leave the late append to each id."""
    settings = _settings(kafka_server)
    first = await RegionLog.open(tmp_path / "a" / "r0", kafka=settings)
    acked = [Entry(b"before-%d" % i) for i in range(50)]
    for part in range(commits):
        await asyncio.wait_for(first.stage_batch(TOPIC, acked[part::commits]), ANSWER)
    acked = [entry for part in range(commits) for entry in acked[part::commits]]

    second = await RegionLog.open(tmp_path / "b" / "r0", kafka=settings)
    try:
        late = Entry(b"from-the-fenced-one")
        first.stage(TOPIC, late)
        with pytest.raises(WalFailedError, match=r"(?i)fenc"):
            await asyncio.wait_for(late, ANSWER)
        assert await _payloads(second) == [(i, e.payload) for i, e in enumerate(acked)]
        nxt = Entry(b"next")
        second.stage(TOPIC, nxt)
        assert await asyncio.wait_for(nxt, ANSWER) == 50
    finally:
        await second.close()
        await first.close()
    third = await RegionLog.open(tmp_path / "c" / "r0", kafka=settings)
    try:
        found = await _payloads(third)
        assert b"from-the-fenced-one" not in [payload for _, payload in found]
        assert found[-1] == (50, b"next")
    finally:
        await third.close()


async def _filled(log: RegionLog, rounds: int) -> None:
    for round_no in range(rounds):
        batch = [Entry(b"%d-%d" % (round_no, i)) for i in range(5)]
        await asyncio.wait_for(log.stage_batch(TOPIC, batch), ANSWER)
        log.rotate()
    await asyncio.wait_for(log.stage_batch(TOPIC, [Entry(b"active")]), ANSWER)


async def test_deletion_is_a_snapshot_then_delete_records(
    kafka_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted segments leave Kafka only after a snapshot recording them gone is committed;
    a crash between the snapshot and DeleteRecords (simulated: DeleteRecords never runs) is
    harmless: the next tenure skips those records, and its next deletion removes them."""
    settings = _settings(kafka_server)
    names = settings.region("r0")
    log = await RegionLog.open(tmp_path / "r0", kafka=settings, segment_seconds=3600)
    await _filled(log, 3)
    doomed = sorted(log.sealed)[:-1]  # every sealed segment but the newest
    for seq in doomed:
        log.mark_uploaded(seq)
        await asyncio.wait_for(log.delete_segment(seq), ANSWER)
    assert _low_watermark(kafka_server, names.data) == 0, "nothing removed before a snapshot"

    calls: list[int] = []
    monkeypatch.setattr(kafka_backend, "delete_below", lambda *args: calls.append(args[2]))
    await log.snapshot_now()
    assert calls, "DeleteRecords is asked for once the snapshot is committed"
    assert _low_watermark(kafka_server, names.data) == 0  # ... and "crashed" before it ran
    # No close: the crash. The next tenure skips the deleted segments' records.
    monkeypatch.undo()
    again = await RegionLog.open(tmp_path / "r0b", kafka=settings, segment_seconds=3600)
    try:
        backend = again._backend
        assert isinstance(backend, KafkaBackend)
        assert not set(doomed) & set(backend.cached_segments())
        assert await _payloads(again) == [(10 + i, b"2-%d" % i) for i in range(5)] + [
            (15, b"active")
        ]
        topic = again.topic(TOPIC)
        assert topic is not None and topic.first_offset == 10
        # Its next deletion (with a snapshot) removes the old records too.
        oldest = min(again.sealed)
        again.mark_uploaded(oldest)
        await asyncio.wait_for(again.delete_segment(oldest), ANSWER)
        await again.snapshot_now()
        assert _low_watermark(kafka_server, names.data) > 0
        assert await _payloads(again) == [(15, b"active")]
    finally:
        await again.close()
    # And what is left in Kafka is exactly what a third tenure needs.
    third = await RegionLog.open(tmp_path / "r0c", kafka=settings, segment_seconds=3600)
    try:
        assert await _payloads(third) == [(15, b"active")]
    finally:
        await third.close()


def test_a_replication_factor_the_cluster_cannot_hold_is_refused_unless_explicit(
    kafka_server: str, tmp_path: Path
) -> None:
    settings = KafkaWal(kafka_server, wal=f"rf-{uuid.uuid4().hex[:8]}")
    assert settings.replicas == 3
    with pytest.raises(KafkaWalError, match=r"1 broker.*replication factor 3.*explicitly"):
        asyncio.run(RegionLog.open(tmp_path / "r0", kafka=settings))
    admin = AdminClient({"bootstrap.servers": kafka_server, "log_level": 0})
    assert settings.region("r0").data not in admin.list_topics(timeout=10).topics


def test_wal_topics_with_retention_are_refused(kafka_server: str, tmp_path: Path) -> None:
    """Kafka deleting by size or age would lose acknowledged entries not uploaded yet."""
    settings = _settings(kafka_server)
    names = settings.region("r0")
    admin = AdminClient({"bootstrap.servers": kafka_server, "log_level": 0})
    made = admin.create_topics(
        [
            NewTopic(
                names.data, 1, 1, config={"retention.ms": "-1", "retention.bytes": "1073741824"}
            ),
            NewTopic(names.meta, 1, 1, config={"retention.ms": "-1", "retention.bytes": "-1"}),
        ]
    )
    for future in made.values():
        future.result(30)
    with pytest.raises(KafkaWalError, match=r"retention\.bytes=1073741824"):
        asyncio.run(RegionLog.open(tmp_path / "r0", kafka=settings))
    config = admin.describe_configs([ConfigResource("topic", names.data)])
    for future in config.values():
        assert future.result(30)["retention.bytes"].value == "1073741824"  # left as it was


def test_settings_that_would_break_durability_are_refused(kafka_server: str) -> None:
    with pytest.raises(ConfigError, match=r"client\.acks"):
        KafkaWal(kafka_server, wal="w", client={"acks": "1"})
    with pytest.raises(ConfigError, match="min_insync_replicas"):
        KafkaWal(kafka_server, wal="w", replication_factor=1, min_insync_replicas=2)
    with pytest.raises(ConfigError, match="bootstrap_servers"):
        KafkaWal(" ", wal="w")


def test_each_region_has_its_own_transactional_ids() -> None:
    """A region writes through two transactional ids in turn (see ``TRANSACTIONAL_PRODUCERS``);
    no id of one region is an id of another, whatever the region names."""
    settings = KafkaWal("127.0.0.1:1", wal="w")
    regions = ["r0", "r0/2", "r0.2", "r0_2", "r"]
    ids = [tid for region in regions for tid in settings.region(region).transactional_ids]
    assert settings.region("r0").transactional_ids == ("danube-wal.w.r0", "danube-wal.w.r0/2")
    assert len(ids) == len(set(ids)) == 2 * len(regions)


def test_the_region_is_read_back_committed_only(kafka_server: str, tmp_path: Path) -> None:
    """What recovery reads is the committed records (a fenced writer's are never read)."""

    async def write() -> str:
        settings = _settings(kafka_server)
        log = await RegionLog.open(tmp_path / "r0", kafka=settings)
        await asyncio.wait_for(log.stage_batch(TOPIC, [Entry(b"x")]), ANSWER)
        await log.close()
        return settings.region("r0").data

    data = asyncio.run(write())
    settings = KafkaWal(kafka_server, wal="reader", replication_factor=1)
    records = list(read_topic(settings, data, group="t"))
    assert records and all(message.error() is None for message in records)


async def test_a_crash_during_recovery_is_repaired_by_the_next(
    kafka_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery only reads Kafka and rebuilds the cache: one that dies half-way (here, the
    cache's disk fails after a few records) leaves Kafka as it was, and the next one recovers
    everything."""
    settings = _settings(kafka_server)
    log = await RegionLog.open(tmp_path / "r0", kafka=settings, segment_bytes=64 * 1024)
    entries = [Entry(b"m%05d" % i + b"x" * 200) for i in range(1000)]
    for start in range(0, 1000, 100):
        await asyncio.wait_for(log.stage_batch(TOPIC, entries[start : start + 100]), ANSWER)
    await log.close()

    writes = 0
    real = kafka_backend.os.pwrite

    def failing(fd: int, data: bytes, offset: int) -> int:
        nonlocal writes
        writes += 1
        if writes > 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(kafka_backend.os, "pwrite", failing)
    with pytest.raises(OSError, match="No space left"):
        await RegionLog.open(tmp_path / "r0", kafka=settings, segment_bytes=64 * 1024)
    monkeypatch.undo()
    again = await RegionLog.open(tmp_path / "r0", kafka=settings, segment_bytes=64 * 1024)
    try:
        assert await _payloads(again) == [(i, bytes(e.payload)) for i, e in enumerate(entries)]
    finally:
        await again.close()


async def test_appends_are_counted_in_the_wal_metrics(kafka_server: str, tmp_path: Path) -> None:
    from danube_ingest.observability.metrics import WAL_APPENDED_BYTES, WAL_GROUP_MESSAGES

    before = WAL_APPENDED_BYTES._value.get()
    groups = WAL_GROUP_MESSAGES._sum.get()
    log = await RegionLog.open(tmp_path / "r0", kafka=_settings(kafka_server))
    try:
        batch = [Entry(b"x" * 100) for _ in range(10)]
        await asyncio.wait_for(log.stage_batch(TOPIC, batch), ANSWER)
    finally:
        await log.close()
    assert WAL_APPENDED_BYTES._value.get() - before > 1000
    assert WAL_GROUP_MESSAGES._sum.get() - groups == 10


async def test_a_snapshot_of_a_fenced_region_fails_instead_of_hanging(
    kafka_server: str, tmp_path: Path
) -> None:
    """A snapshot whose transaction is refused (the region was taken over) reports the error
    to its caller: it never waits forever."""
    settings = _settings(kafka_server)
    first = await RegionLog.open(tmp_path / "a" / "r0", kafka=settings)
    second = await RegionLog.open(tmp_path / "b" / "r0", kafka=settings)
    try:
        backend = first._backend
        assert isinstance(backend, KafkaBackend)
        with pytest.raises(OSError, match=r"(?i)fenced"):
            await asyncio.wait_for(backend.snapshot(first._snapshot(first.active_seq)), ANSWER)
    finally:
        await second.close()
        await first.close()
