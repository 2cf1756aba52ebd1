"""The weight learner's pass: credit the window that ended to the weights that were live, make the next live.

Every `tuning.weights.every` the beat sends `sits.learn_weights`; a releaser runs this pass. It reads the
window from what workers noted of every model's completed requests (`windows.read_windows`: per priority
class, the answers, their P99 and their deadlines met and missed) and the requests each class has waiting,
gives it to the learner (`weights.observe`, pure), and makes the weights the learner proposes next the live
policy through the same hot update `PUT /v1/policy` uses: saved, then every waiting item re-scored in
bounded slices (`policy.rescore_all`), so nothing is lost or reordered out of turn. Its state is one
JSON string (`keys.weight_learner`); a policy field the learner does not move, changed by hand, is kept
(`weights.rebase`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from broker.monitoring.sla_metrics import PRIORITY_CLASSES
from broker.queueing import policy
from broker.queueing.scoring import Ordering
from broker.setting_types import MAX_PRIORITY
from broker.state.store import Store, translate_redis_errors
from broker.tuning import weights, windows
from broker.tuning.settings import WeightLearning

log = logging.getLogger(__name__)

LEARN_TASK = "sits.learn_weights"
"""The Celery task the beat sends every `tuning.weights.every` and a releaser runs: one pass; no arguments."""


@dataclass
class LearnReport:
    """What one pass did."""

    cost: float | None = None
    live: dict[str, float] = field(default_factory=dict)
    trying: str = ""
    changed: bool = False
    rescore: dict[str, float] = field(default_factory=dict)
    accepted: int = 0
    rejected: int = 0

    def to_json(self) -> dict[str, Any]:
        """As the task's result (Flower shows it)."""
        return dict(self.__dict__)


def box_of(learning: WeightLearning) -> weights.WeightBox:
    """The weight box the settings give."""
    return weights.WeightBox(alpha=learning.alpha, beta=learning.beta, gamma=learning.gamma, delta=learning.delta)


def read_state(store: Store) -> weights.LearnerState | None:
    """The learner's stored state, None before its first pass (or for one that does not parse)."""
    with translate_redis_errors():
        raw = store.client.get(store.keys.weight_learner)
    try:
        return weights.LearnerState.from_dict(json.loads(raw)) if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def outcome_of(store: Store, learning: WeightLearning, *, since: float, now: float) -> weights.Outcome:
    """The window (`since`, `now`] across every model with a queue, per priority class."""
    with translate_redis_errors():
        refs = sorted(store.client.smembers(store.keys.queues))
        pipe = store.client.pipeline(transaction=False)
        bounds = _class_levels()
        for ref in refs:
            for low, high in bounds.values():
                pipe.zcount(store.keys.waiting_requests(ref), low, high)
        counts = pipe.execute() if refs else []
    waiting = dict.fromkeys(bounds, 0)
    for index, count in enumerate(counts):
        waiting[list(bounds)[index % len(bounds)]] += int(count)
    answered = windows.read_windows(store, refs, since=since, until=now)
    classes = []
    for name in bounds:
        tally = answered.by_class.get(name, windows.ClassTally())
        classes.append(weights.ClassOutcome(name=name, answered=len(tally.latencies), deadline_met=tally.met,
                                            deadline_missed=tally.missed, p99_seconds=tally.p99(),
                                            target_p99=learning.targets.get(name), waiting=waiting[name]))
    return weights.Outcome(classes=tuple(classes), seconds=now - since)


def _class_levels() -> dict[str, tuple[int, int]]:
    """Each priority class's levels, lowest and highest (`sla_metrics.PRIORITY_CLASSES`)."""
    found, top = {}, MAX_PRIORITY
    for name, lowest in PRIORITY_CLASSES:
        found[name] = (lowest, top)
        top = lowest - 1
    return found


def learn_weights(store: Store, learning: WeightLearning, *, now: float, default_ordering: Ordering) -> LearnReport:
    """One pass at `now` (see the module)."""
    box = box_of(learning)
    current, ordering = policy.get_policy(store, default=default_ordering)
    state = read_state(store)
    if state is None or state.seed != learning.seed:
        state = weights.start(box, current, seed=learning.seed, windows_per_trial=learning.windows_per_trial,
                              margin=learning.margin)
    state = weights.rebase(state, current)
    report = LearnReport()
    if state.trying is not None:  # (a window ran with the weights proposed last pass: credit it)
        since = state.observed_at if state.observed_at is not None else now - learning.every
        outcome = outcome_of(store, learning, since=max(since, now - 10 * learning.every), now=now)
        report.cost = weights.cost(outcome)
        state = weights.observe(state, outcome, box, now=now)
    elif state.observed_at is None:
        state = weights.observe(state, weights.Outcome((), learning.every), box, now=now)  # (its clock starts)
    state, proposed = weights.propose(state, box)
    report.trying, report.live = str(state.trying), {name: getattr(proposed, name) for name in weights.LEARNED}
    report.accepted, report.rejected = state.accepted, state.rejected
    if proposed != current:
        policy.save_policy(store, proposed, ordering)
        report.rescore = policy.rescore_all(store, proposed, ordering)
        report.changed = True
    with translate_redis_errors():
        store.client.set(store.keys.weight_learner, json.dumps(state.to_dict()))
    if report.changed:
        log.info("CP-Score weights now %s (%s; window cost %s)", report.live, report.trying, report.cost)
    return report
