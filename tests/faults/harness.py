"""The fault harness: load drivers that log into a ``History``, per client kind.

* ``Load`` publishes numbered messages (``message_id`` payloads) from one producer, through
  danube-client (``"danube"``: one ``send`` at a time, a failed one retried with the same
  sequence and logged as an unacknowledged attempt) or ``danube_ingest.client``
  (``"batch"``: pipelined sends, idempotent resends inside the client; each message logged
  once, acknowledged with its offset or not).
* ``Reader`` receives from a subscription through either client and logs every delivery and
  ack; ``drain`` reads until a count is reached or nothing new arrives.
* ``start_workload`` sets a scenario up: the topic, its ``audit`` and ``live`` subscriptions
  and a running ``Load``; ``read_all`` reads both at the end; ``manifest_ranges`` reads what
  the manifest holds of a topic.
* ``record`` prints a scenario's figures and appends them to ``$DANUBE_FAULT_FIGURES`` (JSON
  lines) when set: the source of docs/reliability.md's table.

The daemons are real child processes (``BrokerProcess``); nothing of ours is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import grpc
from danube import (
    ConsumerOptions,
    DanubeClientBuilder,
    DispatchStrategy,
    ProducerOptions,
    SubType,
)

from danube_ingest.client import Batch, ConsumeError, Consumer, Producer
from danube_ingest.metadata import Keys
from danube_ingest.metadata.manifest import Manifest, ObjectRange
from danube_ingest.testing import BrokerProcess, History, Report, message_id
from danube_ingest.testing_history import Write
from danube_ingest.wal.framing import Entry
from danube_ingest.wal.synclog import read_synced
from tests.broker.support import metadata
from tests.broker.test_both_clients import create_topic

Kind = Literal["danube", "batch"]
KINDS: tuple[Kind, ...] = ("danube", "batch")

#: Client kinds of the scenarios that kill the daemon under load: both (the batch client's
#: Producer and Consumer reconnect after a kill since 2026-11-24, issue 14/15).
KILLED_KINDS: list[Kind] = list(KINDS)
#: Scenarios that kill the daemon only a few times (tests/faults/test_upload_crash.py): both.
FEW_KILLS_KINDS: list[Kind] = list(KINDS)

#: danube-client's retry budget for outages (see RETRY_BUDGET in tests/broker/test_restart.py:
#: the default 1.5-3 s of retries does not bridge a daemon restart): about 60 s in all, as
#: 120 x 500 ms was, but retried every 200 ms at most, so that a client finds a restarted
#: daemon (a warm restart serves within ~0.2 s) without waiting out a long backoff.
RETRY_BUDGET = {"max_retries": 300, "base_backoff_ms": 100, "max_backoff_ms": 200}
#: Messages a batch load keeps unanswered at most: enough to have many in flight at a kill.
BATCH_WINDOW = 200


#: Debian's libfaketime (``make libfaketime``), preloaded into a daemon whose wall clock a
#: test moves or speeds up.
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


async def _danube_client(url: str) -> Any:
    return await DanubeClientBuilder().service_url(url).build()


async def _close_danube(client: Any) -> None:
    # danube-client has no close(); its channels live in the connection manager.
    for connection in list(client.connection_manager._connections.values()):
        with contextlib.suppress(Exception):
            await connection.channel.close()


class Load:
    """One producer publishing ``topic`` in a background task until ``stop``; every attempt is
    logged into ``history``. ``acked`` counts acknowledged messages (for pacing a test)."""

    def __init__(self, kind: Kind, url: str, topic: str, history: History, name: str) -> None:
        self.kind = kind
        self.url = url
        self.topic = topic
        self.history = history
        self.name = name
        self.acked = 0
        self.sent = 0
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._close: list[Any] = []
        self._producer: Producer | None = None

    async def start(self) -> None:
        run = self._run_danube if self.kind == "danube" else self._run_batch
        self._task = asyncio.get_running_loop().create_task(run())

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop sending; wait (up to ``timeout``) for the answers of what was sent."""
        self._stopping = True
        assert self._task is not None
        try:
            await asyncio.wait_for(self._task, timeout)
        finally:
            for close in self._close:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(close(), 10)

    async def wait_acked(self, n: int, timeout: float = 30.0) -> None:
        """Wait until ``n`` messages were acknowledged in all."""
        deadline = time.monotonic() + timeout
        while self.acked < n:
            if self._task is not None and self._task.done():
                self._task.result()
            # The batch producer's own loop (private): if it died, nothing more is acknowledged;
            # fail now, with its error, rather than at the deadline.
            runner = getattr(self._producer, "_runner", None)
            if runner is not None and runner.done() and not runner.cancelled():
                error = runner.exception()
                if error is not None:
                    raise AssertionError(f"batch producer {self.name} died: {error!r}") from error
            assert time.monotonic() < deadline, (
                f"{self.kind} load {self.name}: {self.acked} of {n} acknowledged in {timeout}s"
            )
            await asyncio.sleep(0.02)

    async def _run_danube(self) -> None:
        client = await _danube_client(self.url)
        self._close.append(lambda: _close_danube(client))
        producer = (
            client.new_producer()
            .with_topic(self.topic)
            .with_name(self.name)
            .with_dispatch_strategy(DispatchStrategy.RELIABLE)
            .with_options(ProducerOptions(**RETRY_BUDGET))
            .build()
        )
        while not self._stopping:
            try:
                await producer.create()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
        sequence = 0
        while not self._stopping:
            self.sent += 1
            # danube-client resends on its own (no idempotence in Danube's protocol): a fault
            # during the call may store the message twice; ``since`` opens that window.
            since = time.monotonic_ns()
            try:
                await producer.send(message_id(self.name, sequence), {})
            except Exception:  # the daemon went away mid-send: unknown, so retried
                self.history.write(self.topic, self.name, sequence, acked=False, since=since)
                await asyncio.sleep(0.05)
                continue
            self.history.write(self.topic, self.name, sequence, acked=True, since=since)
            self.acked += 1
            sequence += 1
        self._close.insert(0, producer.close)

    async def _run_batch(self) -> None:
        producer = Producer(
            self.url, self.topic, producer_name=self.name, linger_ms=1, max_backoff_ms=200
        )
        await producer.start()
        self._producer = producer
        self._close.append(producer.close)
        window = asyncio.Semaphore(BATCH_WINDOW)
        pending: set[asyncio.Future[int]] = set()
        sequence = 0
        while not self._stopping:
            await window.acquire()
            if self._stopping:
                break
            future = await producer.send(message_id(self.name, sequence))
            self.sent += 1
            pending.add(future)
            future.add_done_callback(self._answered(sequence, window, pending))
            sequence += 1
        if pending:
            await asyncio.wait(pending)

    def _answered(
        self, sequence: int, window: asyncio.Semaphore, pending: set[asyncio.Future[int]]
    ) -> Any:
        def done(future: asyncio.Future[int]) -> None:
            pending.discard(future)
            window.release()
            if future.cancelled() or future.exception() is not None:
                self.history.write(self.topic, self.name, sequence, acked=False)
                return
            self.history.write(self.topic, self.name, sequence, acked=True, offset=future.result())
            self.acked += 1

        return done


