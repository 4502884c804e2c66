"""Where a new subscription starts reading: ``earliest``, ``latest``, an offset or a time.

Danube's ``ConsumerRequest`` has no field for it, and danube-client must work unchanged, so the
position travels as gRPC invocation metadata on ``ConsumerService.Subscribe``::

    x-danube-ingest-start: earliest | latest | offset:N | time:MS | time:ISO8601

danube-client never sends it, so its subscriptions keep Danube's default, ``latest``. Our CLI
sends it by making the first Subscribe itself (see ``cli.client``).

Guarantees:

* A start position applies only when the subscription is created (it has no cursor yet). An
  existing subscription resumes after its cursor whatever position is asked for.
* ``earliest`` is the oldest offset still readable: in objects when an object store is
  attached, else in the local WAL.
* ``offset:N`` starts at N, clamped to [earliest, end]: an offset beyond the end means "from the
  end", one below the retained data means "from the oldest retained".
* ``time:T`` starts at the first offset whose ingest time is >= T (ingest times never decrease
  within a topic); when no entry is that recent, at the end.
* Non-reliable topics deliver live messages only; the position is ignored there.
* A malformed value raises :class:`InvalidStartPositionError` (``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from danube_ingest.broker.errors import InvalidRequestError

#: The invocation-metadata key carrying a start position on Subscribe (lower case: gRPC
#: metadata keys are).
METADATA_KEY = "x-danube-ingest-start"

StartKind = Literal["earliest", "latest", "offset", "time"]

_FORMS = (
    "'earliest', 'latest', an offset (N or offset:N), or a time (ISO 8601 such as "
    "2026-11-24T10:00:00Z, or time:MILLISECONDS since the epoch)"
)
_DIGITS = re.compile(r"[0-9]+")


class InvalidStartPositionError(InvalidRequestError):
    """A start position that is none of the accepted forms (``INVALID_ARGUMENT``)."""


@dataclass(frozen=True, slots=True)
class StartPosition:
    """Where a subscription created by this Subscribe starts."""

    kind: StartKind
    value: int = 0
    """The offset (``offset``) or the ingest time in ms since the epoch (``time``); else 0."""

    @classmethod
    def parse(cls, text: str) -> StartPosition:
        """Parse ``earliest``, ``latest``, ``N`` / ``offset:N``, an ISO 8601 time (naive
        means UTC), or ``time:MS`` / ``time:ISO8601``; raise ``InvalidStartPositionError``."""
        raw = text.strip()
        word = raw.lower()
        if word in ("earliest", "latest"):
            return cls(word)  # type: ignore[arg-type]
        if _DIGITS.fullmatch(raw):
            return cls("offset", int(raw))
        if word.startswith("offset:"):
            number = raw[len("offset:") :]
            if _DIGITS.fullmatch(number):
                return cls("offset", int(number))
            raise InvalidStartPositionError(
                f"start position {text!r}: offset must be a whole number >= 0; use {_FORMS}"
            )
        when = raw[len("time:") :] if word.startswith("time:") else raw
        if _DIGITS.fullmatch(when):
            return cls("time", int(when))
        try:
            moment = datetime.fromisoformat(when)
        except ValueError:
            raise InvalidStartPositionError(
                f"start position {text!r} is not understood; use {_FORMS}"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return cls("time", int(moment.timestamp() * 1000))

    def to_metadata(self) -> str:
        """The canonical wire form (``METADATA_KEY``'s value)."""
        if self.kind in ("offset", "time"):
            return f"{self.kind}:{self.value}"
        return self.kind

    def __str__(self) -> str:
        return self.to_metadata()


LATEST = StartPosition("latest")
EARLIEST = StartPosition("earliest")


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> StartPosition:
    """The start position in a call's invocation metadata (pairs of key, value); ``LATEST``
    when absent, Danube's default. Raises ``InvalidStartPositionError`` for a bad value."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            return StartPosition.parse(text)
    return LATEST


__all__ = [
    "EARLIEST",
    "LATEST",
    "METADATA_KEY",
    "InvalidStartPositionError",
    "StartPosition",
    "from_metadata",
]
