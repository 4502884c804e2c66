"""Fuzzing the decoders of what etcd holds: topic, subscription and client records, cursors,
counters, prune marks, topic clocks, offset jumps, owner records, retention policies, the
manifest's ranges, floors and retirement records, compaction samples.

A stored value comes from another broker (maybe of another version) or from an operator with
``etcdctl``: whatever bytes or JSON it holds, each decoder returns a record or raises
:class:`MetadataError` naming the key, never another exception.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from danube_ingest.metadata.clock import TopicClock
from danube_ingest.metadata.compaction import _State as CompactionState
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.handover import Handover
from danube_ingest.metadata.jumps import OffsetJump
from danube_ingest.metadata.manifest import ObjectRange, Retired, TopicFloor
from danube_ingest.metadata.marks import _decode_mark
from danube_ingest.metadata.ownership import Owner
from danube_ingest.metadata.ownership import _decode_int as decode_epoch
from danube_ingest.metadata.policies import RetentionPolicy
from danube_ingest.metadata.records import (
    ClientRecord,
    SubscriptionRecord,
    TopicRecord,
    _decode_int,
    decode_cursor,
)

from .support import budget, json_values

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

KEY = "/danube/fuzz/key/00000000000000000007"


def _fields(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


#: Each decoder as ``decode(data)``, with the JSON fields it reads.
DECODERS: dict[str, tuple[Callable[[bytes], Any], list[str]]] = {
    "topic": (lambda d: TopicRecord.decode(d, KEY), _fields(TopicRecord)),
    "subscription": (lambda d: SubscriptionRecord.decode(d, KEY), _fields(SubscriptionRecord)),
    "client": (lambda d: ClientRecord.decode(d, KEY), _fields(ClientRecord)),
    "cursor": (lambda d: decode_cursor(d, KEY), ["offset"]),
    "counter": (lambda d: _decode_int(d, KEY), []),
    "epoch": (lambda d: decode_epoch(d, KEY), []),
    "prune_mark": (lambda d: _decode_mark(d, KEY), ["offset"]),
    "clock": (lambda d: TopicClock.decode(d, KEY), ["offset", "ingest_ms", "broker", "epoch"]),
    "jump": (
        lambda d: OffsetJump.decode("/default/t", d, KEY),
        ["from", "to", "epoch", "broker", "reason", "at_ms"],
    ),
    "owner": (lambda d: Owner.decode(d, KEY), ["broker", "url", "epoch"]),
    "policy": (lambda d: RetentionPolicy.decode(d, KEY), _fields(RetentionPolicy)),
    "range": (lambda d: ObjectRange.decode(d, KEY), _fields(ObjectRange)),
    "floor": (lambda d: TopicFloor.decode(d, KEY), ["offset", "expired_ms", "reason"]),
    "retired": (lambda d: Retired.decode(d, KEY), ["object_key", "retired_ms"]),
    "compaction": (lambda d: CompactionState.decode(d, KEY), ["samples", "compacted"]),
    "handover": (
        lambda d: Handover.decode("/default/t", d, KEY),
        [f for f in _fields(Handover) if f != "topic"],
    ),
}

#: Values that look right for most fields, so records get past their first check.
plausible = st.sampled_from(
    [0, 7, 1, -1, "/default/t", "segment", "producer", "Exclusive", "x", True, None, [], [[1, 2]]]
)


@st.composite
def stored_values(draw: st.DrawFn, fields: list[str]) -> bytes:
    """What a key may hold: any bytes, any JSON, a record with odd field values, deep nesting."""
    kind = draw(st.sampled_from(["bytes", "json", "record", "record", "nested"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "nested":
        depth = draw(st.sampled_from([1, 100, 5_000, 100_000]))
        return (draw(st.sampled_from(["[", '{"offset":'])) * depth).encode()
    record = {
        name: draw(plausible | json_values)
        for name in fields
        if draw(st.integers(0, 9))  # mostly present
    }
    return json.dumps(record).encode()


@budget(150)
@given(data=st.data())
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_stored_values_decode_or_raise_metadata_error(name: str, data: st.DataObject) -> None:
    decode, fields = DECODERS[name]
    value = data.draw(stored_values(fields), label="value")
    try:
        decode(value)
    except MetadataError as exc:
        assert KEY in str(exc)
