"""Typed views of a few fields of a Redis hash, read by name.

A reader that needs some fields of a record's hash (a job's, say) declares them once as a frozen
dataclass on `HashView`: `names()` is what its HMGET asks for, `of(reply)` the view with each field
named, so no caller reads a reply by position and a field added to the read cannot shift the others.
Values stay as Redis holds them (text, or None for a field the hash lacks); the view's readers convert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Self


class HashView:
    """The base of a dataclass whose fields are the hash fields one HMGET reads, in order."""

    @classmethod
    def names(cls) -> list[str]:
        """The hash fields to ask for, in the order `of` expects them."""
        return [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def of(cls, values: Sequence[str | None]) -> Self:
        """The view of an HMGET reply of `names()`."""
        return cls(*values)
