"""The weight learner's pass over Redis: windows per class read, weights made live through the hot update."""

from __future__ import annotations

import dataclasses

from broker.queueing import policy
from broker.queueing.scoring import Weights
from broker.state.store import Store
from broker.tuning import learning, windows
from broker.tuning.settings import WeightLearning
from tests.broker.broker_helpers import NOW

LEARN = WeightLearning(every=1.0, seed=3)


def note(store: Store, ref: str, *, at: float, klass: str, count: int, latency: float = 0.01,
         deadline: str = windows.NO_DEADLINE) -> None:
    store.client.sadd(store.keys.queues, ref)
    windows.note_answers(store, ref, [windows.Note(latency, klass, deadline)] * count, 1, now=at)


def in_box(weights: Weights, learn: WeightLearning) -> bool:
    return all(low <= getattr(weights, name) <= high
               for name, (low, high) in (("alpha", learn.alpha), ("beta", learn.beta), ("gamma", learn.gamma),
                                         ("delta", learn.delta)))


def test_each_pass_makes_the_proposed_weights_live_within_the_box_and_keeps_its_state(store: Store) -> None:
    seen = []
    for step in range(8):
        note(store, "mlp@v1", at=NOW + step - 0.5, klass="high", count=20, deadline=windows.MISSED if step % 2 else
             windows.MET)
        note(store, "mlp@v1", at=NOW + step - 0.5, klass="low", count=20)
        report = learning.learn_weights(store, LEARN, now=NOW + step, default_ordering="dynamic")
        live, _ = policy.get_policy(store, default="dynamic")
        assert in_box(live, LEARN) and report.live == {name: getattr(live, name) for name in report.live}
        seen.append(report)
    state = learning.read_state(store)
    assert state is not None and state.seed == 3 and state.draws >= 1
    assert any(r.changed for r in seen)  # (a candidate was tried: the live policy moved)
    assert any(r.cost is not None and r.cost > 0 for r in seen)  # (the missed deadlines cost)


def test_a_hand_made_change_of_a_field_it_does_not_learn_is_kept(store: Store) -> None:
    learning.learn_weights(store, LEARN, now=NOW, default_ordering="dynamic")
    live, ordering = policy.get_policy(store, default="dynamic")
    policy.save_policy(store, dataclasses.replace(live, express_bonus=5000.0), ordering)
    for step in range(1, 4):
        note(store, "mlp@v1", at=NOW + step - 0.5, klass="normal", count=20)
        learning.learn_weights(store, LEARN, now=NOW + step, default_ordering="dynamic")
    assert policy.get_policy(store, default="dynamic")[0].express_bonus == 5000.0


def test_a_class_that_starved_under_a_candidate_sends_the_learner_back_to_its_incumbent(store: Store) -> None:
    incumbent = Weights()
    state = None
    for step in range(12):
        report = learning.learn_weights(store, LEARN, now=NOW + step, default_ordering="dynamic")
        state = learning.read_state(store)
        assert state is not None
        starving = state.trying == "candidate"
        store.client.delete(store.keys.waiting_requests("mlp@v1"))
        if starving:  # every deadline met, but low waits and gets nothing while high is served
            note(store, "mlp@v1", at=NOW + step + 0.5, klass="high", count=20, deadline=windows.MET)
            store.client.zadd(store.keys.waiting_requests("mlp@v1"), {"r-low": 0})
        else:  # the incumbent misses half its deadlines, and serves low too
            note(store, "mlp@v1", at=NOW + step + 0.5, klass="high", count=10, deadline=windows.MET)
            note(store, "mlp@v1", at=NOW + step + 0.5, klass="high", count=10, deadline=windows.MISSED)
            note(store, "mlp@v1", at=NOW + step + 0.5, klass="low", count=5)
        del report
    assert state is not None and state.accepted == 0 and state.rejected >= 1
    live, _ = policy.get_policy(store, default="dynamic")
    assert state.incumbent == live or state.trying == "candidate"
    assert {name: getattr(state.incumbent, name) for name in ("alpha", "beta", "gamma", "delta")} == {
        name: getattr(incumbent, name) for name in ("alpha", "beta", "gamma", "delta")}
