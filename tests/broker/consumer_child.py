"""Child process for test_batch_consumer_death.py: a batch-client consumer that holds messages
unacknowledged until it is killed.

Usage::

    python -m tests.broker.consumer_child URL TOPIC SUBSCRIPTION COUNT

Subscribes (Shared, consumer name ``dying``, from the earliest offset, batches of at most
``COUNT``), receives ``COUNT`` messages without acking any, prints ``holding COUNT`` and waits
for ever (it stops reading: what the daemon sends meanwhile stays in its connection).
"""

from __future__ import annotations

import asyncio
import sys

from danube_ingest.client import Consumer


async def main(url: str, topic: str, subscription: str, count: int) -> None:
    consumer = Consumer(
        url,
        topic,
        subscription,
        consumer_name="dying",
        sub_type="shared",
        start="earliest",
        max_batch=count,
    )
    await consumer.start()
    held = 0
    while held < count:
        held += len((await consumer.receive(timeout=30)).entries)
    print(f"holding {held}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    url, topic, subscription, count = sys.argv[1:5]
    asyncio.run(main(url, topic, subscription, int(count)))
