"""The batching controller's pure decision: bounded steps inside the safe range, patience and cooldown,
the overload / over-target / quiet rules, and a toy queue that is quiet, surges and goes quiet again."""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.errors import ConfigError
from broker.tuning.controller import ControllerSettings, ControllerState, Decision, SafeRange, Window, step

SAFE = SafeRange(batch_sizes=(1, 2, 4, 8, 16, 32, 64), delays=(0.0, 0.001, 0.002, 0.004, 0.008))
SETTINGS = ControllerSettings(target_p99=0.120, cooldown=30.0, patience=3, min_answered=20)
NOW = 1_800_000_000.0
LONG_AGO = NOW - 3600


def _window(p99: float | None = 0.05, *, answered: int = 500, waiting: int = 0, waiting_before: int = 0,
            rows: float = 4.0) -> Window:
    return Window(seconds=10.0, answered=answered, p99_seconds=p99, waiting=waiting,
                  waiting_before=waiting_before, mean_batch_rows=rows)


GROWING = _window(0.05, waiting=900, waiting_before=300, rows=8)
OVER_TARGET = _window(0.200, rows=3)
IN_BAND = _window(0.100, rows=3)
QUIET = _window(0.010, rows=1)


def _state(batch_size: int, delay: float, changed_at: float = LONG_AGO) -> ControllerState:
    return ControllerState.start(SAFE, batch_size, delay, changed_at=changed_at)


def _run(state: ControllerState, *windows: Window, every: float = 10.0, start: float = NOW,
         config: ControllerSettings = SETTINGS, safe: SafeRange = SAFE) -> list[Decision]:
    """The decisions over `windows`, one every `every` seconds after `start`."""
    decisions = []
    for number, window in enumerate(windows, 1):
        decisions.append(step(state, window, config, safe, now=start + number * every))
        state = decisions[-1].state
    return decisions


def test_start_takes_the_nearest_allowed_values_the_lower_on_a_tie() -> None:
    state = ControllerState.start(SAFE, 24, 0.0026)
    assert (SAFE.batch_sizes[state.batch_index], SAFE.delays[state.delay_index]) == (16, 0.002)
    assert ControllerState.start(SAFE, 1000, 1.0) == ControllerState(6, 4)
    assert ControllerState.start(SAFE, 0, -1.0) == ControllerState(0, 0)


def test_a_growing_queue_raises_the_ceiling_once_patience_windows_agree() -> None:
    decisions = _run(_state(8, 0.002), GROWING, GROWING, GROWING)

    assert [d.changed for d in decisions] == [False, False, True]
    assert (decisions[-1].batch_size, decisions[-1].delay) == (16, 0.002)
    assert decisions[-1].reason == "overload: ceiling up"


def test_a_standing_backlog_over_target_raises_the_ceiling_rather_than_cutting_it() -> None:
    standing = _window(0.300, waiting=400, waiting_before=400, rows=8)

    last = _run(_state(8, 0.002), standing, standing, standing)[-1]

    assert (last.batch_size, last.delay, last.reason) == (16, 0.002, "overload: ceiling up")


def test_overload_raises_the_delay_at_the_top_ceiling_and_holds_at_both_tops() -> None:
    at_top = _run(_state(64, 0.002), *[GROWING] * 3)[-1]
    assert (at_top.batch_size, at_top.delay, at_top.reason) == (64, 0.004, "overload: delay up")

    pinned = _run(_state(64, 0.008), *[GROWING] * 3)
    assert not any(d.changed for d in pinned)
    assert pinned[-1].reason == "overload: at the edge of the safe range"


def test_p99_over_target_without_backlog_lowers_the_delay_first_then_the_ceiling() -> None:
    decisions = _run(_state(16, 0.002), *[OVER_TARGET] * 9, every=10.0)

    moves = [(d.batch_size, d.delay, d.reason) for d in decisions if d.changed]
    assert moves == [(16, 0.001, "p99 over target: delay down"), (16, 0.0, "p99 over target: delay down"),
                     (8, 0.0, "p99 over target: ceiling down")]


def test_room_to_spare_with_full_batches_or_a_backlog_raises_the_ceiling() -> None:
    full = _window(0.020, rows=8)
    backlog = _window(0.020, waiting=50, waiting_before=60, rows=5)

    for window in (full, backlog):
        last = _run(_state(8, 0.0), window, window, window)[-1]
        assert (last.batch_size, last.delay, last.reason) == (16, 0.0, "room to spare: ceiling up")


