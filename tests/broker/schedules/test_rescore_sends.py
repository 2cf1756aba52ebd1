"""The beat sends the queues' re-scoring every `beat.rescore_every`, only while it holds the turn (real Redis; the
send is a recording callback, as `test_releases.py` records releases)."""

from __future__ import annotations

from broker.schedules.passes import BeatPass, Periodic
from broker.schedules.settings import BeatSettings
from broker.state.store import Store
from tests.broker.broker_helpers import NOW


def beat(store: Store, holder: str, sent: list[str], **settings: float) -> BeatPass:
    return BeatPass(store, BeatSettings(**settings), holder, lambda member, slot: None,  # type: ignore[arg-type]
                    lambda: sent.append(holder))


def test_the_beat_holding_the_turn_sends_one_rescore_every_period(store: Store) -> None:
    sent: list[str] = []
    first, second = beat(store, "b1", sent, rescore_every=5.0), beat(store, "b2", sent, rescore_every=5.0)

    for step in range(0, 12):  # two beats passing every second, as tick lets them
        first.run(NOW + step)
        second.run(NOW + step + 0.5)

    assert sent == ["b1", "b1", "b1"]  # at NOW, NOW + 5 and NOW + 10; b2 never holds the turn


def test_rescore_every_zero_sends_none(store: Store) -> None:
    sent: list[str] = []
    off = beat(store, "b1", sent, rescore_every=0.0)
    for step in range(0, 12):
        off.run(NOW + step)
    assert sent == []


def test_a_clock_that_went_back_does_not_stop_the_sends(store: Store) -> None:
    sent: list[str] = []
    sender = beat(store, "b1", sent, rescore_every=5.0)
    sender.run(NOW + 3600)
    sender.run(NOW)
    assert sent == ["b1", "b1"]


def test_the_batching_controllers_steps_go_out_at_their_own_period_from_the_turn_holder(store: Store) -> None:
    steps: list[str] = []
    first = BeatPass(store, BeatSettings(rescore_every=0.0), "b1", lambda member, slot: None,
                     periodic=[Periodic(2.0, lambda: steps.append("b1"))])
    second = BeatPass(store, BeatSettings(rescore_every=0.0), "b2", lambda member, slot: None,
                      periodic=[Periodic(2.0, lambda: steps.append("b2"))])
    for step in range(0, 6):
        first.run(NOW + step)
        second.run(NOW + step + 0.5)
    assert steps == ["b1", "b1", "b1"]  # at NOW, NOW + 2 and NOW + 4
