"""The SLA violation predictor (`broker/sla/predictor.py`): its features, its prior (the plain rule made
smooth), what one job's ending teaches it, and the AUC that rates it."""

from __future__ import annotations

import math

import pytest

from broker.sla.predictor import FEATURES, PRIOR, Live, auc, features, risk, update
from broker.sla.watch import ahead_growth

NOW = 1_800_000_000.0


def _live(**changes: float) -> Live:
    base = {"created_at": NOW - 50, "deadline": NOW + 50, "predicted_finish": NOW + 40.0, "rows_total": 1000,
            "rows_done": 500, "rows_per_second": 10.0, "ahead_seconds": 0.0, "chunks_done": 5, "chunk_runs": 5,
            "workers": 1}
    return Live(**{**base, **changes})  # type: ignore[arg-type]


def test_features_read_the_live_figures_and_stay_within_bounds() -> None:
    x = features(_live(), now=NOW)
    assert set(x) == set(FEATURES)
    assert x["lateness"] == pytest.approx(-0.1)  # 10 s early on 100 s given
    assert x["elapsed"] == pytest.approx(0.5) and x["progress"] == pytest.approx(0.5)
    assert x["pace"] == 0.0  # needs 500 rows in 50 s, gets 10 rows/s
    assert x["workers"] == 0.5 and x["retries"] == 0.0
    slow = features(_live(rows_per_second=0.0, predicted_finish=None, chunk_runs=15, workers=0), now=NOW)
    assert slow["lateness"] == 3.0 and slow["pace"] == 3.0 and slow["retries"] == 2.0 and slow["workers"] == 1.0
    assert all(-3.0 <= value <= 3.0 for value in slow.values())


def test_the_plan_is_a_feature_of_its_own_which_the_prior_leaves_to_learning() -> None:
    """A flood ahead puts the plan 30 s past the deadline while the job's own rate says on time: `plan`
    reads 0.3, `lateness` stays early, and the prior (the plain rule) does not alarm until jobs teach it."""
    x = features(_live(planned_finish=NOW + 80), now=NOW)
    assert x["plan"] == pytest.approx(0.3) and x["lateness"] == pytest.approx(-0.1)
    assert features(_live(), now=NOW)["plan"] == x["lateness"]  # unplanned: the same as its lateness
    assert risk(PRIOR, x) < 0.5
    weights = dict(PRIOR)
    for _ in range(20):
        weights = update(weights, [x], missed=True)
        weights = update(weights, [features(_live(planned_finish=NOW + 30), now=NOW)], missed=False)
    assert weights["plan"] > 0 and risk(weights, x) > 0.5


def test_growth_is_the_work_added_ahead_per_second_since_the_last_pass() -> None:
    assert ahead_growth("10.0", str(NOW - 2), 14.0, now=NOW) == pytest.approx(2.0)
    assert ahead_growth("10.0", str(NOW - 5), 5.0, now=NOW) == pytest.approx(-1.0)  # draining
    assert ahead_growth(None, None, 14.0, now=NOW) == 0.0  # a job's first pass
    assert features(_live(ahead_growth=0.8), now=NOW)["growth"] == pytest.approx(0.8)
    assert features(_live(ahead_growth=50.0), now=NOW)["growth"] == 3.0


def test_the_prior_is_the_plain_rule_made_smooth() -> None:
    on_time = features(_live(predicted_finish=NOW + 50), now=NOW)
    assert risk(PRIOR, on_time) == pytest.approx(0.5)
    assert risk(PRIOR, features(_live(predicted_finish=NOW + 80), now=NOW)) > 0.8
    assert risk(PRIOR, features(_live(predicted_finish=NOW + 20), now=NOW)) < 0.2


def test_jobs_that_missed_while_predicted_on_time_teach_it_what_else_to_watch() -> None:
    """The rule sees no lateness (the prediction says on time) but the job lost its workers and fell behind
    its pace: after a few such jobs missed, the same figures read as a risk."""
    deceptive = features(_live(predicted_finish=NOW + 45, rows_per_second=2.0, workers=0, chunk_runs=9), now=NOW)
    healthy = features(_live(predicted_finish=NOW + 45), now=NOW)
    weights = dict(PRIOR)
    before = risk(weights, deceptive)
    for _ in range(20):
        weights = update(weights, [deceptive], missed=True)
        weights = update(weights, [healthy], missed=False)
    assert before < 0.5 < risk(weights, deceptive)
    assert risk(weights, healthy) < 0.5


def test_auc_counts_pairs_ordered_right_with_ties_as_half() -> None:
    assert auc([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert auc([0.1, 0.9], [True, False]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5
    assert math.isnan(auc([0.5], [True]))