def test_a_quiet_model_walks_the_delay_down_to_its_lowest_and_leaves_the_ceiling() -> None:
    decisions = _run(_state(32, 0.008), *[QUIET] * 30)

    assert {d.batch_size for d in decisions} == {32}
    assert [d.delay for d in decisions if d.changed] == [0.004, 0.002, 0.001, 0.0]
    assert decisions[-1].delay == 0.0 and decisions[-1].reason == "quiet: at the edge of the safe range"


def test_part_full_batches_well_under_target_change_nothing() -> None:
    decisions = _run(_state(16, 0.004), *[_window(0.010, rows=11)] * 10)

    assert not any(d.changed for d in decisions)
    assert decisions[-1].reason == "room to spare, batches part full"


def test_a_window_in_the_band_or_with_too_few_answers_resets_the_streak() -> None:
    few = _window(None, answered=3, rows=1)
    for breaker in (IN_BAND, few, _window(0.300, answered=19)):
        decisions = _run(_state(16, 0.002), OVER_TARGET, OVER_TARGET, breaker, OVER_TARGET, OVER_TARGET)
        assert not any(d.changed for d in decisions), breaker
        assert decisions[2].state.streak == 0


def test_too_few_answers_with_a_growing_queue_is_still_overload() -> None:
    stalled = _window(None, answered=0, waiting=800, waiting_before=200, rows=0)

    assert _run(_state(8, 0.0), stalled, stalled, stalled)[-1].reason == "overload: ceiling up"


def test_no_change_before_the_cooldown_since_the_last_one() -> None:
    decisions = _run(_state(4, 0.0), *[GROWING] * 9, every=5.0)  # patience 3 takes 15 s, cooldown 30 s

    assert [d.changed for d in decisions] == [False, False, True, False, False, False, False, False, True]
    assert decisions[5].reason == "overload: ceiling up after the cooldown"
    assert decisions[0].reason == "overload: ceiling up after 3 windows (1 so far)"


def test_a_steady_window_inside_the_band_never_moves_a_knob() -> None:
    decisions = _run(_state(16, 0.002), *[IN_BAND] * 200)

    assert not any(d.changed for d in decisions)
    assert {(d.batch_size, d.delay, d.reason) for d in decisions} == {(16, 0.002, "p99 within band")}


@given(p99=st.floats(0.6 * 0.120, 0.120), rows=st.floats(0, 64), waiting=st.integers(0, 15),
       batch_index=st.integers(4, 6), delay_index=st.integers(0, 4))
def test_any_steady_window_in_the_band_without_overload_never_moves_a_knob(
        p99: float, rows: float, waiting: int, batch_index: int, delay_index: int) -> None:
    window = _window(p99, waiting=waiting, waiting_before=waiting, rows=rows)

    decisions = _run(ControllerState(batch_index, delay_index), *[window] * 12)

    assert not any(d.changed for d in decisions)


def test_lowering_a_knob_for_p99_bars_room_to_spare_from_raising_it_back_for_a_while() -> None:
    config = ControllerSettings(target_p99=0.120, cooldown=30.0, patience=3, memory=600.0)
    cut = _run(_state(16, 0.0), *[OVER_TARGET] * 3, config=config)[-1]
    assert (cut.batch_size, cut.state.batch_cap) == (8, 4)

    full = _window(0.020, rows=8)
    held = _run(cut.state, *[full] * 3, start=NOW + 30, every=100.0, config=config)
    assert [d.batch_size for d in held] == [8, 8, 8] and held[-1].delay == 0.001  # the delay, not the ceiling
    assert _run(cut.state, *[full] * 3, start=NOW + 30 + 600, config=config)[-1].batch_size == 16
    assert _run(cut.state, *[GROWING] * 3, start=NOW + 30, config=config)[-1].batch_size == 16


windows = st.builds(Window, seconds=st.just(10.0), answered=st.integers(0, 2000),
                    p99_seconds=st.none() | st.floats(0.0, 1.0), waiting=st.integers(0, 3000),
                    waiting_before=st.integers(0, 3000), mean_batch_rows=st.floats(0.0, 64.0))


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(windows, st.floats(0.5, 60.0)), max_size=60),
       batch_index=st.integers(0, 6), delay_index=st.integers(0, 4),
       patience=st.integers(1, 4), cooldown=st.floats(0.0, 90.0))
