"""Parsing of durations ("3600s", "250ms", "5m") and sizes ("128MiB", "2GB").

Units are explicit in the configuration (STYLE.md, "Configuration"); a bare
number means seconds or bytes.
"""

from __future__ import annotations

import math
import re

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
