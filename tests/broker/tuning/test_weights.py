"""The online learner of CP-Score's weights: in the box, repeatable, small JSON, never starving a class, and
improving (and following) a noisy cost landscape."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.queueing.scoring import Weights
from broker.tuning.weights import (
    LEARNED,
    MAX_STEP,
    MIN_STEP,
    START_STEP,
    STARVATION_COST,
    ClassOutcome,
    LearnerState,
    Outcome,
    WeightBox,
    best,
    cost,
    observe,
    propose,
    rebase,
    start,
    starved,
)

BOX = WeightBox()
WINDOW = 60.0


def served(missed: int = 0, *, answered: int = 100, p99: float | None = 1.0, target: float | None = 1.0,
           waiting: int = 0, name: str = "normal") -> ClassOutcome:
    return ClassOutcome(name=name, answered=answered, deadline_met=answered - missed, deadline_missed=missed,
                        p99_seconds=p99, target_p99=target, waiting=waiting)


def window(*classes: ClassOutcome) -> Outcome:
    return Outcome(classes=classes, seconds=WINDOW)


def costing(value: float) -> Outcome:
    """A one-class window whose cost is `value` (from its P99 overshoot, value < 10)."""
    return window(served(p99=1.0 + value, target=1.0))


def returning(outcome: Outcome) -> Callable[[Weights], Outcome]:
    return lambda _: outcome


STARVING = window(served(name="high"), served(name="low", answered=0, waiting=5))


def step(state: LearnerState, outcome_of: Callable[[Weights], Outcome], now: float,
         box: WeightBox = BOX) -> tuple[LearnerState, Weights]:
    """One window: propose, run `outcome_of` the proposal, observe at `now`."""
    state, weights = propose(state, box)
    return observe(state, outcome_of(weights), box, now=now), weights


def in_box(weights: Weights, box: WeightBox) -> bool:
    return all(getattr(box, name)[0] <= getattr(weights, name) <= getattr(box, name)[1] for name in LEARNED)


# --- the cost of a window -----------------------------------------------------------------------


def test_misses_cost_more_than_p99_overshoot() -> None:
    """Misses first: 2 % of deadlines missed outweighs every class's P99 at 1.5 times its target."""
    assert cost(window(served(missed=2))) > cost(window(served(p99=1.5, target=1.0)))
    assert cost(window(served(missed=2))) < cost(window(served(missed=3)))
    assert cost(window(served(p99=1.5))) < cost(window(served(p99=2.0)))
    assert cost(window(served(p99=0.5))) == 0.0


def test_a_class_with_waiting_work_and_nothing_answered_while_others_are_served_starved() -> None:
    assert starved(STARVING) and cost(STARVING) == STARVATION_COST
    assert cost(STARVING) > cost(window(served(missed=100, p99=1e6)))
    # nothing served at all is an outage, not one class starved by the weights
    assert not starved(window(served(answered=0, waiting=5), served(name="low", answered=0, waiting=5)))


# --- properties over any sequence of windows -----------------------------------------------------

boxes = st.builds(
    lambda bounds: WeightBox(**{name: (min(pair), max(pair)) for name, pair in zip(LEARNED, bounds, strict=True)}),
    st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), min_size=4, max_size=4))
class_outcomes = st.builds(
    lambda answered, missed, p99, waiting, name: served(min(missed, answered), answered=answered, p99=p99,
                                                       waiting=waiting, name=name),
    st.integers(0, 50), st.integers(0, 50), st.none() | st.floats(0, 100), st.integers(0, 5),
    st.sampled_from(["express", "high", "normal", "low"]))
outcomes = st.builds(lambda classes: window(*classes), st.lists(class_outcomes, max_size=4))


@settings(max_examples=150, deadline=None)
@given(box=boxes, outcome_list=st.lists(outcomes, max_size=40), gaps=st.lists(st.floats(0, 400), min_size=40),
       seed=st.integers(0, 2**32), current=st.builds(Weights, **{name: st.floats(0, 100) for name in LEARNED}))
def test_every_proposal_stays_in_the_box_and_the_state_survives_json(
        box: WeightBox, outcome_list: list[Outcome], gaps: list[float], seed: int, current: Weights) -> None:
    state, now = start(box, replace(current, express_bonus=7.0), seed=seed), 0.0
    for outcome, gap in zip(outcome_list, gaps, strict=False):
        state, weights = propose(state, box)
        assert in_box(weights, box) and weights.express_bonus == 7.0
        now += gap
        state = observe(state, outcome, box, now=now)
        assert LearnerState.from_dict(json.loads(json.dumps(state.to_dict(), allow_nan=False))) == state
        assert in_box(best(state), box) and best(state).express_bonus == 7.0
    assert len(json.dumps(state.to_dict())) < 2000