def test_every_step_moves_one_knob_one_index_at_most_inside_the_range_and_only_when_allowed(
        steps: list[tuple[Window, float]], batch_index: int, delay_index: int, patience: int, cooldown: float) -> None:
    config = ControllerSettings(target_p99=0.120, cooldown=cooldown, patience=patience)
    state, now, last_change, since_change = ControllerState(batch_index, delay_index, LONG_AGO), NOW, LONG_AGO, 0
    for window, gap in steps:
        now += gap
        decision = step(state, window, config, SAFE, now=now)
        new = decision.state
        moved = (new.batch_index - state.batch_index, new.delay_index - state.delay_index)
        assert abs(moved[0]) + abs(moved[1]) <= 1
        assert 0 <= new.batch_index < len(SAFE.batch_sizes) and 0 <= new.delay_index < len(SAFE.delays)
        assert decision.batch_size == SAFE.batch_sizes[new.batch_index]
        assert decision.delay == SAFE.delays[new.delay_index]
        assert decision.changed == (moved != (0, 0))
        since_change += 1
        if decision.changed:
            assert now - last_change >= cooldown and since_change >= patience
            last_change, since_change = now, 0
        ceiling = SAFE.batch_sizes[state.batch_index]
        if window.waiting >= ceiling and window.waiting > window.waiting_before:  # capacity short: never cut
            assert moved[0] >= 0 and moved[1] >= 0
        state = new


@given(batch_index=st.integers(-3, 12), delay_index=st.integers(-3, 12), window=windows,
       sizes=st.lists(st.integers(1, 256), min_size=1, max_size=5, unique=True),
       delays=st.lists(st.floats(0.0, 0.05), min_size=1, max_size=4, unique=True))
def test_a_shrunk_safe_range_clamps_the_state_into_it(batch_index: int, delay_index: int, window: Window,
                                                      sizes: list[int], delays: list[float]) -> None:
    safe = SafeRange(tuple(sorted(sizes)), tuple(sorted(delays)))

    decision = step(ControllerState(batch_index, delay_index), window, SETTINGS, safe, now=NOW)

    assert 0 <= decision.state.batch_index < len(sizes) and 0 <= decision.state.delay_index < len(delays)
    assert decision.batch_size in sizes and decision.delay in delays
    inside = 0 <= batch_index < len(sizes) and 0 <= delay_index < len(delays)
    assert inside or decision.reason == "safe range changed: clamped into it"


@given(st.builds(ControllerState, batch_index=st.integers(0, 64), delay_index=st.integers(0, 64),
                 changed_at=st.floats(0, 4e9), streak=st.integers(0, 5), streak_sign=st.sampled_from([-1, 0, 1]),
                 batch_cap=st.none() | st.integers(0, 64), delay_cap=st.none() | st.integers(0, 64),
                 caps_until=st.floats(0, 4e9)))
def test_the_state_round_trips_through_json(state: ControllerState) -> None:
    assert ControllerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_settings_and_safe_ranges_out_of_range_are_refused() -> None:
    with pytest.raises(ConfigError, match="low_water"):
        ControllerSettings(target_p99=0.1, low_water=1.5)
    with pytest.raises(ConfigError, match="ascending"):
        SafeRange((8, 4), (0.0,))
    with pytest.raises(ConfigError, match="non-empty"):
        SafeRange((8,), ())


