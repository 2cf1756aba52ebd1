"""A job's `deadline` time read at the API's edge: what it may be, and the 400s that say what to write."""

from __future__ import annotations

import pytest

from broker.errors import BadInput
from sits_api.intake.job_deadlines import deadline_at
from sits_api.schemas import JobSubmission

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def body(deadline: str) -> JobSubmission:
    return JobSubmission.model_validate({"model": "mlp", "input_batch": "/in.npy", "output_dir": "/out",
                                         "deadline": deadline})


def test_a_deadline_time_within_a_day_back_and_366_days_ahead_is_taken() -> None:
    assert deadline_at(body("2027-01-15T09:00:00+01:00"), now=NOW) == NOW
    assert deadline_at(body("2027-01-16T08:00:00Z"), now=NOW) == pytest.approx(NOW + 86_400)


@pytest.mark.parametrize("deadline", ["0001-01-01T00:00:00+14:00", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z",
                                      "2027-01-13T08:00:00Z", "2028-01-17T08:00:00Z"])
def test_a_deadline_time_far_from_now_is_a_400_not_a_500(deadline: str) -> None:
    """Year 1 with a +14:00 offset failed date arithmetic in admission (a 500); any deadline further than
    `deadline_s` may reach is a mistake."""
    with pytest.raises(BadInput, match="more than a day before now or more than 366 days after it"):
        deadline_at(body(deadline), now=NOW)
