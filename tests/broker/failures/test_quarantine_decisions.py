"""The bisection decision of bad-row quarantine (`broker/failures/quarantine.py`), without a model: a fake run
that fails on the ranges holding a bad row."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.failures.quarantine import (
    bad_row_limit,
    entry_line,
    fill_value,
    isolate_bad_rows,
    json_number,
    read_entries,
    too_many_message,
)


class FakeRuns:
    """Runs offsets [lo, hi): fails naming its first bad row when it holds one, else keeps the rows."""

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.kept, self.calls = bad, [], []

    def __call__(self, lo: int, hi: int) -> str | None:
        self.calls.append((lo, hi))
        failing = sorted(self.bad & set(range(lo, hi)))
        if failing:
            return f"row {failing[0]} fails" if hi - lo == 1 else f"rows {failing} fail"
        self.kept.extend(range(lo, hi))
        return None


def _levels(calls: list[tuple[int, int]], count: int) -> int:
    """The deepest bisection level among the runs (level 1: a half of the whole)."""
    return max((round(math.log2(count / (hi - lo))) for lo, hi in calls), default=0)


def test_one_bad_row_is_isolated_in_at_most_ceil_log2_n_levels_with_its_own_error() -> None:
    runs = FakeRuns({37})
    found = isolate_bad_rows(100, "rows [37] fail", runs)

    assert found.bad == [(37, "row 37 fails")] and not found.over_limit
    assert sorted(runs.kept) == [row for row in range(100) if row != 37]  # every good row ran exactly once
    assert _levels(runs.calls, 100) <= math.ceil(math.log2(100))
    assert found.runs == len(runs.calls) <= 2 * math.ceil(math.log2(100))


def test_a_half_after_a_clean_half_is_split_without_a_run_of_its_own() -> None:
    runs = FakeRuns({7})
    isolate_bad_rows(8, "bad", runs)

    assert runs.calls == [(0, 4), (4, 6), (6, 7), (7, 8)]  # [4, 8) and [6, 8) were known to fail


def test_a_failure_not_tied_to_rows_quarantines_nothing() -> None:
    runs = FakeRuns(set())  # the first run failed, every run again succeeds (a flake)
    found = isolate_bad_rows(16, "flaky", runs)

    assert found.bad == [] and sorted(runs.kept) == list(range(16))


def test_more_bad_rows_than_allowed_stops_at_the_first_one_past_the_limit() -> None:
    runs = FakeRuns({1, 5, 9, 13})
    found = isolate_bad_rows(16, "bad", runs, allowed=2)

    assert found.over_limit and [row for row, _ in found.bad] == [1, 5, 9]
    assert not any(lo <= 13 < hi and hi - lo == 1 for lo, hi in runs.calls)  # no run past the limit


def test_none_allowed_still_names_the_first_bad_row() -> None:
    found = isolate_bad_rows(8, "bad", FakeRuns({3, 6}), allowed=0)

    assert found.over_limit and found.bad == [(3, "row 3 fails")]


def test_a_single_row_that_failed_is_quarantined_without_another_run() -> None:
    runs = FakeRuns({0})
    assert isolate_bad_rows(1, "row 0 fails", runs).bad == [(0, "row 0 fails")] and runs.calls == []
    assert isolate_bad_rows(0, "nothing", runs).bad == []


@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1,
                                                                             max_size=8))))
def test_exactly_the_bad_rows_are_found_and_every_good_row_runs_once(case: tuple[int, set[int]]) -> None:
    count, bad = case
    runs = FakeRuns(bad)
    found = isolate_bad_rows(count, "bad", runs)

    assert [row for row, _ in found.bad] == sorted(bad)
    assert sorted(runs.kept) == sorted(set(range(count)) - bad)
    assert _levels(runs.calls, count) <= max(1, math.ceil(math.log2(count)))
    assert found.runs <= 2 * len(bad) * max(1, math.ceil(math.log2(count)))


def test_the_limit_is_a_count_or_a_share_of_the_job_s_rows() -> None:
    assert bad_row_limit(5, 20_000) == 5 and bad_row_limit(0, 10) == 0
    assert bad_row_limit(0.001, 20_000) == 20 and bad_row_limit(0.001, 999) == 0 and bad_row_limit(0.5, 3) == 1
    assert bad_row_limit(0.07, 100) == 7  # no float rounding below the share


def test_the_error_names_the_rows_and_the_first_one_s_error() -> None:
    message = too_many_message(list(range(25)), "token id 99 past the vocabulary", limit=3, rows_total=20_000)

    assert message.startswith("25 rows failed, more than jobs.max_bad_rows allows (3 of this job's 20,000 rows)")
    assert "rows 0, 1, 2" in message and "19 and 5 more" in message and "row 0: token id 99" in message


def test_quarantine_lines_round_trip_as_the_same_bytes() -> None:
    text = entry_line(17, 'bad "row"') + entry_line(4096, "x")
    assert read_entries(text) == [{"row": 17, "error": 'bad "row"'}, {"row": 4096, "error": "x"}]
    assert entry_line(17, 'bad "row"') == text.splitlines(keepends=True)[0]


@pytest.mark.parametrize(("dtype", "fill", "expected"), [
    ("float32", math.nan, math.nan), ("float64", -1.5, -1.5), ("int64", math.nan, -1), ("int32", 7.0, 7),
    ("uint8", math.nan, 0), ("uint8", 300.0, 0), ("int8", 2.5, -1), ("bool", math.nan, False),
])
def test_the_fill_value_fits_the_output_s_dtype(dtype: str, fill: float, expected: float) -> None:
    got = fill_value(np.dtype(dtype), fill)
    assert (math.isnan(got) and math.isnan(expected)) if isinstance(got, float) and math.isnan(got) else got == expected
    np.full(2, got, dtype=dtype)  # it fits


def test_fill_values_are_strict_json() -> None:
    assert [json_number(v) for v in (math.nan, math.inf, -math.inf, 0.5, -1)] == ["NaN", "Infinity", "-Infinity",
                                                                                    0.5, -1]