@dataclass
class ToyQueue:
    """One worker over one FIFO queue, deterministic: requests arrive evenly spaced, a batch of n rows runs
    `fixed + per_row * n` seconds, and the head waits up to the delay for the batch to fill."""

    fixed: float = 0.005
    per_row: float = 0.00025
    arrivals: list[float] = field(default_factory=list)
    head: int = 0
    free_at: float = 0.0
    next_arrival: float = 0.0
    waiting_before: int = 0

    def run(self, start: float, end: float, rate: float, ceiling: int, delay: float) -> Window:
        """The window [start, end) at `rate` requests a second (a batch is counted when it starts)."""
        self.next_arrival = max(self.next_arrival, start)
        while self.next_arrival < end:
            self.arrivals.append(self.next_arrival)
            self.next_arrival += 1 / rate
        latencies: list[float] = []
        batches: list[int] = []
        while self.head < len(self.arrivals):
            fills = self.head + ceiling - 1
            full_at = self.arrivals[fills] if fills < len(self.arrivals) else math.inf
            begin = max(self.free_at, self.arrivals[self.head], min(self.arrivals[self.head] + delay, full_at))
            if begin >= end:
                break
            rows = min(ceiling, bisect_right(self.arrivals, begin, self.head) - self.head)
            self.free_at = begin + self.fixed + self.per_row * rows
            latencies += [self.free_at - arrived for arrived in self.arrivals[self.head:self.head + rows]]
            batches.append(rows)
            self.head += rows
        waiting = bisect_right(self.arrivals, end, self.head) - self.head
        latencies.sort()
        window = Window(seconds=end - start, answered=len(latencies),
                        p99_seconds=latencies[math.ceil(0.99 * len(latencies)) - 1] if latencies else None,
                        waiting=waiting, waiting_before=self.waiting_before,
                        mean_batch_rows=sum(batches) / len(batches) if batches else 0.0)
        self.waiting_before = waiting
        return window


def test_a_surge_raises_the_ceiling_and_the_quiet_after_it_walks_the_delay_back_down() -> None:
    safe = SafeRange(batch_sizes=(1, 2, 4, 8, 16), delays=(0.0, 0.001, 0.002, 0.004, 0.008))
    config = ControllerSettings(target_p99=0.120, cooldown=4.0, patience=2)
    state, queue, now = ControllerState.start(safe, 4, 0.004), ToyQueue(), 0.0
    seen: dict[str, list[Decision]] = {"quiet": [], "surge": [], "quiet again": []}
    for phase, rate, seconds in (("quiet", 50.0, 30), ("surge", 1500.0, 60), ("quiet again", 50.0, 60)):
        for _ in range(seconds // 2):
            ceiling, delay = safe.batch_sizes[state.batch_index], safe.delays[state.delay_index]
            window = queue.run(now, now + 2.0, rate, ceiling, delay)
            now += 2.0
            seen[phase].append(step(state, window, config, safe, now=now))
            state = seen[phase][-1].state

    # quiet: 50 req/s, one request a batch; the delay only held each one back
    assert [d.delay for d in seen["quiet"] if d.changed] == [0.002, 0.001, 0.0]
    assert {d.batch_size for d in seen["quiet"]} == {4}
    # surge: 1500 req/s against 667 rows/s at a ceiling of 4; the ceiling climbs to its top, never down
    surge_sizes = [d.batch_size for d in seen["surge"]]
    assert surge_sizes == sorted(surge_sizes) and surge_sizes[-1] == 16
    assert all(d.reason.startswith("overload") for d in seen["surge"] if d.changed and d.batch_size > 4)
    # quiet again: the delay the surge raised walks back to its lowest; the ceiling stays
    assert seen["quiet again"][0].delay > 0.0 and seen["quiet again"][-1].delay == 0.0
    assert {d.batch_size for d in seen["quiet again"]} == {16}
    assert all(d.reason == "quiet: delay down" for d in seen["quiet again"] if d.changed)


def test_requests_fast_enough_to_bring_company_within_a_wait_step_the_delay_up_to_it_and_back_when_slow() -> None:
    """At 400 requests a second one more arrives within 2.5 ms: the delay steps up to 4 ms, the shortest
    wait of the range that brings company, and stays; at 20 a second none would, and it walks back to 0."""
    fast = _window(0.010, answered=4000, rows=2)  # (10 s windows: 400 a second, batches of 2 under a ceiling of 32)
    slow = _window(0.010, answered=200, rows=1)

    decisions = _run(_state(32, 0.0), *[fast] * 20, *[slow] * 20)

    moves = [(d.delay, d.reason) for d in decisions if d.changed]
    assert moves == [(0.001, "company within a longer delay: delay up"),
                     (0.002, "company within a longer delay: delay up"),
                     (0.004, "company within a longer delay: delay up"),
                     (0.002, "quiet: delay down"), (0.001, "quiet: delay down"), (0.0, "quiet: delay down")]
    assert {d.batch_size for d in decisions} == {32}
