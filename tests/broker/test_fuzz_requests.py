"""Property test: requests with every field at and past its limit, through the real gRPC server.

Hypothesis draws CreateProducer, SendMessage and Subscribe requests whose sizes sit at, just
under and just over each limit (``broker.validation``, the WAL frame's field widths). For each
one: the answer comes within ``ANSWER`` seconds, it is OK exactly when the documented limits
say so and INVALID_ARGUMENT otherwise, and a refused message is not stored (the topic's offsets
stay contiguous). Afterwards ``wal verify`` is clean and a broker restarted on the data
directory serves the same offsets and goes on after them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from danube_ingest.testing import broker_config, running_broker
from danube_ingest.wal import verify_region

from .support import consumer_request, message, producer_request, raw_stubs

pytestmark = pytest.mark.slow

T = TypeVar("T")

#: The documented limits (README: Configuration, Errors), not imported from the code under test.
MAX_KEY_BYTES = 65_535
MAX_NAME_BYTES = 255
#: Seconds within which every request must be answered.
ANSWER = 10.0
#: Above MAX_KEY_BYTES, so that the frame's own limits (not only the total) are reached.
MAX_PAYLOAD = 3 * MAX_KEY_BYTES
MAX_ATTRIBUTES = 3
MAX_I64 = (1 << 63) - 1
MAX_U64 = (1 << 64) - 1
TOPIC = "/default/fuzz"

#: Characters of 1 to 4 UTF-8 bytes: the byte limits must count bytes, not characters.
CHARS = st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"])


def utf8(value: str) -> int:
    return len(value.encode())


@st.composite
def sized_text(draw: st.DrawFn, limit: int) -> str:
    """A string whose UTF-8 size is near 0 or near ``limit`` (under, at or just over it)."""
    char = draw(CHARS)
    # Mostly within the limit, so that most requests are valid but for one field.
    size = draw(st.sampled_from([0, 1, 2, 7, limit - 1, limit, limit + 1]))
    text = char * (max(size, 0) // len(char.encode()))
    return text + "a" * (max(size, 0) - utf8(text))  # exactly ``size`` bytes


def near(limit: int) -> st.SearchStrategy[int]:
    return st.sampled_from([0, 1, 2, limit - 1, limit, limit + 1])


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.sampled_from([0, 0, 1, MAX_ATTRIBUTES, MAX_ATTRIBUTES + 1]))
    attributes = {
        f"{i}{draw(sized_text(MAX_KEY_BYTES))}": draw(st.sampled_from(["", "v", "v" * 1000]))
        for i in range(count)
    }
    return {
        "payload": b"p" * draw(near(MAX_PAYLOAD)),
        "attributes": attributes,
        "routing_key": draw(sized_text(MAX_KEY_BYTES)),
        "producer_name": draw(sized_text(MAX_NAME_BYTES)),
        "publish_time": draw(st.sampled_from([0, 1, 2, MAX_I64, MAX_I64 + 1, MAX_U64])),
        "request_id": draw(st.sampled_from([0, MAX_U64])),
        "schema_version": draw(st.sampled_from([0, (1 << 32) - 1])),
    }


def message_accepted(fields: dict[str, Any]) -> bool:
    """The documented limits (README, Errors), computed independently of the broker's code."""
    attributes: dict[str, str] = fields["attributes"]
    total = (
        len(fields["payload"])
        + sum(utf8(k) + utf8(v) for k, v in attributes.items())
        + utf8(fields["routing_key"])
        + utf8(fields["producer_name"])
    )
    return (
        len(fields["payload"]) <= MAX_PAYLOAD
        and len(attributes) <= MAX_ATTRIBUTES
        and all(utf8(k) <= MAX_KEY_BYTES for k in attributes)
        and utf8(fields["routing_key"]) <= MAX_KEY_BYTES
        and utf8(fields["producer_name"]) <= MAX_NAME_BYTES
        and total <= MAX_PAYLOAD
        and fields["publish_time"] <= MAX_I64
    )


