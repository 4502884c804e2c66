"""Partition bounds, warehouse paths and parsing them back (danube_ingest.analytics.layout)."""

from __future__ import annotations

import pytest

from danube_ingest.analytics import layout
from danube_ingest.analytics.errors import AnalyticsError, InvalidLayoutError

T0 = 1_795_514_400_000  # 2026-11-24T10:00:00Z


@pytest.mark.parametrize("width", [60, 120, 300, 600, 900, 1200, 1800, 3600])
def test_allowed_widths(width: int) -> None:
    assert layout.check_width(width) == width
    start = layout.partition_start(T0 + 59_999, width)
    assert start == T0
    assert layout.partition_end(start, width) == T0 + width * 1000


@pytest.mark.parametrize("width", [0, 30, 59, 61, 7, 7200, 86400, 3601, True, 60.0, "60"])
def test_other_widths_are_refused_with_a_clear_error(width: object) -> None:
    with pytest.raises(InvalidLayoutError, match=r"use 3600 \(an hour\) or a divisor of 3600") as e:
        layout.check_width(width)  # type: ignore[arg-type]
    assert isinstance(e.value, AnalyticsError) and isinstance(e.value, ValueError)
    assert not e.value.retriable


def test_partition_end_refuses_a_start_that_is_not_one() -> None:
    with pytest.raises(InvalidLayoutError, match="not the start of a 3600 s partition"):
        layout.partition_end(T0 + 60_000, 3600)
    assert layout.partition_end(T0 + 60_000, 60) == T0 + 120_000


def test_hour_and_minute_paths() -> None:
    hour = layout.final_path("warehouse/", "r1", "/default/orders", T0, 3600, 5, 99)
    assert hour == (
        "warehouse/r1/namespace=default/topic=orders/date=2026-11-24/hour=10/"
        "part-00000000000000000005-00000000000000000099.parquet"
    )
    minute = layout.final_path("", "r12", "/default/orders", T0 + 25 * 60_000, 300, 0, 0)
    assert minute == (
        "r12/namespace=default/topic=orders/date=2026-11-24/hour=10/minute=25/"
        "part-00000000000000000000-00000000000000000000.parquet"
    )
    staged = layout.staging_path("warehouse/", "tok", hour)
    assert staged == "warehouse/_staging/tok/" + hour[len("warehouse/") :]
    assert layout.final_of_staging("warehouse/", staged) == hour


def test_parse_path_round_trips_final_and_staged_files() -> None:
    for width in (3600, 60):
        start = T0 + 23 * 3_600_000 + (59 * 60_000 if width == 60 else 0)
        path = layout.final_path("wh/", "r3", "/ns-1/t.x", start, width, 7, 8)
        parsed = layout.parse_path("wh/", path)
        assert parsed == layout.PartitionPath("r3", "/ns-1/t.x", start, width < 3600, 7, 8, None)
        staged = layout.parse_path("wh/", layout.staging_path("wh/", "123-ab", path))
        assert staged.token == "123-ab" and staged.start_ms == start


def test_names_are_escaped_as_hive_escapes_partition_values() -> None:
    path = layout.final_path("", "r1", "/a=b/50%:x", T0, 3600, 1, 1)
    assert "/namespace=a%3Db/topic=50%25%3Ax/" in path
    assert layout.parse_path("", path).topic == "/a=b/50%:x"


@pytest.mark.parametrize(
    "path",
    [
        "warehouse/r1/namespace=a/topic=b/date=2026-11-24/hour=10/part-1-2.parquet",
        "warehouse/r0/namespace=a/topic=b/date=2026-11-24/hour=10/"
        "part-00000000000000000001-00000000000000000002.parquet",
        "warehouse/r1/namespace=a/topic=b/date=2026-13-24/hour=10/"
        "part-00000000000000000001-00000000000000000002.parquet",
        "warehouse/r1/namespace=a/topic=b/date=2026-11-24/hour=10/"
        "part-00000000000000000003-00000000000000000002.parquet",
        "other/r1/namespace=a/topic=b/date=2026-11-24/hour=10/"
        "part-00000000000000000001-00000000000000000002.parquet",
    ],
)
def test_parse_path_names_what_it_cannot_parse(path: str) -> None:
    with pytest.raises(InvalidLayoutError, match=r"warehouse file|invalid date|after the last"):
        layout.parse_path("warehouse/", path)


def test_renditions_and_roots() -> None:
    assert layout.rendition_name(1) == "r1"
    assert layout.parse_rendition("r42") == 42
    for bad in ("r0", "1", "r01", "rx", ""):
        with pytest.raises(InvalidLayoutError, match="expected r1, r2"):
            layout.parse_rendition(bad)
    for root in ("/abs/", "no-slash"):
        with pytest.raises(InvalidLayoutError, match="warehouse root"):
            layout.check_root(root)
    with pytest.raises(InvalidLayoutError, match="offset range"):
        layout.file_name(5, 4)
