"""Real input for the conversion tests: the real daemon (``wal_cloud`` on an fs object store,
short segments and clock interval) fed by the real danube-client, three topics (plain, Avro
and JSON Schema registered through the client's schema registry), produced in two bursts in
two different minutes.

``produce_topics`` returns what was sent (the consumer-independent truth: offsets are the send
order of a single producer) and two etcd prefixes: ``early``, a copy of the metadata taken
right after burst B (B's minute not over, some of B perhaps not uploaded), and ``prefix``, the
live metadata once every topic's clock passed the end of B's minute while the topics were idle
(time markers only). Tests convert on a fresh copy (``clone``) so they never share tables.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fastavro
from danube import SchemaType

from danube_ingest.analytics.layout import partition_end, partition_start
from danube_ingest.metadata import EtcdKV, Keys
from danube_ingest.metadata.clock import TopicClock
from danube_ingest.testing import broker_config, running_broker
from tests.broker.support import Clients

PLAIN = "/default/plain"
AVRO = "/default/avro_orders"
JSON_T = "/default/json_orders"
TOPICS = (PLAIN, AVRO, JSON_T)
WIDTH_S = 60
#: Messages per topic in each burst.
BURST_A, BURST_B = 25, 12
#: The Avro payload at this offset is not Avro: it keeps its row with a decode_error.
BAD_AVRO = 7
#: Seconds to wait for a topic's clock to pass an instant (the design: one clock interval plus
#: a segment and its upload; generous for a loaded 2-core machine).
CLOCK_WAIT = 60.0

AVRO_SCHEMA = {
    "type": "record",
    "name": "Order",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "item", "type": "string"},
        {"name": "qty", "type": ["null", "int"], "default": None},
    ],
}
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "item": {"type": "string"},
        "price": {"type": "number"},
    },
    "required": ["id", "item"],
}


def avro_payload(i: int) -> bytes:
    if i == BAD_AVRO:
        return b"\x00not avro"
    out = io.BytesIO()
    value = {"id": i, "item": f"item-{i}", "qty": None if i % 4 == 0 else i}
    fastavro.schemaless_writer(out, fastavro.parse_schema(AVRO_SCHEMA), value)
    return out.getvalue()


def json_payload(i: int) -> bytes:
    return json.dumps({"id": i, "item": f"item-{i}", "price": i / 4}).encode()


def plain_payload(i: int) -> bytes:
    return f"plain-{i}-".encode() * (1 + i % 5)


PAYLOADS = {PLAIN: plain_payload, AVRO: avro_payload, JSON_T: json_payload}


def expected_fields(topic: str, i: int) -> dict[str, Any]:
    """The decoded columns a row of ``topic`` at offset ``i`` must hold."""
    if topic == AVRO:
        if i == BAD_AVRO:
            return {"id": None, "item": None, "qty": None}
        return {"id": i, "item": f"item-{i}", "qty": None if i % 4 == 0 else i}
    if topic == JSON_T:
        return {"id": i, "item": f"item-{i}", "price": i / 4}
    return {}


@dataclass
class Produced:
    endpoint: str
    prefix: str
    early: str
    objects: Path
    sent: dict[str, int] = field(default_factory=dict)
    """Messages per topic: offsets 0..n-1, payload ``PAYLOADS[topic](offset)``."""
    minute_a: int = 0
    minute_b: int = 0
    """Start of the first minute of burst B: every A message is before it, every B one in it
    or later."""
    last_minute: int = 0
    """Start of the minute burst B ended in."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def clock_of(kv: EtcdKV, keys: Keys, topic: str) -> TopicClock | None:
    stored = await kv.get(keys.topic_clock(topic))
    return None if stored is None else TopicClock.decode(stored.value, stored.key)


async def wait_clocks(kv: EtcdKV, keys: Keys, at_ms: int, timeout: float = CLOCK_WAIT) -> None:
    """Until every topic's clock has passed ``at_ms``."""
    deadline = time.monotonic() + max(timeout, (at_ms - _now_ms()) / 1000 + timeout)
    while True:
        clocks = [await clock_of(kv, keys, t) for t in TOPICS]
        if all(c is not None and c.ingest_ms >= at_ms for c in clocks):
            return
        assert time.monotonic() < deadline, f"clocks never passed {at_ms}: {clocks}"
        await asyncio.sleep(0.2)