@settings(max_examples=50, deadline=None)
@given(outcome_list=st.lists(outcomes, min_size=1, max_size=30), seed=st.integers(0, 2**32))
def test_the_same_seed_and_windows_give_the_same_proposals(outcome_list: list[Outcome], seed: int) -> None:
    def proposals() -> list[Weights]:
        state, tried = start(BOX, Weights(), seed=seed), []
        for now, outcome in enumerate(outcome_list):
            state, weights = step(state, returning(outcome), now=now * WINDOW)
            tried.append(weights)
        return tried

    assert proposals() == proposals()


def test_other_seeds_try_other_candidates() -> None:
    def first_candidate(seed: int) -> Weights:
        state = start(BOX, Weights(), seed=seed)
        state, _ = step(state, lambda _: costing(1.0), now=WINDOW)
        return propose(state, BOX)[1]

    assert len({first_candidate(seed) for seed in range(5)}) == 5


# --- one trial -----------------------------------------------------------------------------------


def trial(state: LearnerState, incumbent_cost: float, candidate_cost: float, now: float = 0.0) -> LearnerState:
    """One round of pairs of windows, the incumbent's windows costing `incumbent_cost`."""
    incumbent = best(state)
    for _ in range(2 * state.windows_per_trial):
        now += WINDOW
        state, _ = step(state, lambda w: costing(incumbent_cost if w == incumbent else candidate_cost), now)
    return state


def test_each_round_opens_with_the_incumbent_and_alternates_with_one_candidate() -> None:
    state = start(BOX, Weights(), seed=1)
    tried = []
    for now in range(1, 5):
        state, weights = step(state, lambda _: costing(1.0), now=now * WINDOW)
        tried.append(weights)
    assert tried[0] == tried[2] == Weights() and tried[1] == tried[3] != Weights()
    assert propose(state, BOX)[1] == Weights()


def test_a_candidate_better_by_the_margin_replaces_the_incumbent_and_the_step_grows() -> None:
    state = trial(start(BOX, Weights(), seed=3), incumbent_cost=4.0, candidate_cost=2.0)
    assert best(state) != Weights() and state.accepted == 1 and state.step > START_STEP
    assert state.incumbent_cost == pytest.approx(2.0)


def test_a_candidate_better_only_within_the_noise_margin_is_rejected_and_the_step_shrinks() -> None:
    state = trial(start(BOX, Weights(), seed=3, margin=0.1), incumbent_cost=4.0, candidate_cost=3.7)
    assert best(state) == Weights() and state.rejected == 1 and state.step < START_STEP


def costs_round(state: LearnerState, incumbent_costs: list[float], candidate_costs: list[float],
                now: float = 0.0) -> LearnerState:
    """One round whose incumbent windows cost `incumbent_costs` and candidate windows `candidate_costs`, in turn."""
    assert len(incumbent_costs) == len(candidate_costs) == state.windows_per_trial
    for incumbent_cost, candidate_cost in zip(incumbent_costs, candidate_costs, strict=True):
        for value in (incumbent_cost, candidate_cost):
            now += WINDOW
            state, _ = step(state, returning(costing(value)), now)
    return state


def test_a_candidate_better_by_the_margin_but_within_the_windows_noise_is_rejected() -> None:
    """Mean 4 against 5 (20 % better, past the 5 % margin), but the incumbent's windows cost 2 and 8: the
    difference is well within what a window's spread gives by chance."""
    state = costs_round(start(BOX, Weights(), seed=3), incumbent_costs=[2.0, 8.0], candidate_costs=[3.0, 5.0])
    assert best(state) == Weights() and state.rejected == 1 and state.accepted == 0


def test_the_noise_of_earlier_rounds_counts_against_a_round_that_looks_quiet() -> None:
    """Two noisy rounds, then one whose own windows agree: its 20 % is still within the noise seen."""
    state = start(BOX, Weights(), seed=3)
    for index in range(2):
        state = costs_round(state, incumbent_costs=[2.0, 8.0], candidate_costs=[8.0, 2.0], now=index * 4 * WINDOW)
    state = costs_round(state, incumbent_costs=[5.0, 5.0], candidate_costs=[4.0, 4.0], now=8 * WINDOW)
    assert best(state) == Weights() and state.accepted == 0


def test_a_candidate_better_beyond_the_noise_is_accepted() -> None:
    state = costs_round(start(BOX, Weights(), seed=3), incumbent_costs=[5.0, 6.0], candidate_costs=[1.0, 2.0])
    assert best(state) != Weights() and state.accepted == 1


