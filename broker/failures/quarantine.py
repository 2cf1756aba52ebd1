"""Bad-row quarantine: how a failing batch is split until its bad rows stand alone, and how many a job may have.

A run that fails for a reason tied to its input (`bad_input`) is split in halves and each half run
again, until every failing row is alone (docs/failures.md, "Bad-row quarantine"). The worker carries
it out (`sits_worker/serving/execution.py` for job chunks, `sits_worker/serving/request_runs.py` for merged requests);
what to split, when a half need not run, and when to give up is decided here, without a model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

E = TypeVar("E")

SHOWN_ROWS = 20
"""Most bad rows a job's error names; the rest are counted."""


@dataclass
class Isolation(Generic[E]):
    """What `isolate_bad_rows` found: each bad row's offset with its own error, in row order, and
    whether it stopped because more than `allowed` rows failed."""

    bad: list[tuple[int, E]] = field(default_factory=list)
    over_limit: bool = False
    runs: int = 0


class _OverLimit(Exception):
    """Internal: stop the bisection, more rows failed than allowed."""


def isolate_bad_rows(count: int, error: E, attempt: Callable[[int, int], E | None], *,
                     allowed: int | float = math.inf) -> Isolation[E]:
    """Split offsets [0, count), whose run just failed with `error`, in halves until each failing row
    is alone; `attempt(lo, hi)` runs offsets [lo, hi) (keeping their outputs on success) and returns
    None, or the error that is tied to those rows.

    Each level halves a range, so a bad row costs at most ceil(log2(count)) levels. When the first
    half of a failing range runs clean, the second must hold the bad row: it is split without a run
    of its own (one run saved per level). A single row is always run on its own, so every
    quarantined row failed by itself with its own error. More than `allowed` bad rows stop the
    bisection at once (`over_limit`): the job fails anyway, more runs would be waste.
    """
    found: Isolation[E] = Isolation()

    def run(lo: int, hi: int) -> E | None:
        found.runs += 1
        return attempt(lo, hi)

    def split(lo: int, hi: int, failure: E | None, ran: bool) -> None:
        if hi - lo == 1:
            own = failure if ran else run(lo, hi)
            if own is not None:
                found.bad.append((lo, own))
                if len(found.bad) > allowed:
                    raise _OverLimit
            return
        mid = (lo + hi) // 2
        left = run(lo, mid)
        if left is not None:
            split(lo, mid, left, True)
            right = run(mid, hi)
            if right is not None:
                split(mid, hi, right, True)
        else:  # the failure lies in the right half (or was not tied to rows: its rows then run clean)
            split(mid, hi, failure, False)

    if count < 1:
        return found
    try:
        split(0, count, error, True)
    except _OverLimit:
        found.over_limit = True
    return found


def bad_row_limit(max_bad_rows: int | float, rows_total: int) -> int:
    """The most rows of a job of `rows_total` rows that may be quarantined: `max_bad_rows` itself when
    it is a count (an int), else that share of the rows, rounded down."""
    if isinstance(max_bad_rows, int):
        return max_bad_rows
    return math.floor(max_bad_rows * rows_total + 1e-9)


def entry_line(row: int, error: str, row_id: object = None) -> str:
    """One line of `quarantine.jsonl`: the job row, its id (`row_id`, a table input's id column; left out when
    None) and its error (the same bytes for the same row)."""
    named = {} if row_id is None else {"id": row_id}
    return json.dumps({"row": int(row), **named, "error": error}, default=str) + "\n"


def read_entries(text: str) -> list[dict[str, Any]]:
    """The entries of quarantine lines (`entry_line`), in their order."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def too_many_message(rows: Sequence[int], first_error: str, *, limit: int, rows_total: int) -> str:
    """A job's error when more than its limit of rows failed: how many, which (the first
    `SHOWN_ROWS`), the first one's error, and what to do."""
    shown = ", ".join(str(row) for row in rows[:SHOWN_ROWS]) + (
        f" and {len(rows) - SHOWN_ROWS} more" if len(rows) > SHOWN_ROWS else "")
    return (f"{len(rows)} rows failed, more than jobs.max_bad_rows allows ({limit} of this job's {rows_total:,} "
            f"rows): rows {shown}; row {rows[0]}: {first_error}. Fix those rows, or raise jobs.max_bad_rows "
            "to quarantine them")


def fill_value(dtype: np.dtype, fill: float) -> float | int | bool:
    """What a quarantined row holds in an output of `dtype`: `fill` (`jobs.quarantine_fill`) where
    the dtype can hold it; else -1 for signed integers, 0 for unsigned ones, False for booleans."""
    if dtype.kind in "fc":
        return fill
    if dtype.kind == "b":
        return bool(fill) if math.isfinite(fill) else False
    if dtype.kind in "iu" and math.isfinite(fill) and fill == int(fill):
        info = np.iinfo(dtype)
        if info.min <= int(fill) <= info.max:
            return int(fill)
    return -1 if dtype.kind == "i" else 0


def json_number(value: float | int | bool) -> float | int | bool | str:
    """`value` as strict JSON holds it: NaN and the infinities as the strings 'NaN', 'Infinity', '-Infinity'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value