async def clone(kv: EtcdKV, source: str, target: str | None = None) -> Keys:
    """Copy every key under ``source`` to a new prefix (no leases): an independent copy of the
    topics' metadata over the same objects. Returns the new prefix's ``Keys``."""
    target = target or f"/c{uuid.uuid4().hex[:12]}"
    for entry in await kv.get_prefix(f"{source}/"):
        await kv.put(target + entry.key[len(source) :], entry.value)
    return Keys(target)


async def _produce(endpoint: str, base: Path) -> Produced:
    prefix = f"/p{uuid.uuid4().hex[:12]}"
    done = Produced(endpoint, prefix, "", base / "objects")
    config = broker_config(
        base / "b1",
        endpoint,
        prefix=prefix,
        overrides={
            "storage.mode": "wal_cloud",
            "storage.cloud.backend": "fs",
            "storage.cloud.root": str(done.objects),
            "storage.wal.segment_seconds": 1,
            "storage.clock_interval_seconds": 0.5,
        },
    )
    keys = Keys(prefix)
    kv = await EtcdKV.connect([endpoint], timeout=5.0)
    try:
        async with running_broker(config) as broker, Clients(broker.url) as clients:
            registry = clients.client.schema()
            await (
                registry.register_schema("orders-avro")
                .with_type(SchemaType.AVRO)
                .with_schema_data(json.dumps(AVRO_SCHEMA).encode())
                .execute()
            )
            await (
                registry.register_schema("orders-json")
                .with_type(SchemaType.JSON_SCHEMA)
                .with_schema_data(json.dumps(JSON_SCHEMA).encode())
                .execute()
            )
            producers = {
                PLAIN: await clients.producer(PLAIN, "p-plain"),
                AVRO: await clients.producer(AVRO, "p-avro", schema_subject="orders-avro"),
                JSON_T: await clients.producer(JSON_T, "p-json", schema_subject="orders-json"),
            }

            async def burst(start: int, n: int) -> None:
                for topic, producer in producers.items():
                    for i in range(start, start + n):
                        await producer.send(PAYLOADS[topic](i), {"i": str(i), "t": topic})
                    done.sent[topic] = start + n

            done.minute_a = partition_start(_now_ms(), WIDTH_S)
            await burst(0, BURST_A)
            # Burst B in a later minute, once burst A's minutes are complete.
            done.minute_b = partition_end(partition_start(_now_ms(), WIDTH_S), WIDTH_S)
            await wait_clocks(kv, keys, done.minute_b)
            await burst(BURST_A, BURST_B)
            done.last_minute = partition_start(_now_ms(), WIDTH_S)
            done.early = (await clone(kv, prefix)).prefix
            # Idle from here on: only time markers move the clocks past B's minute.
            await wait_clocks(kv, keys, partition_end(done.last_minute, WIDTH_S))
    finally:
        await kv.close()
    return done


def produce_topics(endpoint: str, base: Path) -> Produced:
    """Run the daemon and the producers (about one to two minutes: two minute boundaries)."""
    return asyncio.run(_produce(endpoint, base))


def produced_to_json(produced: Produced) -> str:
    return json.dumps({**asdict(produced), "objects": str(produced.objects)})


def produced_from_json(text: str) -> Produced:
    fields = json.loads(text)
    return Produced(**{**fields, "objects": Path(fields["objects"])})


if __name__ == "__main__":
    # python -m tests.analytics.daemon_support ENDPOINT BASE OUT: produce_topics in a child
    # process (tests/conftest.py starts it before the first test, so its minute boundaries
    # pass while other tests run); OUT gets the Produced as JSON.
    endpoint, base, out = sys.argv[1:4]
    Path(out + ".part").write_text(produced_to_json(produce_topics(endpoint, Path(base))))
    Path(out + ".part").rename(out)
