"""The field types every settings section uses, and the units they are written in.

Durations ("3600s", "250ms", "5m") and sizes ("128MiB", "2GB") are parsed from their units; a bare
number means seconds or bytes. Numbers are never booleans, priority levels run from 0 to
`MAX_PRIORITY`, and a section refuses unknown keys and is frozen once loaded. Every concept's
settings section is built from these, so this module sits below all of them.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

MAX_PRIORITY = 15
"""The highest priority level (levels run 0-15; PSA jumps reach 12 and 15)."""

UserTier = Literal["vip", "premium", "free"]
"""The tiers a request may name as its `user_tier`; each weighs its lateness (`scoring.SLA_WEIGHTS`), and a
tenant's `user_tiers` may narrow them."""

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_NUMBER_AND_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: str | int | float) -> float:
    """Seconds in `value` ("3600s", "250ms", "5m", 30); ValueError names the accepted units."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not a duration; use a number with ms, s, m, h or d (e.g. '3600s')")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _NUMBER_AND_UNIT.match(value)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in _DURATION_UNITS):
            raise ValueError(f"{value!r} is not a duration; use a number with ms, s, m, h or d (e.g. '3600s')")
        seconds = float(match.group(1)) * _DURATION_UNITS[unit or "s"]
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds < 0:
        raise ValueError(f"{value!r} is negative; a duration must be >= 0")
    return seconds


def parse_size(value: str | int | float) -> int:
    """Bytes in `value` ("128MiB", "2GB", 4096); ValueError names the accepted units."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not a size; use a number with B, KiB, MiB, GiB, KB, MB or GB")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{value!r} is not a whole number of bytes; write it with a unit, e.g. '1.5GiB'")
    if isinstance(value, int | float):
        size = int(value)
    else:
        match = _NUMBER_AND_UNIT.match(value)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in _SIZE_UNITS):
            raise ValueError(f"{value!r} is not a size; use a number with B, KiB, MiB, GiB, KB, MB or GB")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit or "b"])
    if size < 0:
        raise ValueError(f"{value!r} is negative; a size must be >= 0")
    return size



def _not_a_bool(value: Any) -> Any:
    """Refuse a boolean where a number is meant: pydantic would read YAML `true` as 1."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is a boolean, not a number; write a number (YAML reads true, false, yes, no, "
                         "on and off as booleans)")
    return value


Seconds = Annotated[float, BeforeValidator(parse_duration)]
Bytes = Annotated[int, BeforeValidator(parse_size)]
Integer = Annotated[int, BeforeValidator(_not_a_bool)]
"""A whole number, also written as a string (`SITS_*` values are), never a boolean."""
Number = Annotated[float, BeforeValidator(_not_a_bool)]
"""A number, also written as a string, never a boolean."""


class Section(BaseModel):
    """A settings section: unknown keys are errors, and values never change once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def count_or_auto(value: Any, what: str, *, most: int | None = None) -> Any:
    """A whole number >= 1 (at most `most`), also written as a string, or 'auto'; ValueError says `what`."""
    text = value.strip() if isinstance(value, str) else value
    if text == "auto":
        return text
    if isinstance(text, str) and text.isdigit():
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool) and 1 <= text <= (most or text):
        return text
    raise ValueError(f"{value!r} is neither {what} nor 'auto'")
