"""Which model ran beside each job chunk on a worker's other stream slots (`sits_worker/serving/slot_overlap.py`):
the split of a chunk's seconds by neighbour, with a clock the test moves."""

from __future__ import annotations

import threading

import pytest

from sits_worker.serving.slot_overlap import ALONE, ENDED_KEPT, Interval, SlotOverlap, beside


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_chunk_s_seconds_are_split_by_what_overlapped_it() -> None:
    own = Interval("mlp", 0.0, 10.0)
    others = [Interval("cnn", -5.0, 4.0), Interval("mlp", 6.0, 20.0), Interval("cnn", 11.0, 12.0)]
    assert beside(own, others) == {"cnn": 4.0, "mlp": 4.0, ALONE: 2.0}
    assert beside(own, []) == {ALONE: 10.0}


def test_neighbours_at_once_on_three_or_more_slots_are_scaled_to_the_chunk_s_length() -> None:
    """Two others over the whole chunk: each gets half of it, nothing is alone."""
    split = beside(Interval("mlp", 0.0, 4.0), [Interval("cnn", 0.0, 4.0), Interval("bert", -1.0, 5.0)])
    assert split == {"cnn": pytest.approx(2.0), "bert": pytest.approx(2.0)}
    assert sum(split.values()) == pytest.approx(4.0)


def test_the_tracker_sees_running_and_ended_neighbours() -> None:
    clock = Clock()
    slots = SlotOverlap(clock)
    cnn = slots.begin("cnn")
    clock.now = 2.0
    mlp = slots.begin("mlp")
    clock.now = 5.0
    assert slots.end(cnn) == {ALONE: 2.0, "mlp": 3.0}
    clock.now = 6.0
    other = slots.begin("mlp")
    clock.now = 8.0
    # beside the convnet 2-5 (ended), alone 5-6, beside another mlp chunk 6-8 (still running)
    assert slots.end(mlp) == {"cnn": 3.0, ALONE: 1.0, "mlp": 2.0}
    clock.now = 9.0
    assert slots.end(other) == {"mlp": 2.0, ALONE: 1.0}


def test_the_tracker_keeps_a_bounded_history_and_takes_threads() -> None:
    slots = SlotOverlap()
    tokens: list[int] = []

    def run() -> None:
        for _ in range(100):
            slots.end(slots.begin("mlp"))
        tokens.append(1)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tokens) == 4
    assert len(slots._ended) == ENDED_KEPT and not slots._running
