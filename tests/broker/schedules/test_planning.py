"""The staggering planner (`broker/schedules/planning.py`): a lower peak, every run before its deadline, one
offset and cap per schedule, and no plan where none fits."""

from __future__ import annotations

import random

import pytest

from broker.schedules.planning import PlanRun, PlanTooLarge, Release, WorkBudget, simulate, stagger, unstaggered

HOUR = 3600.0


def nightly(index: int, *, rows: int = 400_000, deadline: float = 1.5 * HOUR, start: float = 0.0) -> PlanRun:
    """One of several end-of-day runs a minute apart, 100 chunks each, a millisecond a row on one slot."""
    slot = start + 60.0 * index
    return PlanRun(f"risk|step{index}", slot=slot, deadline_at=slot + deadline, rows=rows, chunks=100,
                   seconds_per_row=0.001)


def test_five_overlapping_nightly_runs_share_a_few_slots_instead_of_the_whole_fleet() -> None:
    runs = [nightly(index) for index in range(5)]

    before = simulate(runs, unstaggered(runs), fleet_slots=16)
    releases = stagger(runs, fleet_slots=16)
    assert releases is not None
    after = simulate(runs, releases, fleet_slots=16)

    assert before.peak_slots == 16 and before.peak_rows_per_second == pytest.approx(16_000)
    assert after.peak_slots == 1 and after.peak_rows_per_second == pytest.approx(1_000)
    assert after.late(runs) == [] and before.late(runs) == []
    assert releases["risk|step0"] == Release(0.0, 1)
    assert sorted(release.offset for release in releases.values())[1:] == sorted(
        {release.offset for release in releases.values()} - {0.0})  # each waits its turn


def test_tight_deadlines_take_more_slots_at_once_still_fewer_than_the_fleet() -> None:
    runs = [nightly(index, deadline=0.2 * HOUR) for index in range(5)]

    releases = stagger(runs, fleet_slots=16)
    assert releases is not None
    after = simulate(runs, releases, fleet_slots=16)

    assert after.late(runs) == [] and 1 < after.peak_slots < 16


def test_a_run_that_one_slot_cannot_finish_in_time_gets_a_wider_cap() -> None:
    runs = [nightly(0, deadline=150.0)]  # 400.5 slot seconds due in 150 s, 15 of them kept in hand: 3 slots

    releases = stagger(runs, fleet_slots=16)

    assert releases == {"risk|step0": Release(0.0, 3)}
    assert simulate(runs, releases, fleet_slots=16).late(runs) == []


def test_no_plan_where_not_even_the_whole_fleet_is_on_time() -> None:
    runs = [nightly(index, deadline=60.0) for index in range(5)]  # 400 slot seconds in a minute each

    assert stagger(runs, fleet_slots=4) is None
    assert simulate(runs, unstaggered(runs), fleet_slots=4).late(runs)


def test_the_runs_of_one_schedule_share_its_offset_and_cap() -> None:
    every_half_hour = [PlanRun("risk|often", slot=1800.0 * k, deadline_at=1800.0 * (k + 1), rows=200_000,
                               chunks=50, seconds_per_row=0.001) for k in range(4)]
    runs = every_half_hour + [nightly(0, start=600.0)]

    releases = stagger(runs, fleet_slots=8)

    assert releases is not None and set(releases) == {"risk|often", "risk|step0"}
    assert simulate(runs, releases, fleet_slots=8).late(runs) == []


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_never_raises_the_peak_nor_makes_a_run_late(seed: int) -> None:
    rng = random.Random(seed)
    runs = []
    for index in range(rng.randint(1, 7)):
        slot = rng.uniform(0, HOUR)
        runs.append(PlanRun(f"t|s{index}", slot=slot, deadline_at=slot + rng.uniform(0.2, 2.0) * HOUR,
                            rows=rng.randint(1_000, 2_000_000), chunks=rng.randint(1, 200),
                            seconds_per_row=rng.uniform(1e-4, 2e-3)))
    slots = rng.randint(2, 32)
    before = simulate(runs, unstaggered(runs), fleet_slots=slots)

    releases = stagger(runs, fleet_slots=slots)

    if releases is None:
        assert before.late(runs)  # (a plan is missing only where even the whole fleet is late)
        return
    after = simulate(runs, releases, fleet_slots=slots)
    assert after.late(runs) == [] and after.peak_slots <= before.peak_slots
    assert all(release.slots and release.offset >= 0 for release in releases.values())


def test_a_plan_past_its_work_budget_is_refused_as_too_large() -> None:
    """A plan is worked out inside an API request: 100 schedules of 5 runs each on 100,000 slots would hold
    a server process for seconds (measured: 3.8 s before the budget), so it is refused, with what to do."""
    runs = [PlanRun(f"t|s{member}", slot=run * 17_280.0, deadline_at=(run + 1) * 17_280.0, rows=100_000,
                    chunks=10_000, seconds_per_row=1.0) for member in range(100) for run in range(5)]

    with pytest.raises(PlanTooLarge, match="plan a shorter window, fewer schedules, or fewer slots"):
        stagger(runs, fleet_slots=100_000)
    assert stagger(runs[:5], fleet_slots=16, budget=WorkBudget()) is not None  # (a small one is planned)
