"""A history checker for fault tests: what producers were told, what consumers saw, and whether
the two agree with the daemon's guarantees.

Producers log one ``Write`` per publish attempt (producer, sequence, acknowledged?, offset);
consumers log one ``Delivery`` per message received and one ``Ack`` per message they acked;
the test logs a ``Fault`` (a SIGKILL, a cut file, an outage) when it injects one. ``check``
then reports, with counts and the first few examples of each:

* **lost**: an acknowledged write that a checked subscription never received, or that was
  received at another offset than the one its producer was told (the slot holds something else);
  except a write whose offset lies in a range an operator **declared lost** (``brokers forget``:
  a recorded jump with reason ``lost``), counted as ``declared_lost`` instead (its offset: the
  one its producer was told, else every offset a consumer received it at, all in such ranges);
* **duplicated writes**: a write stored at more offsets than its unacknowledged attempts allow
  (one copy per acknowledged sequence, plus one per attempt that was not acknowledged and was
  retried, plus, for a client that resends internally (``Write.since``), one per fault during
  the attempt: the "unacknowledged window" of a producer; copies within it are counted as
  ``resent_copies``);
* **duplicate deliveries**: an offset delivered again to a subscription after that subscription
  acked it, with no fault since its previous delivery (a redelivery after a fault is within the
  window: an ack is persisted on the daemon's schedule, so one not yet persisted may be
  redelivered; those are counted as ``redelivered_after_ack``, not as violations);
* **non-monotonic** offsets: a consumer first receiving an offset below one it first received
  earlier (redeliveries of what it already had are exempt);
* **skipped** offsets: holes in the offsets a subscription received, outside declared gaps;
* **manifest / Parquet gaps and overlaps**: per topic (or table partition), ranges that overlap
  or leave a hole between them.

Events are serialisable to JSON lines (``History(path=...)`` appends each event as it is
logged, ``History.load(path)`` reads a file back), so child processes can log to a file the
test reads afterwards. Logging is thread-safe; asyncio tasks on one loop may log freely.
Event order is ``time.monotonic_ns()`` (system-wide on Linux, so comparable across processes of
one machine), ties broken by the order of logging.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: How many examples of each violation a report keeps.
EXAMPLES = 5


@dataclass(frozen=True, slots=True)
class Write:
    """One publish attempt of a producer's message."""

    topic: str
    producer: str
    sequence: int
    """The producer's own number for the message (also carried in its payload, see
    ``message_id``), the same across retries of the message."""
    acked: bool
    """Whether the producer was told the message is durable."""
    offset: int | None = None
    """The offset the producer was told (``None``: the client does not say, or no ack)."""
    since: int | None = None
    """For a client that resends internally without idempotence (danube-client): when the
    attempt began (``time.monotonic_ns()``). Each fault logged between then and the answer may
    have stored one more copy (the answer of a stored copy was lost), so one more copy is
    within the window. ``None``: the client does not resend on its own, or resends
    idempotently (``danube_ingest.client``)."""
    t: int = 0


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message a consumer received."""

    topic: str
    subscription: str
    consumer: str
    offset: int
    producer: str | None = None
    """Who wrote it and its sequence, from the payload (``parse_message_id``); ``None`` for
    messages not written by a logged producer."""
    sequence: int | None = None
    t: int = 0


@dataclass(frozen=True, slots=True)
class Ack:
    """A consumer's ack of one delivered offset (logged once the client accepted the ack)."""

    topic: str
    subscription: str
    consumer: str
    offset: int
    t: int = 0


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault the test injected (``kind``: e.g. ``sigkill``, ``truncate``, ``etcd-down``)."""

    kind: str
    detail: str = ""
    t: int = 0


Event = Write | Delivery | Ack | Fault
_KINDS: dict[str, type[Event]] = {"write": Write, "delivery": Delivery, "ack": Ack, "fault": Fault}
_NAMES = {cls: name for name, cls in _KINDS.items()}


def message_id(producer: str, sequence: int) -> bytes:
    """The payload prefix that names a message's producer and sequence (``parse_message_id``
    reads it back); producers may append anything after a space."""
    return f"{producer}:{sequence}".encode()


def parse_message_id(payload: bytes) -> tuple[str, int] | None:
    """``(producer, sequence)`` from a payload made with ``message_id``, else ``None``."""
    head = payload.split(b" ", 1)[0].decode(errors="replace")
    producer, sep, sequence = head.rpartition(":")
    if not sep or not producer or not sequence.isdigit():
        return None
    return producer, int(sequence)


class History:
    """The events of one fault test, in logging order; optionally appended to a JSON-lines file
    as they are logged (flushed per event, so a killed process loses at most the line it was
    writing, which ``load`` then ignores)."""

    def __init__(self, path: Path | str | None = None) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    def _log(self, event: Event) -> None:
        with self._lock:
            event = dataclasses.replace(event, t=time.monotonic_ns())
            self._events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(_encode(event)) + "\n")
                self._file.flush()

    def write(
        self,
        topic: str,
        producer: str,
        sequence: int,
        *,
        acked: bool,
        offset: int | None = None,
        since: int | None = None,
    ) -> None:
        """Log a publish attempt: ``acked`` if the producer was told it is durable;
        ``since`` (see ``Write.since``) for clients that resend internally."""
        self._log(Write(topic, producer, sequence, acked, offset, since))

    def delivery(
        self, topic: str, subscription: str, consumer: str, offset: int, payload: bytes = b""
    ) -> None:
        """Log a received message; its producer and sequence are parsed from ``payload``."""
        parsed = parse_message_id(payload)
        producer, sequence = parsed if parsed is not None else (None, None)
        self._log(Delivery(topic, subscription, consumer, offset, producer, sequence))

    def ack(self, topic: str, subscription: str, consumer: str, offset: int) -> None:
        """Log a consumer's ack of ``offset``."""
        self._log(Ack(topic, subscription, consumer, offset))

    def fault(self, kind: str, detail: str = "") -> None:
        """Log an injected fault (it opens the window in which acked offsets may come again)."""
        self._log(Fault(kind, detail))

    @property
    def events(self) -> list[Event]:
        """A copy of the events so far, in logging order."""
        with self._lock:
            return list(self._events)

    def extend(self, events: Iterable[Event]) -> None:
        """Add events logged elsewhere (e.g. ``History.load`` of a child's file), keeping their
        timestamps; the events are kept sorted by time."""
        with self._lock:
            self._events.extend(events)
            self._events.sort(key=lambda e: e.t)

    def close(self) -> None:
        """Close the file, if any (logging to it afterwards fails)."""
        if self._file is not None:
            self._file.close()

    @classmethod
    def load(cls, path: Path | str) -> History:
        """The history in a JSON-lines file; a torn last line (its writer was killed) is
        ignored, any other bad line raises ``ValueError`` naming the file and line."""
        history = cls()
        text = Path(path).read_text(encoding="utf-8")
        lines = text.split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                history._events.append(_decode(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                if number == len(lines):  # no newline after it: the writer died mid-line
                    break
                raise ValueError(f"{path}:{number}: not a history event: {exc}") from None
        return history


def _encode(event: Event) -> dict[str, Any]:
    return {"event": _NAMES[type(event)], **dataclasses.asdict(event)}


def _decode(data: dict[str, Any]) -> Event:
    name = data.pop("event")
    return _KINDS[name](**data)


class _Range(Protocol):
    """A manifest entry (``ObjectRange``): offsets ``[start_offset, end_offset)`` of ``topic``."""

    @property
    def topic(self) -> str: ...
    @property
    def start_offset(self) -> int: ...
    @property
    def end_offset(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Span:
    """Offsets ``[start, end)`` of one sequence (a topic, or a table partition)."""

    key: str
    start: int
    end: int


def manifest_spans(ranges: Iterable[_Range]) -> list[Span]:
    """The manifest's entries (``Manifest.ranges`` of each topic) as spans."""
    return [Span(r.topic, r.start_offset, r.end_offset) for r in ranges]


@dataclass
class Report:
    """What ``check`` found; ``ok`` when no violation was counted."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    VIOLATIONS = (
        "lost",
        "duplicated_writes",
        "duplicate_deliveries",
        "non_monotonic",
        "skipped",
        "manifest_gaps",
        "manifest_overlaps",
        "parquet_gaps",
        "parquet_overlaps",
    )

    def _add(self, name: str, example: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        shown = self.examples.setdefault(name, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)

    @property
    def ok(self) -> bool:
        return all(self[name] == 0 for name in self.VIOLATIONS)

    def summary(self) -> str:
        """One line of counts, then the examples of each violation."""
        line = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        lines = [line]
        for name in self.VIOLATIONS:
            for example in self.examples.get(name, []):
                lines.append(f"  {name}: {example}")
        return "\n".join(lines)


def check(
    history: History | Sequence[Event],
    *,
    subscriptions: Iterable[tuple[str, str]] | None = None,
    manifest: Iterable[Span] = (),
    parquet_commits: Iterable[Span] = (),
    gaps: Mapping[str, Iterable[tuple[int, int]]] | None = None,
    declared_lost: Mapping[str, Iterable[tuple[int, int]]] | None = None,
) -> Report:
    """Check a history against the daemon's guarantees (see the module docstring).

    ``subscriptions``: the ``(topic, subscription)`` pairs that must have received every
    acknowledged write of their topic (default: every subscription that received anything;
    a subscription created after some writes must not be named). ``manifest`` and
    ``parquet_commits``: spans (``manifest_spans``; Parquet commits as
    ``Span(partition, first, last + 1)``), each key's spans sorted by start must neither overlap
    nor leave holes. ``gaps``: per topic, ``[start, end)`` offset ranges that legitimately never
    existed (an offset jump), exempt from the ``skipped`` and gap checks. ``declared_lost``:
    per topic, ``[start, end)`` ranges declared lost (jumps with reason ``lost``): gaps as
    above, and an acknowledged write placed in one (see the module docstring) is counted in
    ``declared_lost``, never in ``lost``, whichever subscriptions received it.
    """
    events = history.events if isinstance(history, History) else list(history)
    allowed = {topic: list(spans) for topic, spans in (gaps or {}).items()}
    written_off = {topic: list(spans) for topic, spans in (declared_lost or {}).items()}
    for topic, spans in written_off.items():
        allowed.setdefault(topic, []).extend(spans)
    report = Report()
    counts = report.counts
    writes = [e for e in events if isinstance(e, Write)]
    deliveries = [e for e in events if isinstance(e, Delivery)]
    counts["writes"] = len(writes)
    counts["acked_writes"] = len({(w.topic, w.producer, w.sequence) for w in writes if w.acked})
    counts["deliveries"] = len(deliveries)
    counts["acks"] = sum(1 for e in events if isinstance(e, Ack))
    counts["faults"] = sum(1 for e in events if isinstance(e, Fault))
    for name in Report.VIOLATIONS:
        counts.setdefault(name, 0)
    counts.setdefault("redelivered_after_ack", 0)
    counts.setdefault("resent_copies", 0)
    counts.setdefault("declared_lost", 0)

    if subscriptions is None:
        checked = sorted({(d.topic, d.subscription) for d in deliveries})
    else:
        checked = sorted(set(subscriptions))
    _check_lost(report, writes, deliveries, checked, written_off)
    faults = [e.t for e in events if isinstance(e, Fault)]
    _check_duplicated_writes(report, writes, deliveries, faults)
    _check_subscriptions(report, events, allowed)
    _check_spans(report, manifest, "manifest", allowed)
    _check_spans(report, parquet_commits, "parquet", allowed)
    return report


def assert_history_ok(history: History | Sequence[Event], **options: Any) -> Report:
    """``check(history, **options)``, failing with its summary unless it is ``ok``; returns the
    report (for the figures a test prints)."""
    report = check(history, **options)
    assert report.ok, "history check failed:\n" + report.summary()
    return report


def _check_lost(
    report: Report,
    writes: Sequence[Write],
    deliveries: Sequence[Delivery],
    checked: Sequence[tuple[str, str]],
    written_off: Mapping[str, list[tuple[int, int]]],
) -> None:
    told: dict[tuple[str, str, int], int | None] = {}
    for w in writes:
        if w.acked:
            key = (w.topic, w.producer, w.sequence)
            if told.get(key) is None:
                told[key] = w.offset
    received: dict[tuple[str, str], dict[tuple[str, int], set[int]]] = defaultdict(
        lambda: defaultdict(set)
    )
    at_offset: dict[tuple[str, str], dict[int, tuple[str | None, int | None]]] = defaultdict(dict)
    placed: dict[tuple[str, str, int], set[int]] = defaultdict(set)  # where anyone received it
    for d in deliveries:
        if d.producer is not None and d.sequence is not None:
            received[(d.topic, d.subscription)][(d.producer, d.sequence)].add(d.offset)
            placed[(d.topic, d.producer, d.sequence)].add(d.offset)
        at_offset[(d.topic, d.subscription)][d.offset] = (d.producer, d.sequence)
    for key, offset in sorted(told.items()):
        ranges = written_off.get(key[0], [])
        stored = {offset} if offset is not None else placed.get(key, set())
        if ranges and stored and all(_inside(o, o + 1, ranges) for o in stored):
            report.counts["declared_lost"] += 1
            del told[key]
    for topic, subscription in checked:
        got = received[(topic, subscription)]
        slots = at_offset[(topic, subscription)]
        for (w_topic, producer, sequence), offset in sorted(told.items()):
            if w_topic != topic:
                continue
            where = f"{topic} {subscription!r} {producer}:{sequence}"
            seen = got.get((producer, sequence))
            if not seen:
                report._add("lost", f"{where} acknowledged (offset {offset}), never delivered")
            elif offset is not None and offset not in seen:
                holder = slots.get(offset)
                report._add(
                    "lost",
                    f"{where} acknowledged at offset {offset}, delivered at {sorted(seen)}; "
                    f"offset {offset} held {holder}",
                )


def _check_duplicated_writes(
    report: Report, writes: Sequence[Write], deliveries: Sequence[Delivery], faults: Sequence[int]
) -> None:
    attempts: dict[tuple[str, str, int], list[Write]] = defaultdict(list)
    for w in writes:
        attempts[(w.topic, w.producer, w.sequence)].append(w)
    stored: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    for d in deliveries:
        if d.producer is not None and d.sequence is not None:
            stored[(d.topic, d.producer, d.sequence)].add(d.offset)
    for key, offsets in sorted(stored.items()):
        tries = attempts.get(key, [])
        allowed = sum(1 for w in tries if not w.acked) + (1 if any(w.acked for w in tries) else 0)
        for w in tries:
            if w.since is not None:
                allowed += sum(1 for t in faults if w.since <= t <= w.t)
        if 1 < len(offsets) <= allowed:
            report.counts["resent_copies"] += len(offsets) - 1
        elif len(offsets) > max(allowed, 1):
            topic, producer, sequence = key
            report._add(
                "duplicated_writes",
                f"{topic} {producer}:{sequence} stored at offsets {sorted(offsets)} after "
                f"{len(tries)} attempt(s), {sum(w.acked for w in tries)} acknowledged",
            )


def _check_subscriptions(
    report: Report, events: Sequence[Event], allowed: Mapping[str, list[tuple[int, int]]]
) -> None:
    delivered: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)  # offset: last time
    acked_at: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    newest: dict[tuple[str, str, str], int] = {}
    last_fault = -1
    for e in events:
        if isinstance(e, Fault):
            last_fault = e.t
        elif isinstance(e, Ack):
            acked_at[(e.topic, e.subscription)].setdefault(e.offset, e.t)
        elif isinstance(e, Delivery):
            sub = (e.topic, e.subscription)
            where = f"{e.topic} {e.subscription!r} consumer {e.consumer!r} offset {e.offset}"
            before = delivered[sub].get(e.offset)
            delivered[sub][e.offset] = e.t
            if before is not None:
                acked = acked_at[sub].get(e.offset)
                if acked is not None:
                    # A fault since the previous delivery: its ack may not have been persisted
                    # (or was still on the way when the daemon died).
                    if before < last_fault:
                        report.counts["redelivered_after_ack"] += 1
                    else:
                        report._add(
                            "duplicate_deliveries", f"{where} delivered again after its ack"
                        )
                    # A redelivery restarts the offset's window: its next ack is awaited anew.
                    del acked_at[sub][e.offset]
                continue
            stream = (e.topic, e.subscription, e.consumer)
            previous = newest.get(stream)
            if previous is not None and e.offset < previous:
                report._add("non_monotonic", f"{where} first delivered after offset {previous}")
            newest[stream] = max(e.offset, previous if previous is not None else e.offset)
    for (topic, subscription), offsets in sorted(delivered.items()):
        holes = _holes(sorted(offsets), allowed.get(topic, []))
        for start, end in holes:
            report._add(
                "skipped", f"{topic} {subscription!r} never received offsets [{start}, {end})"
            )


def _holes(offsets: Sequence[int], allowed: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` holes between consecutive sorted ``offsets`` not inside an allowed
    range."""
    for before, after in itertools.pairwise(offsets):
        if after > before + 1 and not _inside(before + 1, after, allowed):
            yield before + 1, after


def _inside(start: int, end: int, allowed: Sequence[tuple[int, int]]) -> bool:
    """Whether ``[start, end)`` is covered by the union of ``allowed``."""
    position = start
    for low, high in sorted(allowed):
        if low <= position < high:
            position = high
        if position >= end:
            return True
    return position >= end


def _check_spans(
    report: Report, spans: Iterable[Span], what: str, allowed: Mapping[str, list[tuple[int, int]]]
) -> None:
    by_key: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_key[span.key].append(span)
    for key, items in sorted(by_key.items()):
        items.sort(key=lambda s: (s.start, s.end))
        for before, after in itertools.pairwise(items):
            if after.start < before.end:
                report._add(
                    f"{what}_overlaps",
                    f"{key} [{before.start}, {before.end}) overlaps [{after.start}, {after.end})",
                )
            elif after.start > before.end and not _inside(
                before.end, after.start, allowed.get(key, [])
            ):
                report._add(
                    f"{what}_gaps", f"{key} has no {what} entry for [{before.end}, {after.start})"
                )
