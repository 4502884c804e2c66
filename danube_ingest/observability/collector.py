"""A broker's figures that are a state, read when ``/metrics`` is scraped.

Subscription lag, WAL bytes, cache bytes, upload backlog and the uploader's totals are read
from the broker's own objects on the event loop at scrape time: nothing is updated on the hot
path for them, and a topic that is gone leaves no stale series behind.

Cardinality: ``danube_ingest_subscription_lag_messages`` is labelled by topic and subscription,
but only the ``max_series`` subscriptions with the largest lag get a series (ties by name, so
the set is stable); the lag of all others is summed into
``danube_ingest_subscription_lag_other_messages``, and ``danube_ingest_subscriptions`` counts
them all. A scrape therefore returns at most ``max_series`` lag series however many
subscriptions a broker serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from danube_ingest.broker.server import Broker


def top_lags(
    lags: Iterable[tuple[str, str, int]], max_series: int
) -> tuple[list[tuple[str, str, int]], int, int]:
    """The ``max_series`` largest lags (largest first, then by topic and subscription), the
    sum of the other lags, and how many lags there were."""
    ordered = sorted(lags, key=lambda item: (-item[2], item[0], item[1]))
    shown = ordered[:max_series]
    return shown, sum(lag for _t, _s, lag in ordered[max_series:]), len(ordered)


class BrokerCollector(Collector):
    """Reads ``broker``'s state when scraped (call ``collect`` on its event loop)."""

    def __init__(self, broker: Broker, *, max_series: int) -> None:
        self._broker = broker
        self._max_series = max_series

    def collect(self) -> Iterator[Metric]:
        broker = self._broker
        yield from self._lag(broker)
        store = broker.store
        if store is not None:
            wal = GaugeMetricFamily(
                "danube_ingest_wal_bytes", "Bytes of WAL segments on disk (all regions)."
            )
            wal.add_metric([], store.wal_bytes())
            yield wal
            cache = GaugeMetricFamily(
                "danube_ingest_cache_bytes", "Bytes of entries held in the WAL cache."
            )
            cache.add_metric([], store.cache.nbytes)
            yield cache
        uploader = broker.uploader
        if store is None or uploader is None:
            return
        segments = 0
        waiting = 0
        for region in store.regions:
            for seq in region.sealed - region.uploaded:
                segments += 1
                waiting += region.segment_sizes.get(seq, 0)
        backlog = GaugeMetricFamily(
            "danube_ingest_upload_backlog_segments",
            "Sealed WAL segments not yet stored as objects and committed to the manifest.",
        )
        backlog.add_metric([], segments)
        yield backlog
        backlog_bytes = GaugeMetricFamily(
            "danube_ingest_upload_backlog_bytes", "Bytes of the segments waiting for upload."
        )
        backlog_bytes.add_metric([], waiting)
        yield backlog_bytes
        stats = uploader.stats
        for name, text, value in (
            ("danube_ingest_upload_bytes", "Bytes of segment objects written.", stats.bytes),
            (
                "danube_ingest_upload_segments",
                "Segments uploaded and committed to the manifest.",
                stats.segments,
            ),
            (
                "danube_ingest_upload_retries",
                "Upload steps (build, PUT, manifest commit) that failed and are retried.",
                stats.failures,
            ),
        ):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], value)
            yield counter

    def _lag(self, broker: Broker) -> Iterator[Metric]:
        manager = broker.manager
        if manager is None:
            return
        shown, other, total = top_lags(manager.subscription_lags(), self._max_series)
        lag = GaugeMetricFamily(
            "danube_ingest_subscription_lag_messages",
            "Messages between a topic's end (high watermark) and a subscription's cursor; "
            "the subscriptions with the largest lag only (metrics.max_lag_series).",
            labels=["topic", "subscription"],
        )
        for topic, subscription, value in shown:
            lag.add_metric([topic, subscription], value)
        yield lag
        rest = GaugeMetricFamily(
            "danube_ingest_subscription_lag_other_messages",
            "Summed lag of the subscriptions beyond metrics.max_lag_series.",
        )
        rest.add_metric([], other)
        yield rest
        count = GaugeMetricFamily(
            "danube_ingest_subscriptions", "Reliable subscriptions served by this broker."
        )
        count.add_metric([], total)
        yield count
