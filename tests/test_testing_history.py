"""The history checker (``danube_ingest.testing_history``) on hand-made histories: a clean one
passes, and each kind of violation is caught, counted and shown."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from danube_ingest.testing import (
    History,
    Span,
    assert_history_ok,
    check,
    message_id,
    parse_message_id,
)

T = "/default/t"


def clean(n: int = 5) -> History:
    """``n`` acknowledged writes (offsets 0..n-1), each delivered once and acked."""
    h = History()
    for i in range(n):
        h.write(T, "p", i, acked=True, offset=i)
    for i in range(n):
        h.delivery(T, "s", "c", i, message_id("p", i))
        h.ack(T, "s", "c", i)
    return h


def test_a_clean_history_passes_with_its_counts() -> None:
    report = assert_history_ok(clean(), manifest=[Span(T, 0, 3), Span(T, 3, 5)])
    assert report["writes"] == 5 and report["acked_writes"] == 5
    assert report["deliveries"] == 5 and report["acks"] == 5
    assert report["lost"] == 0


def test_message_ids_round_trip() -> None:
    assert parse_message_id(message_id("pa:x", 7) + b" padding") == ("pa:x", 7)
    assert parse_message_id(b"no id here") is None


def test_an_acknowledged_write_never_delivered_is_lost() -> None:
    h = clean(3)
    h.write(T, "p", 3, acked=True, offset=3)
    report = check(h)
    assert report["lost"] == 1
    assert "p:3" in report.examples["lost"][0]
    with pytest.raises(AssertionError, match="lost=1"):
        assert_history_ok(h)


def test_an_unacknowledged_write_may_be_missing() -> None:
    h = clean(3)
    h.write(T, "p", 3, acked=False)
    assert check(h).ok


def test_an_acknowledged_write_at_another_offset_is_lost() -> None:
    h = History()
    h.write(T, "p", 0, acked=True, offset=0)
    h.write(T, "q", 0, acked=True, offset=0)  # two producers told the same offset
    h.delivery(T, "s", "c", 0, message_id("p", 0))
    h.delivery(T, "s", "c", 1, message_id("q", 0))
    report = check(h)
    assert report["lost"] == 1
    assert "q:0" in report.examples["lost"][0]


def test_a_subscription_named_but_empty_has_lost_everything() -> None:
    h = clean(2)
    report = check(h, subscriptions=[(T, "s"), (T, "other")])
    assert report["lost"] == 2


def test_a_write_stored_twice_is_a_duplicate_unless_an_attempt_was_unacknowledged() -> None:
    h = History()
    h.write(T, "p", 0, acked=True)
    h.delivery(T, "s", "c", 0, message_id("p", 0))
    h.delivery(T, "s", "c", 1, message_id("p", 0))
    assert check(h)["duplicated_writes"] == 1

    retried = History()
    retried.write(T, "p", 0, acked=False)  # the first attempt failed (crash) ...
    retried.write(T, "p", 0, acked=True)  # ... and the retry was acknowledged
    retried.delivery(T, "s", "c", 0, message_id("p", 0))
    retried.delivery(T, "s", "c", 1, message_id("p", 0))
    assert check(retried).ok


def test_an_internal_resend_may_store_a_copy_only_if_a_fault_came_during_it() -> None:
    h = History()
    h.write(T, "p", 0, acked=True, since=0)  # no fault during the attempt
    h.delivery(T, "s", "c", 0, message_id("p", 0))
    h.delivery(T, "s", "c", 1, message_id("p", 0))
    assert check(h)["duplicated_writes"] == 1

    crashed = History()
    crashed.fault("sigkill")
    crashed.write(T, "p", 0, acked=True, since=crashed.events[0].t - 1)  # began before it
    crashed.delivery(T, "s", "c", 0, message_id("p", 0))
    crashed.delivery(T, "s", "c", 1, message_id("p", 0))
    report = check(crashed)
    assert report.ok and report["resent_copies"] == 1


def test_redelivery_after_an_ack_is_a_duplicate_unless_a_fault_came_between() -> None:
    h = clean(3)
    h.delivery(T, "s", "c", 1, message_id("p", 1))
    report = check(h)
    assert report["duplicate_deliveries"] == 1
    assert "offset 1" in report.examples["duplicate_deliveries"][0]

    crashed = clean(3)
    crashed.fault("sigkill")
    crashed.delivery(T, "s", "c", 1, message_id("p", 1))
    report = check(crashed)
    assert report.ok and report["redelivered_after_ack"] == 1

    # The ack was answered only after the fault (the dying daemon answered it): still within.
    late = History()
    late.write(T, "p", 0, acked=True, offset=0)
    late.delivery(T, "s", "c", 0, message_id("p", 0))
    late.fault("sigkill")
    late.ack(T, "s", "c", 0)
    late.delivery(T, "s", "c", 0, message_id("p", 0))
    assert check(late).ok

    # A second redelivery with no fault since the first is not.
    late.ack(T, "s", "c", 0)
    late.delivery(T, "s", "c", 0, message_id("p", 0))
    assert check(late)["duplicate_deliveries"] == 1


def test_redelivery_of_an_unacked_offset_is_within_the_window() -> None:
    h = History()
    for i in range(3):
        h.write(T, "p", i, acked=True, offset=i)
        h.delivery(T, "s", "c", i, message_id("p", i))
    for i in range(3):  # not acked: delivered again (nack, timeout, consumer gone)
        h.delivery(T, "s", "c2", i, message_id("p", i))
    assert check(h).ok


def test_a_consumer_first_receiving_a_lower_offset_is_non_monotonic() -> None:
    h = History()
    for i in (0, 2, 1):
        h.write(T, "p", i, acked=True, offset=i)
        h.delivery(T, "s", "c", i, message_id("p", i))
    report = check(h)
    assert report["non_monotonic"] == 1
    assert "offset 1" in report.examples["non_monotonic"][0]


def test_a_hole_in_a_subscriptions_offsets_is_skipped_unless_declared() -> None:
    h = History()
    for i in (0, 1, 4):
        h.write(T, "p", i, acked=True, offset=i)
        h.delivery(T, "s", "c", i, message_id("p", i))
    report = check(h)
    assert report["skipped"] == 1
    assert "[2, 4)" in report.examples["skipped"][0]
    assert check(h, gaps={T: [(2, 4)]}).ok


def test_acked_writes_in_a_range_declared_lost_are_counted_apart_from_silent_loss() -> None:
    # Offsets 0-1 delivered; 2-3 acknowledged by an owner declared lost (never delivered, one
    # told its offset, one placed by a delivery to a subscription that is not checked), the
    # survivor continuing at 6 after the recorded jump [2, 6).
    h = History()
    for i in range(2):
        h.write(T, "p", i, acked=True, offset=i)
        h.delivery(T, "s", "c", i, message_id("p", i))
    h.write(T, "p", 2, acked=True, offset=2)
    h.write(T, "d", 0, acked=True)  # a client that does not say the offset
    h.delivery(T, "early", "c", 3, message_id("d", 0))
    h.write(T, "p", 3, acked=True, offset=6)
    h.delivery(T, "s", "c", 6, message_id("p", 3))
    silent = check(h, subscriptions=[(T, "s")], gaps={T: [(2, 6)]})
    assert silent["lost"] == 2 and silent["declared_lost"] == 0
    report = assert_history_ok(h, subscriptions=[(T, "s")], declared_lost={T: [(2, 6)]})
    assert report["declared_lost"] == 2 and report["lost"] == 0
    # Outside the declared range, a missing acknowledged write is still lost.
    h.write(T, "p", 4, acked=True, offset=7)
    report = check(h, subscriptions=[(T, "s")], declared_lost={T: [(2, 6)]})
    assert report["lost"] == 1 and report["declared_lost"] == 2
    assert "p:4" in report.examples["lost"][0]


def test_a_write_delivered_outside_the_declared_range_is_not_declared_lost() -> None:
    # A resent copy: stored in the lost range by the dead owner and again by the survivor.
    h = History()
    h.write(T, "d", 0, acked=False)
    h.write(T, "d", 0, acked=True)
    h.delivery(T, "early", "c", 0, message_id("d", 0))
    h.delivery(T, "s", "c", 5, message_id("d", 0))
    report = assert_history_ok(h, subscriptions=[(T, "s")], declared_lost={T: [(0, 5)]})
    assert report["declared_lost"] == 0


def test_manifest_and_parquet_gaps_and_overlaps() -> None:
    spans = [Span(T, 0, 10), Span(T, 12, 20), Span(T, 18, 30), Span("/default/u", 0, 5)]
    report = check(History(), manifest=spans, parquet_commits=spans)
    assert report["manifest_gaps"] == 1 and report["manifest_overlaps"] == 1
    assert report["parquet_gaps"] == 1 and report["parquet_overlaps"] == 1
    assert "[10, 12)" in report.examples["manifest_gaps"][0]
    assert check(History(), manifest=spans[:2], gaps={T: [(10, 12)]}).ok


def test_examples_are_capped_but_counts_are_not() -> None:
    h = History()
    for i in range(20):
        h.write(T, "p", i, acked=True, offset=i)
    h.delivery(T, "s", "c", 0, message_id("p", 0))
    report = check(h)
    assert report["lost"] == 19
    assert len(report.examples["lost"]) == 5


def test_json_lines_round_trip_and_a_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    h = History(path)
    h.write(T, "p", 0, acked=True, offset=0)
    h.fault("sigkill", "cycle 1")
    h.delivery(T, "s", "c", 0, message_id("p", 0))
    h.ack(T, "s", "c", 0)
    h.close()
    assert History.load(path).events == h.events

    with path.open("a") as f:
        f.write('{"event": "write", "topic"')  # the writer died mid-line
    assert History.load(path).events == h.events

    path.write_text('{"event": "nonsense"}\n{"event": "fault", "other": 1}\n')
    with pytest.raises(ValueError, match=r"history\.jsonl:1"):
        History.load(path)


def test_merged_histories_keep_time_order(tmp_path: Path) -> None:
    child = History(tmp_path / "child.jsonl")
    parent = History()
    parent.write(T, "p", 0, acked=True, offset=0)
    child.delivery(T, "s", "c", 0, message_id("p", 0))
    child.ack(T, "s", "c", 0)
    child.close()
    parent.fault("sigkill")
    parent.extend(History.load(tmp_path / "child.jsonl").events)
    kinds = [type(e).__name__ for e in parent.events]
    assert kinds == ["Write", "Delivery", "Ack", "Fault"]


def test_logging_from_threads_loses_nothing() -> None:
    h = History()

    def log(producer: str) -> None:
        for i in range(500):
            h.write(T, producer, i, acked=True)

    threads = [threading.Thread(target=log, args=(f"p{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(h.events) == 2000
