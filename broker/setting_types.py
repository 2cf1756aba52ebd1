"""The field types every settings section uses: durations, sizes, numbers that are never booleans,
and the base of a section (unknown keys refused, values frozen). Shared by `broker/config.py` and
`broker/failure_settings.py`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict

from broker.units import parse_duration, parse_size


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
