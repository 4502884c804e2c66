"""The observable source asset ``topics``: every topic's progress as etcd states it.

The start of the asset graph (``topics`` -> ``object_manifest`` -> ``parquet_partitions``;
``object_manifest`` and ``topics`` -> ``wal_prune_marks``). The brokers write it; Dagster only
observes it, from one etcd read (:func:`danube_ingest.metadata.overview.read_overview`): the
topic list, owners, offset reservations, manifest ends, ingest clocks, and subscription cursors
with their lag behind the uploaded end (the prune marks are ``wal_prune_marks``' metadata).

One asset for all topics, with a per-topic table in its metadata, rather than one asset per
topic: Dagster's asset definitions are fixed when the code location loads, so per-topic assets
would only change on a reload, and per-topic numeric series would grow the event log with the
topic count. Observations come from two places: the ``Observe`` button (a run), and
``prune_marks_sensor``, which records one without a run whenever a topic's figures changed.
"""

import asyncio
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

from dagster import (
    AssetKey,
    AssetObservation,
    DataVersion,
    MetadataValue,
    ObserveResult,
    observable_source_asset,
)

from danube_ingest.metadata.overview import Overview, TopicProgress, read_overview
from pipelines.resources import EtcdResource

TOPICS_KEY = AssetKey("topics")

#: Topics listed in the metadata table (the counts and sums always cover every topic).
MAX_LISTED = 200

#: The tag Dagster reads an observation's data version from.
_DATA_VERSION_TAG = "dagster/data_version"


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _row(t: TopicProgress) -> str:
    owner = f"{t.owner.broker_id} e{t.owner.epoch}" if t.owner else "-"
    clock = f"{t.clock.offset} @ {_when(t.clock.ingest_ms)}" if t.clock else "-"
    lags = ", ".join(
        f"{name}: {'no cursor' if lag is None else lag}" for name, lag in sorted(t.lags().items())
    )
    return (
        f"| {t.name} | {owner} | {t.manifest_end} | {lags or '-'} | {clock} | {t.reserved} "
        f"| {t.ranges} |"
    )


def topics_version(overview: Overview) -> str:
    """The data version of ``topics``: it changes with any figure the table shows but a clock's
    time (an idle topic's clock advances every few seconds without new data: not a change
    worth recording). Prune marks are not part of it: they are ``wal_prune_marks``, downstream,
    and would make every mark run change its own upstream."""
    figures = [
        [
            t.name,
            list(t.owner) if t.owner else None,
            t.reserved,
            t.manifest_end,
            t.ranges,
            t.clock.offset if t.clock else None,
            sorted(t.cursors.items()),
        ]
        for t in overview.topics.values()
    ]
    return hashlib.sha256(json.dumps(figures).encode()).hexdigest()[:16]


def topics_metadata(overview: Overview) -> dict[str, Any]:
    """What an observation of ``topics`` records: counts, lag totals, the slowest clock and a
    table of up to ``MAX_LISTED`` topics (owner and epoch, manifest end, each subscription's lag
    behind the uploaded end, clock, offsets reserved, ranges)."""
    progress = list(overview.topics.values())
    lags = [lag for t in progress for lag in t.lags().values() if lag is not None]
    clocks = [t.clock.ingest_ms for t in progress if t.clock is not None]
    rows = "\n".join(_row(t) for t in progress[:MAX_LISTED])
    if len(progress) > MAX_LISTED:
        rows += f"\n| ... and {len(progress) - MAX_LISTED} more | | | | | | |"
    table = (
        "| topic | owner, epoch | manifest end | subscriptions: lag | clock: offset @ UTC "
        "| offsets reserved | ranges |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n" + rows
    )
    metadata: dict[str, Any] = {
        "topics": len(progress),
        "owned": sum(1 for t in progress if t.owner is not None),
        "subscriptions": sum(len(t.cursors) for t in progress),
        "total_lag": sum(lags),
        "max_lag": max(lags, default=0),
        "brokers": len(overview.brokers),
        "per_topic": MetadataValue.md(table),
    }
    if clocks:
        metadata["slowest_clock"] = MetadataValue.timestamp(min(clocks) / 1000)
    return metadata


def topics_observation(overview: Overview) -> AssetObservation:
    """An observation of ``topics`` (for a sensor to record without a run), tagged with its
    data version."""
    return AssetObservation(
        TOPICS_KEY,
        metadata=topics_metadata(overview),
        tags={_DATA_VERSION_TAG: topics_version(overview)},
    )


@observable_source_asset(
    key=TOPICS_KEY,
    group_name="topics",
    tags={"dagster/kind/etcd": ""},
    description="Every topic the brokers keep in etcd: owner, manifest end, each "
    "subscription's lag behind the uploaded end, ingest clock, offsets reserved. Written by "
    "the brokers; observed by prune_marks_sensor (when it changed) and the Observe button.",
)
def topics(etcd: EtcdResource) -> ObserveResult:
    """One etcd read; the data version changes when any figure but a clock's time does."""

    async def read() -> Overview:
        async with etcd.connect() as (kv, keys):
            return await read_overview(kv, keys)

    overview = asyncio.run(read())
    return ObserveResult(
        metadata=topics_metadata(overview), data_version=DataVersion(topics_version(overview))
    )


__all__ = [
    "MAX_LISTED",
    "TOPICS_KEY",
    "topics",
    "topics_metadata",
    "topics_observation",
    "topics_version",
]