async def test_requests_at_and_past_every_limit(
    tmp_path: Path, etcd_server: str, etcd_prefix: str
) -> None:
    config = broker_config(
        tmp_path / "b1",
        etcd_server,
        prefix=etcd_prefix,
        overrides={
            "limits.max_payload_bytes": MAX_PAYLOAD,
            "limits.max_attributes": MAX_ATTRIBUTES,
            "limits.max_producers_per_topic": 10_000,
        },
    )
    loop = asyncio.get_running_loop()
    accepted: list[bytes] = []
    codes: list[grpc.StatusCode] = []
    unique = itertools.count()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the test's loop (from hypothesis's thread); fail if it hangs."""
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, ANSWER), loop).result()

    async def outcome(call: Callable[[], Any]) -> grpc.StatusCode:
        """The status of ``call()`` (a gRPC call, made on the loop)."""
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            assert len(exc.details() or "") < 1000, "error text too long for a gRPC header"
            codes.append(exc.code())
            return exc.code()
        codes.append(grpc.StatusCode.OK)
        return grpc.StatusCode.OK

    async with running_broker(config) as broker, raw_stubs(broker.url) as raw:
        producer = await raw.producers.CreateProducer(producer_request(TOPIC, "fuzz"))
        pid = producer.producer_id

        @settings(
            max_examples=120,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(fields=messages())
        def publish(fields: dict[str, Any]) -> None:
            request = message(pid, TOPIC, **fields)
            code = run(outcome(lambda: raw.producers.SendMessage(request)))
            expected = message_accepted(fields)
            assert code == (grpc.StatusCode.OK if expected else grpc.StatusCode.INVALID_ARGUMENT)
            if expected:
                accepted.append(fields["payload"])
            info = broker.store.info(TOPIC)
            assert info is not None and info.high_watermark == len(accepted)

        @settings(max_examples=60, deadline=None, database=None, derandomize=True)
        @given(
            topic_len=near(255),
            name=sized_text(MAX_NAME_BYTES),
            subscription=sized_text(MAX_NAME_BYTES),
            consumer=sized_text(MAX_NAME_BYTES),
            sub_type=st.sampled_from([-1, 0, 1, 2, 3, 4, (1 << 31) - 1]),
        )
        def create_and_subscribe(
            topic_len: int, name: str, subscription: str, consumer: str, sub_type: int
        ) -> None:
            topic = "/default/" + "t" * max(topic_len - len("/default/"), 1)
            code = run(outcome(lambda: raw.producers.CreateProducer(producer_request(topic, name))))
            valid = len(topic) <= 255 and utf8(name) <= MAX_NAME_BYTES
            assert code == (grpc.StatusCode.OK if valid else grpc.StatusCode.INVALID_ARGUMENT)
            # A fresh subscription each time (an existing one would answer other errors).
            prefix = f"{next(unique)}-"
            subscription = prefix + subscription[len(prefix) :]
            request = consumer_request(TOPIC, subscription, consumer)
            request.subscription_type = sub_type
            code = run(outcome(lambda: raw.consumers.Subscribe(request)))
            valid = (
                0 <= sub_type <= 3
                and utf8(subscription) <= MAX_NAME_BYTES
                and utf8(consumer) <= MAX_NAME_BYTES
            )
            assert code == (grpc.StatusCode.OK if valid else grpc.StatusCode.INVALID_ARGUMENT)

        await asyncio.to_thread(publish)
        await asyncio.to_thread(create_and_subscribe)
    # Both answers were exercised, on many requests.
    assert len(codes) > 150 and len(accepted) >= 5
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) > 50

    # The broker stopped: the log verifies (no damage, no gap) and holds exactly what was
    # acknowledged; a broker restarted on it serves those offsets and goes on after them.
    regions = sorted(p for p in config.wal_dir().iterdir() if p.is_dir())
    reports = [verify_region(region) for region in regions]
    assert all(r.ok and not r.gaps and r.torn_tail is None for r in reports)
    found = {t: span for r in reports for t, span in r.topics.items()}
    assert found[TOPIC] == (0, len(accepted))
    async with running_broker(config) as broker, raw_stubs(broker.url) as raw:
        pid = (await raw.producers.CreateProducer(producer_request(TOPIC, "fuzz"))).producer_id
        await asyncio.wait_for(raw.producers.SendMessage(message(pid, TOPIC, b"after")), ANSWER)
        info = broker.store.info(TOPIC)
        assert info is not None and info.high_watermark == len(accepted) + 1
        reader = broker.store.create_reader(TOPIC, 0)
        stored: list[bytes] = []
        while len(stored) < len(accepted):
            batch = await asyncio.wait_for(reader.next_batch(), ANSWER)
            stored.extend(bytes(e.payload) for e in batch)
        reader.close()
        assert stored[: len(accepted)] == accepted