class Reader:
    """One consumer of ``subscription`` (Exclusive), logging every delivery and ack into
    ``history``; acks each message as it arrives unless ``ack=False``. Reconnects across
    daemon restarts (both clients' own reconnect logic). ``ack_limit``: ack only the first
    that many messages, then none."""

    def __init__(
        self,
        kind: Kind,
        url: str,
        topic: str,
        subscription: str,
        history: History,
        *,
        name: str = "c1",
        ack: bool = True,
        ack_limit: int | None = None,
    ) -> None:
        self.kind = kind
        self.url = url
        self.topic = topic
        self.subscription = subscription
        self.history = history
        self.name = name
        self.ack = ack
        self.ack_limit = ack_limit
        self.acks = 0
        self.offsets: set[int] = set()
        self.received = 0
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._consumer: Any = None
        self.error: BaseException | None = None
        #: the daemon that delivered the last message (danube-client: ``msg_id.broker_addr``)
        self._broker: str | None = None

    async def start(self) -> None:
        """Subscribe (creating the subscription at the topic's end if it is new)."""
        if self.kind == "danube":
            self._client = await _danube_client(self.url)
            consumer = (
                self._client.new_consumer()
                .with_topic(self.topic)
                .with_consumer_name(self.name)
                .with_subscription(self.subscription)
                .with_subscription_type(SubType.EXCLUSIVE)
                .with_options(ConsumerOptions(**RETRY_BUDGET))
                .build()
            )
            await consumer.subscribe()
            self._consumer = consumer
            queue = await consumer.receive()
            self._task = asyncio.get_running_loop().create_task(self._run_danube(queue))
        else:
            consumer = Consumer(
                self.url,
                self.topic,
                self.subscription,
                consumer_name=self.name,
                max_backoff_ms=200,
                reconnect_timeout_s=120,
            )
            await consumer.start()
            self._consumer = consumer
            self._task = asyncio.get_running_loop().create_task(self._run_batch(consumer))

    def _delivered(self, offset: int, payload: bytes) -> None:
        self.history.delivery(self.topic, self.subscription, self.name, offset, payload)
        self.offsets.add(offset)
        self.received += 1

    async def _run_danube(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            message = await queue.get()
            offset = message.msg_id.topic_offset
            broker = message.msg_id.broker_addr
            if self._broker is not None and broker != self._broker:
                # The topic moved to another daemon: an ack the old owner took after its last
                # cursor flush (even one taken just after a SIGCONT, before it saw its loss) is
                # not the new owner's, which delivers the message again (at-least-once).
                self.history.fault("owner-moved", f"{self.name}: {self._broker} -> {broker}")
            self._broker = broker
            self._delivered(offset, message.payload)
            if self._acking():
                try:
                    await self._consumer.ack(message)
                except Exception:  # the daemon went away: not acked, comes again
                    continue
                self.history.ack(self.topic, self.subscription, self.name, offset)
                self.acks += 1

    async def _run_batch(self, consumer: Consumer) -> None:
        try:
            async for batch in consumer:
                for entry in batch.entries:
                    self._delivered(entry.offset, entry.payload)
                if self._acking():
                    room = len(batch.entries)
                    if self.ack_limit is not None:
                        room = self.ack_limit - self.acks
                    self._ack_batch(consumer, batch.entries[:room])
        except ConsumeError as exc:
            self.error = exc

    def _acking(self) -> bool:
        return self.ack and (self.ack_limit is None or self.acks < self.ack_limit)

    def _ack_batch(self, consumer: Consumer, entries: list[Entry]) -> None:
        consumer.ack(Batch(self.topic, entries))
        for entry in entries:
            self.history.ack(self.topic, self.subscription, self.name, entry.offset)
        self.acks += len(entries)

    def _check_alive(self) -> None:
        if self._task is not None and self._task.done():
            self._task.result()
            raise AssertionError(f"{self.kind} reader {self.name} stopped: {self.error!r}")

    async def wait_for(self, offsets: set[int], timeout: float = 60.0) -> None:
        """Wait until every offset in ``offsets`` was delivered (fails naming the missing)."""
        deadline = time.monotonic() + timeout
        while not offsets <= self.offsets:
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(offsets - self.offsets)
                raise AssertionError(
                    f"{self.kind} reader {self.subscription}/{self.name}: {len(missing)} "
                    f"offsets not delivered in {timeout}s, first {missing[:10]}"
                )
            await asyncio.sleep(0.05)

    async def wait_count(self, n: int, timeout: float = 60.0) -> None:
        """Wait until ``n`` distinct offsets were delivered."""
        deadline = time.monotonic() + timeout
        while len(self.offsets) < n:
            self._check_alive()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.kind} reader {self.subscription}/{self.name}: "
                    f"{len(self.offsets)} of {n} offsets delivered in {timeout}s"
                )
            await asyncio.sleep(0.05)

    async def settle(self, quiet: float = 1.0, timeout: float = 30.0) -> None:
        """Wait until nothing new arrived for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        seen = -1
        while seen != self.received and time.monotonic() < deadline:
            seen = self.received
            await asyncio.sleep(quiet)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._consumer.close(), 10)
        if self._client is not None:
            await _close_danube(self._client)


def acked_offsets(history: History, topic: str) -> set[int]:
    """The offsets batch producers were told for acknowledged writes of ``topic``."""
    return {
        e.offset
        for e in history.events
        if isinstance(e, Write) and e.topic == topic and e.acked and e.offset is not None
    }


def acked_count(history: History, topic: str) -> int:
    """How many distinct messages of ``topic`` were acknowledged."""
    return len(
        {
            (e.producer, e.sequence)
            for e in history.events
            if isinstance(e, Write) and e.topic == topic and e.acked
        }
    )


async def stalled(load: Load, quiet: float, fault: str, timeout: float = 30.0) -> int:
    """Wait until ``load`` got no acknowledgement for ``quiet`` seconds (while ``fault``, e.g.
    "a full disk", is on); its acked count."""
    deadline = time.monotonic() + timeout
    seen, since = load.acked, time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still acknowledging after {timeout}s of {fault}"
        await asyncio.sleep(0.1)
        if load.acked != seen:
            seen, since = load.acked, time.monotonic()
    return seen


async def read_after_restart(
    kind: Kind, url: str, topic: str, history: History, before: Reader
) -> None:
    """Read everything on ``audit``, then on ``live`` with a new consumer whatever ``before``
    (the live consumer until the restart) was not delivered."""
    audit = Reader(kind, url, topic, "audit", history, name="audit")
    await audit.start()
    try:
        with contextlib.suppress(AssertionError):  # the checker names what is missing
            await audit.wait_count(acked_count(history, topic), timeout=60)
        await audit.settle(quiet=0.5)
    finally:
        await audit.close()
    live = Reader(kind, url, topic, "live", history, name="c2")
    await live.start()
    try:
        with contextlib.suppress(AssertionError):
            await live.wait_for(audit.offsets - before.offsets, timeout=60)
        await live.settle(quiet=0.5)
    finally:
        await live.close()


def cut_unsynced(wal_dir: Path, sync_log: Path, rng: random.Random | None = None) -> int:
    """Cut every segment under ``wal_dir`` back from its size, as a power cut could: without
    ``rng`` exactly to its last synced length (a segment never synced: 0); with it, half the
    time to that length, else anywhere in the unsynced bytes (a torn tail). Returns how many
    bytes were cut."""
    synced = read_synced(sync_log) if sync_log.exists() else {}
    cut = 0
    for segment in wal_dir.rglob("*.wal"):
        size = segment.stat().st_size
        keep = synced.get(segment, 0)
        if rng is not None and size > keep and rng.random() < 0.5:
            keep = rng.randrange(keep, size)
        if size > keep:
            os.truncate(segment, keep)
            cut += size - keep
    return cut


def record(scenario: str, kind: str, report: Report, **figures: Any) -> None:
    """Print a scenario's figures; append them to ``$DANUBE_FAULT_FIGURES`` if set."""
    row = {
        "scenario": scenario,
        "client": kind,
        "messages": report["acked_writes"],
        "deliveries": report["deliveries"],
        "lost": report["lost"],
        "duplicated": report["duplicated_writes"] + report["duplicate_deliveries"],
        "redelivered_after_ack": report["redelivered_after_ack"],
        **figures,
    }
    print("fault figures", json.dumps(row))
    target = os.environ.get("DANUBE_FAULT_FIGURES")
    if target:
        with Path(target).open("a") as out:
            out.write(json.dumps(row) + "\n")