def test_a_starved_window_is_no_noise_and_a_candidate_that_serves_every_class_wins() -> None:
    """An incumbent that starved a class in one of its windows loses to a candidate that served every class;
    the starved window leaves the noise estimate alone (its cost would swamp it for a hundred rounds), so the
    next round still tells a clear win."""
    state = start(BOX, Weights(), seed=2)
    now = 0.0
    for outcome in (STARVING, costing(6.0), costing(5.0), costing(5.0)):  # incumbent, candidate, in turn
        now += WINDOW
        state, _ = step(state, returning(outcome), now)
    assert state.accepted == 1 and state.noise_squares == pytest.approx(0.5)  # (the candidate's 6 and 5 alone)
    state = costs_round(state, incumbent_costs=[5.0, 5.5], candidate_costs=[1.0, 1.5], now=now)
    assert state.accepted == 2


def test_a_round_begun_by_a_state_without_window_costs_is_left_undecided() -> None:
    """A state saved mid-round by a version that kept only the sums: its round is cleared, not judged on the
    margin alone."""
    state = start(BOX, Weights(), seed=3)
    state, _ = step(state, returning(costing(4.0)), WINDOW)
    state, _ = step(state, returning(costing(1.0)), 2 * WINDOW)
    old = state.to_dict()
    del old["incumbent_costs"], old["candidate_costs"], old["noise_squares"], old["noise_dof"]
    state = LearnerState.from_dict(old)
    state, _ = step(state, returning(costing(4.0)), 3 * WINDOW)
    state, _ = step(state, returning(costing(1.0)), 4 * WINDOW)
    assert state.accepted == 0 and state.rejected == 0 and state.incumbent_windows == 0


def test_a_trial_needs_two_windows_a_side() -> None:
    with pytest.raises(ValueError, match="windows_per_trial must be >= 2"):
        start(BOX, Weights(), seed=1, windows_per_trial=1)


def test_the_step_stays_within_its_bounds() -> None:
    state = start(BOX, Weights(), seed=3)
    for _ in range(30):
        state = trial(state, incumbent_cost=4.0, candidate_cost=5.0)
    assert state.step == MIN_STEP
    for _ in range(30):
        state = trial(state, incumbent_cost=4.0, candidate_cost=1.0)
    assert state.step == MAX_STEP


def test_a_stale_good_score_does_not_keep_the_incumbent() -> None:
    """The mix shifted: the incumbent scored 1.0 in its last round and now costs 8.0; a candidate at 3.0,
    worse than the incumbent's old score, is still accepted, for both were measured in the same round."""
    state = trial(start(BOX, Weights(), seed=5), incumbent_cost=1.0, candidate_cost=2.0)
    assert state.incumbent_cost == pytest.approx(1.0) and best(state) == Weights()
    state = trial(state, incumbent_cost=8.0, candidate_cost=3.0, now=10 * WINDOW)
    assert best(state) != Weights() and state.accepted == 1


def test_a_starving_candidate_is_rejected_at_once_and_the_incumbent_runs_next() -> None:
    state = start(BOX, Weights(), seed=2)
    state, _ = step(state, lambda _: costing(5.0), now=WINDOW)
    state, candidate = step(state, lambda _: STARVING, now=2 * WINDOW)
    assert candidate != Weights()
    assert state.rejected == 1 and state.candidate is None and best(state) == Weights()
    state, weights = propose(state, BOX)
    assert weights == Weights() and state.trying == "incumbent"
    assert propose(step(state, lambda _: costing(5.0), now=3 * WINDOW)[0], BOX)[1] not in (candidate, Weights())


def test_a_starving_incumbent_gives_way_to_a_candidate_that_serves_every_class() -> None:
    state = start(BOX, Weights(), seed=2)
    for now in range(1, 5):
        state, _ = step(state, lambda w: STARVING if w == Weights() else costing(5.0), now=now * WINDOW)
    assert best(state) != Weights()


def test_a_window_with_no_traffic_is_not_counted() -> None:
    state = start(BOX, Weights(), seed=2)
    state, _ = step(state, lambda _: window(), now=WINDOW)
    state, _ = step(state, lambda _: window(served(answered=0)), now=2 * WINDOW)
    assert state.incumbent_windows == 0 and propose(state, BOX)[1] == Weights()


def test_a_long_pause_starts_the_round_over() -> None:
    state = start(BOX, Weights(), seed=2)
    state, _ = step(state, lambda _: costing(1.0), now=WINDOW)
    state, _ = step(state, lambda _: costing(1.0), now=2 * WINDOW)
    assert state.incumbent_windows == state.candidate_windows == 1
    state, _ = step(state, lambda _: costing(1.0), now=100 * WINDOW)
    assert state.incumbent_windows == state.candidate_windows == 0


# --- the box and the fields the learner does not move ----------------------------------------------


