"""An online learner of CP-Score's weights α, β, γ, δ from the outcomes of the windows they were live in.

Method: a (1+1) evolution strategy, a stochastic hill-climb, in the box's normalised coordinates [0, 1]⁴.
The learner holds one incumbent (the best weights known) and tries one candidate at a time: the
incumbent plus a Gaussian step of size `step`, mirrored back into the box. A trial is a round of
`windows_per_trial` pairs of windows, incumbent then candidate, and the candidate replaces the incumbent
only when its mean cost is below the incumbent's by the fraction `margin` and by more than chance
explains (below). Why this method:

- One live policy at a time: the broker serves every queue with one set of weights, so the learner can
  only try one point per window. A population or a bandit over a grid would spend most windows on
  points far from the good one; a hill-climb stays near it, so a trial costs little service.
- Noise: a window's misses and P99 are noisy (in the benchmark's bursts, one set of weights had windows
  costing from 4 to 12). A candidate replaces the incumbent only when its mean cost is lower by the
  margin *and* by more than the noise explains: `SIGNIFICANCE_Z` standard errors of the difference of the
  two means, the spread of a window's cost estimated from the windows of this round and, fading, of
  earlier ones (a one-sided two-sample test with a pooled variance, at the normal quantile). With the few
  windows of the first rounds the estimate is rough: in a simulation of equal weights, 12 % of candidates
  got through in the first round of 2 windows a side, 5.6 % once some 20 rounds were pooled. Without the
  test, a candidate that was merely lucky was kept about as often as one that was better, and the
  incumbent wandered off at random.
- A shifting workload: the incumbent is measured again in every round, interleaved with the candidate,
  and the two are compared on the same round only. A score the incumbent earned under yesterday's
  mix so never protects it today, and a drift of the mix during a round hits both sides alike.
- Step size by the 1/5th rule (Rechenberg): grow the step after a success, shrink it a little after a
  failure, so it settles where about one trial in five succeeds. The step never falls below
  `MIN_STEP`, so the learner keeps probing and can follow an optimum that moves. The cost of weights
  is often flat over a wide range (the queue's order changes only where one item's score passes
  another's), and a hill-climb gets no slope there: the floor is wide enough that a step still reaches
  the next order.
- Starvation: a window in which a class had work waiting and none answered, while other classes were
  served, costs `STARVATION_COST`. A candidate with such a window is rejected at once, and the next
  window goes back to the incumbent.

Pure: no Redis, no clock (callers pass `now`), and every random draw comes from the seed and the number
of draws so far, so the state is a small JSON document and a run is repeatable.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from broker.queueing.policy import POLICY_RANGES
from broker.queueing.scoring import Weights

LEARNED = ("alpha", "beta", "gamma", "delta")
"""The weights the learner moves; every other field of `Weights` passes through unchanged."""

STARVATION_COST = 1e9
"""The cost of a window that starved a class: finite so it stays valid JSON, far above any other cost."""

MISS_POINTS = 100.0
"""Cost of the window's deadline-miss fraction: 1 % of deadlines missed costs as much as every class's
P99 at twice its target. Misses so come first, P99 second."""

OVERSHOOT_CAP = 10.0
"""A class's relative P99 overshoot counts at most this much, so one wild window cannot outweigh misses."""

SUCCESS_FACTOR = 1.5
FAILURE_FACTOR = SUCCESS_FACTOR ** -0.25
"""Step-size changes of the 1/5th rule: four failures undo one success, so the step is stable at 1 in 5."""

MIN_STEP, MAX_STEP, START_STEP = 0.1, 0.5, 0.2
"""Bounds and start of the step, in box widths."""

SIGNIFICANCE_Z = 1.64
"""How many standard errors of the difference of the means a candidate must win by: the one-sided 5 % point
of the normal distribution (more get through while the spread is estimated from few windows: see the module)."""

NOISE_MEMORY = 0.8
"""How much of the earlier rounds' estimate of the cost's spread a round keeps (a share per round): enough
for a good estimate from a few windows a round, and it follows a mix whose noise changes."""

