"""Child process for tests/wal/test_crash.py: appends to a file TopicStore as fast as it can.

Usage::

    python crash_child.py run WAL_DIR SEED
        Append until killed. After opening prints ``open TOPIC HWM`` per topic, then ``ready``.
    python crash_child.py fsize WAL_DIR SEED LIMIT
        With RLIMIT_FSIZE = LIMIT and SIGXFSZ ignored, append until the WAL fails, go on
        appending for a moment (every append must fail), close, print ``closed`` and exit.
    python crash_child.py close-after-failure WAL_DIR SEED LIMIT
        Close the store while appends wait on a batch that the failed writer never takes:
        each must fail (not hang); prints ``waiters WalFailedError ...`` and ``closed``.

Every acknowledged append is reported as ``ack TOPIC OFFSET DIGEST`` (:func:`digest` of the
payload), flushed before the next line is produced; a failed append as ``fail TOPIC OFFSET
ERROR`` (offset -1: refused before an offset was assigned). The
payload of every offset is derived from topic and offset (:func:`payload`), so whoever reads the
log back can check each entry without having seen the ack.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

from danube_ingest.errors import WalFailedError
from danube_ingest.store import TopicStore
from danube_ingest.wal import Entry

TOPICS = [f"crash-{i}" for i in range(4)]
STORE_OPTIONS: dict[str, Any] = {
    "fsync": "always",
    "segment_bytes": 32 * 1024,
    "segment_seconds": 0.5,
}
WORKERS = 48


def payload(topic: str, offset: int) -> bytes:
    """The payload stored at ``offset`` of ``topic``: 0 to ~2 KiB, now and then ~64 KiB."""
    seed = hashlib.sha256(f"{topic}/{offset}".encode()).digest()
    size = int.from_bytes(seed[:2], "little") % 2048
    if seed[2] < 3:
        size = 48 * 1024 + size * 8
    return (seed * (size // len(seed) + 1))[:size]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class Appender:
    """Workers appending to TOPICS, predicting each offset so payloads derive from it."""

    def __init__(self, store: TopicStore, seed: int) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.next = {}
        for topic in TOPICS:
            info = store.info(topic)
            self.next[topic] = info.high_watermark if info is not None else 0
        self.failed: BaseException | None = None

    def emit(self, lines: list[str]) -> None:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()

    async def append_one(self, topic: str) -> None:
        count = 1 if self.rng.random() < 0.7 else self.rng.randint(2, 20)
        first = self.next[topic]
        self.next[topic] = first + count
        sent = [Entry(payload(topic, o), producer_name=topic) for o in range(first, first + count)]
        try:
            if count == 1:
                offsets = [await self.store.append(topic, sent[0])]
            else:
                offsets = list(await self.store.append_batch(topic, sent))
        except WalFailedError as exc:
            if sent[0].offset < 0:  # refused before an offset was assigned: none was used
                self.next[topic] = first
            if self.failed is None:
                self.failed = exc
            reason = str(exc).replace("\n", " ")
            self.emit([f"fail {topic} {e.offset} {reason}\n" for e in sent])
            return
        if offsets != [e.offset for e in sent] or offsets != list(range(first, first + count)):
            self.emit([f"bad {topic} predicted {first} got {offsets}\n"])
            raise SystemExit(3)
        self.emit([f"ack {topic} {e.offset} {digest(e.payload)}\n" for e in sent])

    async def worker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.append_one(self.rng.choice(TOPICS))
            if self.failed is not None:
                await asyncio.sleep(0)  # a refused append does not yield: let others run


async def run(wal_dir: Path, seed: int) -> None:
    store = await TopicStore.open(wal_dir, **STORE_OPTIONS)
    appender = Appender(store, seed)
    appender.emit([f"open {t} {appender.next[t]}\n" for t in TOPICS] + ["ready\n"])
    never = asyncio.Event()
    await asyncio.gather(*(appender.worker(never) for _ in range(WORKERS)))


async def fsize(wal_dir: Path, seed: int, limit: int) -> None:
    # Segments larger than the limit: the active segment hits it after some acknowledged writes.
    options = {**STORE_OPTIONS, "segment_bytes": 8 * limit}
    store = await TopicStore.open(wal_dir, **options)
    appender = Appender(store, seed)
    appender.emit([f"open {t} {appender.next[t]}\n" for t in TOPICS] + ["ready\n"])
    # Only now: recovery may have to write (truncate a torn tail) more than the limit allows.
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    for _ in range(30):  # one at a time: small writes, acknowledged before the limit is near
        await appender.append_one(appender.rng.choice(TOPICS))
    stop = asyncio.Event()
    workers = [asyncio.create_task(appender.worker(stop)) for _ in range(WORKERS)]
    async with asyncio.timeout(20):
        while appender.failed is None:
            await asyncio.sleep(0.001)
    appender.emit(["failed\n"])
    # Appends started after the failure was seen must all fail as well.
    for _ in range(50):
        await appender.append_one(appender.rng.choice(TOPICS))
    stop.set()
    async with asyncio.timeout(10):
        await asyncio.gather(*workers)
        await store.close()
    appender.emit(["closed\n"])


async def close_after_failure(wal_dir: Path, limit: int) -> None:
    store = await TopicStore.open(wal_dir, **STORE_OPTIONS)
    await store.append("t", Entry(b"before the limit"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    doomed = store.append("t", Entry(bytes(2 * limit)))  # its write fails with EFBIG

    async def append() -> int:
        return await store.append("t", Entry(b"waiting"))

    waiters = [asyncio.create_task(append()) for _ in range(3)]
    await asyncio.sleep(0)  # `doomed` goes to the writer; the waiters stage the next batch
    time.sleep(0.3)  # the writer fails meanwhile; the event loop has not heard of it yet
    async with asyncio.timeout(10):
        await store.close()  # hands the waiters' batch to the failed writer
        results = await asyncio.gather(*waiters, doomed, return_exceptions=True)
    print("waiters", *(type(r).__name__ for r in results), flush=True)
    print("closed", flush=True)


def main() -> None:
    mode, wal_dir, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "run":
        asyncio.run(run(wal_dir, seed))
    elif mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        asyncio.run(fsize(wal_dir, seed, int(sys.argv[4])))
    elif mode == "close-after-failure":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        asyncio.run(close_after_failure(wal_dir, int(sys.argv[4])))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