def test_a_start_outside_the_box_is_moved_into_it_and_unlearned_fields_pass_through() -> None:
    current = Weights(alpha=50.0, delta=0.0, express_bonus=5.0, psa_load=0.5)
    incumbent = best(start(BOX, current, seed=0))
    assert (incumbent.alpha, incumbent.delta) == (BOX.alpha[1], BOX.delta[0])
    assert incumbent.beta == current.beta and incumbent.gamma == current.gamma
    assert all(getattr(incumbent, field.name) == getattr(current, field.name)
               for field in fields(Weights) if field.name not in LEARNED)


def test_a_narrowed_box_moves_the_incumbent_into_it() -> None:
    state = start(BOX, Weights(), seed=0)
    narrow = replace(BOX, alpha=(1.0, 1.0))
    assert propose(state, narrow)[1].alpha == 1.0


def test_rebase_carries_a_manual_change_of_an_unlearned_field_into_the_proposals() -> None:
    state = start(BOX, Weights(), seed=0)
    state, _ = step(state, lambda _: costing(1.0), now=WINDOW)
    state = rebase(propose(state, BOX)[0], Weights(express_bonus=9.0, alpha=1.5))
    assert best(state).express_bonus == 9.0 and best(state).alpha == Weights().alpha
    assert propose(state, BOX)[1].express_bonus == 9.0


def test_steps_past_a_wall_come_back_off_it_rather_than_piling_onto_it() -> None:
    """From an incumbent in the box's top corner about half the steps go past the wall; clipped, each such
    candidate would try the wall itself again."""
    top = Weights(**{name: getattr(BOX, name)[1] for name in LEARNED})
    state, candidates = start(BOX, top, seed=4), []
    for now in range(1, 41):
        state, weights = step(state, lambda w: STARVING if w != top else costing(1.0), now=now * WINDOW)
        if weights != top:
            candidates.append(weights)
    assert len(candidates) == 20
    assert all(getattr(weights, name) < getattr(BOX, name)[1] for weights in candidates for name in LEARNED)


def test_a_box_whose_low_end_is_above_its_high_end_is_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        WeightBox(alpha=(2.0, 1.0))
    with pytest.raises(ValueError, match="delta"):
        WeightBox(delta=(0.0, 5000.0))


# --- a noisy cost landscape ------------------------------------------------------------------------


def normalised(weights: Weights, name: str) -> float:
    low, high = getattr(BOX, name)
    return (getattr(weights, name) - low) / (high - low)


class Landscape:
    """A toy workload: each window 200 deadlines, missed with a probability that grows with the squared
    distance from `optimum` (in box widths), and a P99 that grows likewise; both noisy."""

    def __init__(self, optimum: tuple[float, float, float, float], seed: int) -> None:
        self.optimum, self.rng = optimum, random.Random(seed)

    def squared_distance(self, weights: Weights) -> float:
        return sum((normalised(weights, name) - at) ** 2 for name, at in zip(LEARNED, self.optimum, strict=True))

    def miss_probability(self, weights: Weights) -> float:
        return min(0.9, 0.01 + 0.5 * self.squared_distance(weights))

    def true_cost(self, weights: Weights) -> float:
        """The window's expected cost, without noise."""
        return 100 * self.miss_probability(weights) + 2 * self.squared_distance(weights)

    def __call__(self, weights: Weights) -> Outcome:
        missed = sum(self.rng.random() < self.miss_probability(weights) for _ in range(200))
        p99 = (1 + 2 * self.squared_distance(weights)) * self.rng.uniform(0.8, 1.2)
        return window(served(missed, answered=200, p99=p99, target=1.0))


def learn(state: LearnerState, landscape: Landscape, windows: int, now: float) -> tuple[LearnerState, float]:
    for _ in range(windows):
        now += WINDOW
        state, _ = step(state, landscape, now)
    return state, now


@pytest.mark.parametrize("seed", range(5))
def test_the_incumbent_improves_well_on_a_noisy_landscape(seed: int) -> None:
    """From the default weights (about 47) to below a fifth of that within 200 windows (the floor is 1.0)."""
    landscape = Landscape((0.6, 0.6, 0.7, 0.6), seed=1000 + seed)
    state = start(BOX, Weights(), seed=seed)
    initial = landscape.true_cost(best(state))
    state, _ = learn(state, landscape, 200, now=0.0)
    assert landscape.true_cost(best(state)) < initial / 5


@pytest.mark.parametrize("seed", range(5))
def test_the_learner_follows_an_optimum_that_moves(seed: int) -> None:
    landscape = Landscape((0.6, 0.6, 0.7, 0.6), seed=2000 + seed)
    state, now = learn(start(BOX, Weights(), seed=seed), landscape, 300, now=0.0)
    landscape.optimum = (0.25, 0.8, 0.3, 0.85)
    at_shift = landscape.true_cost(best(state))
    state, _ = learn(state, landscape, 400, now=now)
    assert landscape.true_cost(best(state)) < at_shift / 4
