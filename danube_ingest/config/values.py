"""Value syntax of the configuration: sizes, durations, paths, and the field types using them."""

from __future__ import annotations

import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    SecretStr,
)

from danube_ingest.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# --------------------------------------------------------------------------- value parsing

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_HINT = "use bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB): '8MiB'"

_DURATION_UNITS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "min": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}
_DURATION_HINT = "use a number or a number with a unit (ms, s, m, h, d), e.g. '500ms' or '10s'"
_UNIT_NAMES = {"ms": "milliseconds", "s": "seconds", "min": "minutes"}

_NUMBER_WITH_UNIT = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[A-Za-z]*)")


def _finite_non_negative(amount: Decimal, value: object, what: str, hint: str) -> Decimal:
    if not amount.is_finite():
        raise ConfigError(f"invalid {what} {value!r}: {hint}")
    if amount < 0:
        raise ConfigError(f"invalid {what} {value!r}: must not be negative")
    return amount


def parse_size(value: str | int | float) -> int:
    """Return a size in bytes.

    An int is a byte count. A string is a byte count or a number with a unit: ``KB``, ``MB``,
    ``GB``, ``TB`` are powers of 1000, ``KiB``, ``MiB``, ``GiB``, ``TiB`` powers of 1024; units are
    case-insensitive and may follow a space (``"1.5 GiB"``). Raises ConfigError for anything else,
    including negative sizes and fractions of a byte.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"invalid size {value!r}: {_SIZE_HINT}")
    if isinstance(value, str):
        match = _NUMBER_WITH_UNIT.fullmatch(value.strip())
        unit = match["unit"].lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"invalid size {value!r}: {_SIZE_HINT}")
        amount = Decimal(match["number"]) * _SIZE_UNITS[unit]
    else:
        amount = _finite_non_negative(Decimal(value), value, "size", _SIZE_HINT)
    if amount != amount.to_integral_value():
        raise ConfigError(f"invalid size {value!r}: not a whole number of bytes")
    return int(amount)


def _duration(value: str | int | float, unit: str) -> Decimal:
    """The duration ``value`` expressed in ``unit``; a bare number is already in ``unit``."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"invalid duration {value!r}: {_DURATION_HINT}")
    if not isinstance(value, str):
        return _finite_non_negative(Decimal(value), value, "duration", _DURATION_HINT)
    match = _NUMBER_WITH_UNIT.fullmatch(value.strip())
    if match is None or (match["unit"] and match["unit"].lower() not in _DURATION_UNITS):
        raise ConfigError(f"invalid duration {value!r}: {_DURATION_HINT}")
    amount = Decimal(match["number"])
    if not match["unit"]:
        return amount
    return amount * _DURATION_UNITS[match["unit"].lower()] / _DURATION_UNITS[unit]


def parse_duration(value: str | int | float) -> float:
    """Return a duration in seconds.

    A number is seconds. A string is a number, optionally followed by a unit: ``ms``, ``s``,
    ``m`` or ``min``, ``h``, ``d`` (``"500ms"``, ``"1.5s"``, ``"48h"``). Raises ConfigError for
    anything else, including negative durations.
    """
    return float(_duration(value, "s"))


# ------------------------------------------------------------------ field types (private)


def _size_input(value: object) -> object:
    if isinstance(value, str | int | float):
        return parse_size(value)
    return value


def _duration_input(unit: str, *, whole: bool) -> BeforeValidator:
    """Accept a number in ``unit`` or a string with any duration unit; ``whole``: an int field."""

    def convert(value: object) -> object:
        if not isinstance(value, str | int | float):
            return value
        amount = _duration(value, unit)
        if not whole:
            return float(amount)
        if amount != amount.to_integral_value():
            raise ConfigError(f"must be a whole number of {_UNIT_NAMES[unit]} (got {value!r})")
        return int(amount)

    return BeforeValidator(convert)


def _no_bool(value: object) -> object:
    # pydantic's lax mode turns true/false into 1/0; for a count that is always a typo.
    if isinstance(value, bool):
        raise ConfigError(f"must be a whole number (got {value!r})")
    return value


def _empty_to_none(value: object) -> object:
    return None if isinstance(value, str) and not value.strip() else value


def _expand_path(value: object) -> object:
    if isinstance(value, str | os.PathLike):
        text = os.fspath(value)
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("must be a non-empty path")
        try:
            return Path(text).expanduser()
        except RuntimeError:  # ~name of a user this machine does not have
            raise ConfigError(f"cannot expand {text!r}: no such user (~name)") from None
    return value


_Bytes = Annotated[int, BeforeValidator(_size_input)]
_Count = Annotated[int, BeforeValidator(_no_bool)]
_Millis = Annotated[int, _duration_input("ms", whole=True)]
_Seconds = Annotated[float, _duration_input("s", whole=False)]
_WholeSeconds = Annotated[int, _duration_input("s", whole=True)]
_Minutes = Annotated[int, _duration_input("min", whole=True)]
_Path = Annotated[Path, BeforeValidator(_expand_path)]
# Optional keys: "" (e.g. ${VAR:-} with VAR unset) means null. Before-validators run last to
# first, so _empty_to_none sees the raw value.
_OptionalStr = Annotated[str | None, BeforeValidator(_empty_to_none)]
_OptionalSecret = Annotated[SecretStr | None, BeforeValidator(_empty_to_none)]
_OptionalMinutes = Annotated[
    int | None, _duration_input("min", whole=True), BeforeValidator(_empty_to_none)
]
_OptionalBytes = Annotated[
    int | None, BeforeValidator(_size_input), BeforeValidator(_empty_to_none)
]
_OptionalPath = Annotated[
    Path | None, BeforeValidator(_expand_path), BeforeValidator(_empty_to_none)
]


class _FieldError(ValueError):
    """A cross-field check failed; ``key`` is the offending key relative to the model."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