async def kill_cycles(
    broker: BrokerProcess,
    load: Load,
    history: History,
    cycles: int,
    *,
    per_cycle: int = 20,
    seed: int = 15,
    while_down: Callable[[], None] | None = None,
    what: str = "sigkill",
) -> list[float]:
    """``cycles`` times: wait until ``per_cycle`` more messages are acknowledged, SIGKILL the
    daemon a random moment (0-20 ms) later, run ``while_down`` (e.g. cut files back), restart
    it. Returns the seconds from each kill to the next acknowledged message."""
    rng = random.Random(seed)
    recoveries: list[float] = []
    for cycle in range(cycles):
        await load.wait_acked(load.acked + per_cycle)
        await asyncio.sleep(rng.uniform(0, 0.02))
        history.fault(what, f"cycle {cycle}")
        broker.kill()
        killed = time.monotonic()
        if while_down is not None:
            while_down()
        await asyncio.to_thread(broker.start)
        await load.wait_acked(load.acked + 1)
        recoveries.append(time.monotonic() - killed)
    return recoveries


async def start_workload(kind: Kind, url: str, topic: str, history: History) -> tuple[Reader, Load]:
    """Create ``topic`` and its ``audit`` subscription at offset 0 (closed at once: read only
    at the end, by ``read_all``), then start a ``live`` reader and a ``Load`` named ``p1``
    publishing ``topic``. Returns (live, load): the caller stops the load and closes live."""
    await create_topic(url, topic)
    audit = Reader(kind, url, topic, "audit", history, name="audit")
    await audit.start()
    await audit.close()
    live = Reader(kind, url, topic, "live", history)
    await live.start()
    load = Load(kind, url, topic, history, "p1")
    try:
        await load.start()
    except BaseException:
        await live.close()
        raise
    return live, load


