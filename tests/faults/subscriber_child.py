"""Child process for test_subscriber_kill.py: one consumer that logs into a history file.

Usage::

    python -m tests.faults.subscriber_child KIND URL TOPIC SUBSCRIPTION HISTORY ACK_LIMIT

Subscribes (Exclusive, consumer name ``c1``) through ``KIND`` (``danube`` or ``batch``), logs
every delivery and ack into the JSON-lines file ``HISTORY``, acks only the first ``ACK_LIMIT``
messages, prints ``ready`` once subscribed, and runs until killed.
"""

from __future__ import annotations

import asyncio
import sys

from danube_ingest.testing import History
from tests.faults.harness import Reader


async def main(kind: str, url: str, topic: str, subscription: str, path: str, limit: int) -> None:
    history = History(path)
    reader = Reader(kind, url, topic, subscription, history, ack_limit=limit)
    await reader.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    kind, url, topic, subscription, path, limit = sys.argv[1:7]
    asyncio.run(main(kind, url, topic, subscription, path, int(limit)))