STALE_WINDOWS = 3.0
"""A gap between two observations longer than this many window lengths ends the round unjudged."""

Trying = Literal["incumbent", "candidate"]


@dataclass(frozen=True)
class WeightBox:
    """The range each learned weight may take, inclusive; from configuration.

    The defaults run from a quarter to five times `Weights`' defaults. δ stays above zero, for without
    aging a low-priority item could wait for ever behind a steady stream of higher ones."""

    alpha: tuple[float, float] = (0.1, 2.0)
    beta: tuple[float, float] = (0.075, 1.5)
    gamma: tuple[float, float] = (0.05, 1.0)
    delta: tuple[float, float] = (0.025, 0.5)

    def __post_init__(self) -> None:
        for name in LEARNED:
            low, high = getattr(self, name)
            allowed_low, allowed_high = POLICY_RANGES[name]
            if not (math.isfinite(low) and math.isfinite(high) and allowed_low <= low <= high <= allowed_high):
                raise ValueError(f"weight box for {name} must be [low, high] with {allowed_low:g} <= low <= high "
                                 f"<= {allowed_high:g}, got {(low, high)}")


@dataclass(frozen=True)
class ClassOutcome:
    """What one priority class saw over one window."""

    name: str
    answered: int
    deadline_met: int
    deadline_missed: int
    p99_seconds: float | None
    target_p99: float | None
    waiting: int
    """Items still waiting at the window's end."""


@dataclass(frozen=True)
class Outcome:
    """One window, all classes."""

    classes: tuple[ClassOutcome, ...]
    seconds: float


def cost(outcome: Outcome) -> float:
    """The window's cost, lower is better: `MISS_POINTS` × the fraction of deadlines missed, plus the mean
    relative P99 overshoot of the classes with a target; `STARVATION_COST` if a class starved."""
    if starved(outcome):
        return STARVATION_COST
    met = sum(klass.deadline_met for klass in outcome.classes)
    missed = sum(klass.deadline_missed for klass in outcome.classes)
    miss_fraction = missed / (met + missed) if met + missed else 0.0
    overshoots = [min(max(klass.p99_seconds / klass.target_p99 - 1.0, 0.0), OVERSHOOT_CAP)
                  for klass in outcome.classes
                  if klass.p99_seconds is not None and klass.target_p99 is not None and klass.target_p99 > 0]
    return MISS_POINTS * miss_fraction + (sum(overshoots) / len(overshoots) if overshoots else 0.0)


def starved(outcome: Outcome) -> bool:
    """Whether a class had work waiting and none answered while another class was answered."""
    served = {klass.name for klass in outcome.classes if klass.answered > 0}
    return any(klass.waiting > 0 and klass.answered == 0 for klass in outcome.classes) and bool(served)


@dataclass(frozen=True)
class LearnerState:
    """Everything the learner knows; small, and JSON-ready through `to_dict` (kept in one Redis string).

    The round's sums hold the windows of the current trial only: they are compared, then cleared."""

    incumbent: Weights
    seed: int
    candidate: Weights | None = None
    draws: int = 0
    """Candidates drawn so far: the next draw's random numbers come from (seed, draws)."""
    step: float = START_STEP
    trying: Trying | None = None
    """Whose weights the window now running was proposed with; None when no window awaits credit."""
    incumbent_sum: float = 0.0
    incumbent_windows: int = 0
    candidate_sum: float = 0.0
    candidate_windows: int = 0
    incumbent_costs: tuple[float, ...] = ()
    candidate_costs: tuple[float, ...] = ()
    """The round's window costs (the sums' terms): their spread is the noise a decision must see past."""
    noise_squares: float = 0.0
    noise_dof: float = 0.0
    """Earlier rounds' sum of squared deviations of window costs from their round's means, and its degrees
    of freedom, each faded by `NOISE_MEMORY` a round: the pooled estimate of a window cost's variance."""
    incumbent_cost: float | None = None
    """The incumbent's mean cost in its last round, for reports; never used to judge a later candidate."""
    observed_at: float | None = None
    accepted: int = 0
    rejected: int = 0
    windows_per_trial: int = 2
    margin: float = 0.05

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        data = asdict(self)
        data["incumbent"] = self.incumbent.to_dict()
        data["candidate"] = self.candidate.to_dict() if self.candidate else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LearnerState:
        """The inverse of `to_dict`."""
        names = {field.name for field in fields(cls)}
        values = {name: value for name, value in data.items() if name in names}
        values["incumbent"] = Weights(**data["incumbent"])
        values["candidate"] = Weights(**data["candidate"]) if data.get("candidate") else None
        for name in ("incumbent_costs", "candidate_costs"):
            values[name] = tuple(float(value) for value in values.get(name, ()))
        return cls(**values)