async def manifest_ranges(etcd: str, prefix: str, topic: str) -> list[ObjectRange]:
    """The ranges the manifest under ``prefix`` holds of ``topic``, in offset order."""
    async with metadata(etcd, prefix) as records:
        return list(await Manifest(records.kv, Keys(prefix)).ranges(topic))


async def read_all(
    kind: Kind,
    url: str,
    topic: str,
    history: History,
    readers: Sequence[Reader],
    timeout: float = 60.0,
) -> None:
    """Wait until each of ``readers`` (live) and a fresh reader of the ``audit`` subscription
    (created at the start, never read before) received as many distinct offsets as messages
    were acknowledged (at most ``timeout`` seconds each: what is missing then is for the
    history checker to name), and nothing more arrives; closes them."""
    total = acked_count(history, topic)
    audit = Reader(kind, url, topic, "audit", history, name="audit")
    for reader in [*readers, audit]:
        if reader is audit:
            await audit.start()
        try:
            with contextlib.suppress(AssertionError):
                await reader.wait_count(total, timeout=timeout)
            await reader.settle(quiet=0.5)
        finally:
            await reader.close()


def summary(recoveries: Sequence[float]) -> dict[str, float]:
    """Time-to-recover figures (seconds) for ``record``."""
    ordered = sorted(recoveries)
    return {
        "recover_s_median": round(ordered[len(ordered) // 2], 2) if ordered else 0.0,
        "recover_s_max": round(ordered[-1], 2) if ordered else 0.0,
    }