def start(box: WeightBox, current: Weights, *, seed: int, windows_per_trial: int = 2,
          margin: float = 0.05) -> LearnerState:
    """A learner whose incumbent is `current` (moved into the box if it lies outside)."""
    if windows_per_trial < 2 or not 0 <= margin < 1:
        raise ValueError(f"windows_per_trial must be >= 2 (the spread between a side's windows is what tells a "
                         f"difference from chance) and margin in [0, 1), got {windows_per_trial}, {margin}")
    return LearnerState(incumbent=_into_box(current, box), seed=seed, windows_per_trial=windows_per_trial,
                        margin=margin)


def propose(state: LearnerState, box: WeightBox) -> tuple[LearnerState, Weights]:
    """The weights to run the next window with, and the state that will credit that window to them.

    Each round opens with the incumbent, so after any decision the incumbent runs next. Calling it
    again before `observe` proposes the same weights."""
    state = replace(state, incumbent=_into_box(state.incumbent, box),
                    candidate=_into_box(state.candidate, box) if state.candidate else None)
    if state.incumbent_windows <= state.candidate_windows:
        return replace(state, trying="incumbent"), state.incumbent
    if state.candidate is not None:
        return replace(state, trying="candidate"), state.candidate
    candidate = _draw(state, box)
    return replace(state, candidate=candidate, draws=state.draws + 1, trying="candidate"), candidate


def observe(state: LearnerState, outcome: Outcome, box: WeightBox, *, now: float) -> LearnerState:
    """Credit the window that just ended to the weights `propose` gave for it; decide the trial when its
    round is complete.

    A window with nothing answered and nothing waiting says nothing and is not counted. When the last
    window was observed more than `STALE_WINDOWS` window lengths ago, the round's earlier windows come from
    another time (the learner was paused): the round starts over, without this window."""
    trying, last_observed_at = state.trying, state.observed_at
    state = replace(state, trying=None, observed_at=now)
    in_round = state.incumbent_windows + state.candidate_windows > 0
    if in_round and last_observed_at is not None and now - last_observed_at > STALE_WINDOWS * outcome.seconds:
        return _clear_round(state)
    if trying is None or not any(klass.answered or klass.waiting for klass in outcome.classes):
        return state
    window_cost = cost(outcome)
    if trying == "incumbent":
        return _decide(replace(state, incumbent_sum=state.incumbent_sum + window_cost,
                               incumbent_windows=state.incumbent_windows + 1,
                               incumbent_costs=(*state.incumbent_costs, window_cost)), box)
    if window_cost >= STARVATION_COST:
        return _reject(state)
    return _decide(replace(state, candidate_sum=state.candidate_sum + window_cost,
                           candidate_windows=state.candidate_windows + 1,
                           candidate_costs=(*state.candidate_costs, window_cost)), box)


def best(state: LearnerState) -> Weights:
    """The incumbent: the best weights known, to keep when the learner stops."""
    return state.incumbent


def rebase(state: LearnerState, current: Weights) -> LearnerState:
    """Carry a manual change of the weights the learner does not move (e.g. `express_bonus`) into its
    incumbent and candidate, so a proposal never undoes it."""
    fixed = {field.name: getattr(current, field.name) for field in fields(Weights) if field.name not in LEARNED}
    return replace(state, incumbent=replace(state.incumbent, **fixed),
                   candidate=replace(state.candidate, **fixed) if state.candidate else None)


def _decide(state: LearnerState, box: WeightBox) -> LearnerState:
    """After a complete round, accept the candidate if its mean cost beats the incumbent's by the margin and
    by more than the noise explains (see the module)."""
    if state.candidate_windows < state.windows_per_trial or state.incumbent_windows < state.windows_per_trial:
        return state
    if len(state.incumbent_costs) != state.incumbent_windows or len(state.candidate_costs) != state.candidate_windows:
        return _clear_round(state)  # (a round begun by a version that kept no window costs: judged by none)
    incumbent_mean = state.incumbent_sum / state.incumbent_windows
    candidate_mean = state.candidate_sum / state.candidate_windows
    state = _with_noise_of_round(state)
    spread = math.sqrt(state.noise_squares / state.noise_dof) if state.noise_dof > 0 else 0.0
    standard_error = spread * math.sqrt(1 / state.incumbent_windows + 1 / state.candidate_windows)
    better = (candidate_mean < incumbent_mean * (1 - state.margin)
              and incumbent_mean - candidate_mean > SIGNIFICANCE_Z * standard_error)
    if state.candidate is None or not better:
        return replace(_reject(state), incumbent_cost=incumbent_mean)
    return replace(_clear_round(state), incumbent=_into_box(state.candidate, box), candidate=None,
                   incumbent_cost=candidate_mean,
                   step=min(state.step * SUCCESS_FACTOR, MAX_STEP), accepted=state.accepted + 1)


def _with_noise_of_round(state: LearnerState) -> LearnerState:
    """The noise estimate with this round's windows added to the faded earlier rounds' (see `noise_squares`).
    Windows that starved a class are not noise and are left out."""
    squares, dof = 0.0, 0
    for costs in (state.incumbent_costs, state.candidate_costs):
        kept = [value for value in costs if value < STARVATION_COST]
        if len(kept) > 1:
            mean = sum(kept) / len(kept)
            squares += sum((value - mean) ** 2 for value in kept)
            dof += len(kept) - 1
    return replace(state, noise_squares=NOISE_MEMORY * state.noise_squares + squares,
                   noise_dof=NOISE_MEMORY * state.noise_dof + dof)


def _reject(state: LearnerState) -> LearnerState:
    """Drop the candidate and shrink the step; the next window runs the incumbent."""
    return replace(_clear_round(state), candidate=None, step=max(state.step * FAILURE_FACTOR, MIN_STEP),
                   rejected=state.rejected + 1)


def _clear_round(state: LearnerState) -> LearnerState:
    return replace(state, incumbent_sum=0.0, incumbent_windows=0, candidate_sum=0.0, candidate_windows=0,
                   incumbent_costs=(), candidate_costs=(), trying=None)


def _draw(state: LearnerState, box: WeightBox) -> Weights:
    """The incumbent plus a Gaussian step in normalised coordinates, mirrored back into the box."""
    rng = random.Random(f"{state.seed}:{state.draws}")  # a string seed is hashed the same on every platform
    moved = {}
    for name in LEARNED:
        low, high = getattr(box, name)
        if high == low:
            moved[name] = low
            continue
        position = (getattr(state.incumbent, name) - low) / (high - low) + state.step * rng.gauss(0.0, 1.0)
        moved[name] = low + _mirror(position) * (high - low)
    return _into_box(replace(state.incumbent, **moved), box)  # low + 1.0 · (high − low) may round past high


def _mirror(position: float) -> float:
    """`position` folded into [0, 1] by reflection at its ends: a step past a wall comes back off it, rather
    than piling every such step onto the wall as clipping would."""
    folded = abs(position) % 2.0
    return 2.0 - folded if folded > 1.0 else folded


def _into_box(weights: Weights, box: WeightBox) -> Weights:
    """`weights` with each learned weight clipped into its range (a changed box, or a start outside it)."""
    return replace(weights, **{name: min(max(getattr(weights, name), getattr(box, name)[0]), getattr(box, name)[1])
                               for name in LEARNED})
