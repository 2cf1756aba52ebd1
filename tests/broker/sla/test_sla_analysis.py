"""Schedulability of periodic task sets: textbook sets with hand-computed response times, blocking,
policies, several workers, costs derived from model profiles, and the task set's validation."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.errors import Conflict
from broker.models.model_record import ModelRecord
from broker.sla import analysis
from broker.sla.analysis import (
    MAX_STEPS,
    WORK_BUDGET,
    analyse,
    global_response,
    jobs_released,
    liu_layland_bound,
    priority_order,
)
from broker.sla.task_sets import DEFAULT_ITEM_OVERHEAD_MS, MAX_TASKS, PeriodicTask, TaskSet, given_task, model_cost


def answer_for(body: dict[str, Any]) -> dict[str, Any]:
    """The analysis of a task set of `wcet_ms` tasks, as the API answers it (less its notes)."""
    task_set = TaskSet.model_validate(body)
    return analyse([given_task(spec) for spec in task_set.tasks], policy=task_set.policy, workers=task_set.workers)


def unblocked(*tasks: tuple[str, float, float]) -> list[dict[str, Any]]:
    """(name, C, T) tasks with D = T and no blocking: the textbook's preemptive tasks."""
    return [{"name": name, "wcet_ms": c, "period_ms": t, "blocking_ms": 0} for name, c, t in tasks]


def responses(answer: dict[str, Any]) -> dict[str, float | None]:
    return {task["name"]: task["response_ms"] for task in answer["tasks"]}


# --- textbook task sets ---------------------------------------------------------------------


def test_a_set_above_the_liu_layland_bound_that_response_times_prove_feasible() -> None:
    """Burns and Wellings, "Real-Time Systems and Programming Languages", the set (C, T): a (3, 7),
    b (3, 12), c (5, 20). U = 3/7 + 3/12 + 5/20 = 0.929 > 3(2^(1/3) - 1) = 0.780.

    Ra = 3. Rb = 3 + ceil(Rb/7)*3: 6 -> 3 + 3 = 6.
    Rc = 5 + ceil(Rc/7)*3 + ceil(Rc/12)*3: 11 -> 5 + 6 + 3 = 14 -> 5 + 6 + 6 = 17 -> 5 + 9 + 6 = 20
    -> 5 + 9 + 6 = 20 <= 20: c meets its deadline exactly.
    """
    answer = answer_for({"tasks": unblocked(("a", 3, 7), ("b", 3, 12), ("c", 5, 20))})

    assert answer["utilisation"] == pytest.approx(3 / 7 + 3 / 12 + 5 / 20)
    assert answer["bound"]["value"] == pytest.approx(0.779763, abs=1e-6)
    assert answer["bound"]["verdict"] == "inconclusive"
    assert responses(answer) == {"a": 3.0, "b": 6.0, "c": 20.0}
    assert answer["feasible"] is True and all(task["meets"] for task in answer["tasks"])
    assert answer["tasks"][2]["slack_ms"] == 0.0


def test_an_infeasible_set_names_the_task_that_misses_and_how_far_the_iteration_got() -> None:
    """Burns and Wellings' second set (C, T): a (12, 50), b (10, 40), c (10, 30); U = 0.823.
    Rate-monotonic: c, b, a. Rc = 10. Rb = 10 + ceil(Rb/30)*10: 20 -> 20.
    Ra = 12 + ceil(Ra/30)*10 + ceil(Ra/40)*10: 32 -> 12 + 20 + 10 = 42 -> 12 + 20 + 20 = 52 > 50.
    """
    answer = answer_for({"tasks": unblocked(("a", 12, 50), ("b", 10, 40), ("c", 10, 30))})

    assert [task["name"] for task in answer["tasks"]] == ["c", "b", "a"]
    assert responses(answer) == {"c": 10.0, "b": 20.0, "a": None}
    assert answer["feasible"] is False and answer["verdict"].startswith("not feasible: 1 of 3")
    missed = answer["tasks"][2]
    assert missed["meets"] is False and missed["slack_ms"] is None
    assert "52 ms > D = 50 ms" in missed["reason"]


def test_a_set_within_the_bound_is_feasible_by_the_bound_and_by_response_times() -> None:
    """(C, T): a (1, 4), b (1, 5), c (2, 10); U = 0.25 + 0.2 + 0.2 = 0.65 <= 0.780.
    Ra = 1. Rb = 1 + ceil(Rb/4): 2 -> 2. Rc = 2 + ceil(Rc/4) + ceil(Rc/5): 4 -> 2 + 1 + 1 = 4."""
    answer = answer_for({"tasks": unblocked(("a", 1, 4), ("b", 1, 5), ("c", 2, 10))})

    assert answer["bound"]["verdict"] == "feasible"
    assert responses(answer) == {"a": 1.0, "b": 2.0, "c": 4.0}


def test_a_harmonic_set_at_full_utilisation_is_feasible() -> None:
    """(C, T): a (1, 2), b (1, 4), c (2, 8); U = 1. Rb = 1 + ceil(Rb/2): 2 -> 2.
    Rc = 2 + ceil(Rc/2) + ceil(Rc/4): 4 -> 2 + 2 + 1 = 5 -> 2 + 3 + 2 = 7 -> 2 + 4 + 2 = 8 -> 8."""
    answer = answer_for({"tasks": unblocked(("a", 1, 2), ("b", 1, 4), ("c", 2, 8))})

    assert responses(answer) == {"a": 1.0, "b": 2.0, "c": 8.0}
    assert answer["feasible"] is True and answer["bound"]["verdict"] == "inconclusive"


DEADLINES = [  # Burns and Wellings' deadline-monotonic example: (C, T, D)
    {"name": "a", "wcet_ms": 3, "period_ms": 20, "deadline_ms": 5, "blocking_ms": 0},
    {"name": "b", "wcet_ms": 3, "period_ms": 15, "deadline_ms": 7, "blocking_ms": 0},
    {"name": "c", "wcet_ms": 4, "period_ms": 10, "blocking_ms": 0},
    {"name": "d", "wcet_ms": 3, "period_ms": 20, "blocking_ms": 0},
]


def test_deadline_monotonic_meets_deadlines_that_rate_monotonic_misses() -> None:
    """Deadline-monotonic: a, b, c, d. Ra = 3 <= 5. Rb = 3 + ceil(Rb/20)*3 = 6 <= 7.
    Rc = 4 + ceil(Rc/20)*3 + ceil(Rc/15)*3: 10 -> 10 <= 10.
    Rd = 3 + ceil(Rd/20)*3 + ceil(Rd/15)*3 + ceil(Rd/10)*4: 13 -> 3 + 3 + 3 + 8 = 17 -> 3 + 3 + 6 + 8 = 20 -> 20.
    Rate-monotonic: c, b, a, d (a before d by name). Ra = 3 + ceil(Ra/10)*4 + ceil(Ra/15)*3: it starts
    at 3 + 4 + 3 = 10 > 5, so a misses."""
    by_deadline = answer_for({"policy": "deadline-monotonic", "tasks": DEADLINES})
    by_rate = answer_for({"policy": "rate-monotonic", "tasks": DEADLINES})

    assert [task["name"] for task in by_deadline["tasks"]] == ["a", "b", "c", "d"]
    assert responses(by_deadline) == {"a": 3.0, "b": 6.0, "c": 10.0, "d": 20.0}
    assert by_deadline["feasible"] is True
    assert [task["name"] for task in by_rate["tasks"]] == ["c", "b", "a", "d"]
    assert responses(by_rate) == {"c": 4.0, "b": 7.0, "a": None, "d": 20.0}
    assert by_rate["feasible"] is False
    assert "do not follow the deadlines" in by_rate["bound"]["reason"]  # densities say nothing here
    assert "density" in by_deadline["bound"]["reason"]  # (1.029 > 0.828: inconclusive)


def test_ties_in_period_are_broken_by_name_whatever_the_order_given() -> None:
    tasks = unblocked(("zeta", 1, 10), ("alpha", 1, 10), ("mid", 1, 5))

    assert [task["name"] for task in answer_for({"tasks": tasks})["tasks"]] == ["mid", "alpha", "zeta"]
    assert [task["name"] for task in answer_for({"tasks": tasks[::-1]})["tasks"]] == ["mid", "alpha", "zeta"]


# --- blocking -------------------------------------------------------------------------------


def test_blocking_defaults_to_the_longest_lower_priority_section() -> None:
    """Sections default to the whole wcet: a (1, 4) and b (1, 5) are blocked by c's 2, c by nothing.
    Ra = 1 + 2 = 3. Rb = 1 + 2 + ceil(Rb/4): 4 -> 4. Rc = 4 as without blocking.
    The bound with blocking: U(a, b) + Bb/Tb = 0.45 + 0.4 = 0.85 > 2(2^(1/2) - 1) = 0.828."""
    answer = answer_for({"tasks": [{"name": "a", "wcet_ms": 1, "period_ms": 4},
                                   {"name": "b", "wcet_ms": 1, "period_ms": 5},
                                   {"name": "c", "wcet_ms": 2, "period_ms": 10}]})

    assert [task["blocking_ms"] for task in answer["tasks"]] == [2.0, 2.0, 0.0]
    assert "task 'c'" in answer["tasks"][0]["blocking_source"]
    assert answer["tasks"][2]["blocking_source"] == "none: no lower-priority task"
    assert responses(answer) == {"a": 3.0, "b": 4.0, "c": 4.0}
    assert answer["bound"]["verdict"] == "inconclusive" and "+ B/T of 'b'" in answer["bound"]["reason"]


def test_a_shorter_section_blocks_less_and_a_given_blocking_overrides_it() -> None:
    """a (1, 4) over b (3, 12): blocked by b's whole 3, Ra = 4 <= 4. With b's section 1, Ra = 2; with
    blocking_ms 3.5 given, Ra = 4.5 > 4 and a misses."""
    whole = answer_for({"tasks": [{"name": "a", "wcet_ms": 1, "period_ms": 4},
                                  {"name": "b", "wcet_ms": 3, "period_ms": 12}]})
    short = answer_for({"tasks": [{"name": "a", "wcet_ms": 1, "period_ms": 4},
                                  {"name": "b", "wcet_ms": 3, "period_ms": 12, "section_ms": 1}]})
    given = answer_for({"tasks": [{"name": "a", "wcet_ms": 1, "period_ms": 4, "blocking_ms": 3.5},
                                  {"name": "b", "wcet_ms": 3, "period_ms": 12, "section_ms": 1}]})

    assert responses(whole)["a"] == 4.0 and whole["tasks"][1]["section_source"].startswith("the whole wcet")
    assert responses(short)["a"] == 2.0 and short["tasks"][1]["section_source"] == "given"
    assert responses(given)["a"] is None and given["tasks"][0]["blocking_source"] == "given"
    # b: 3 + ceil(Rb/4)*1 = 4 -> 4 in all three (b, the lowest, is blocked by nothing)
    assert {responses(case)["b"] for case in (whole, short, given)} == {4.0}


# --- several workers ------------------------------------------------------------------------


def test_several_workers_use_the_global_bound_with_carry_in() -> None:
    """Two workers, no blocking; (C, T): a (2, 10), b (4, 10), c (6, 20).
    Ra = 2. Rb = 4 + ceil((Rb + 2)/10)*2/2: 4 -> 5 -> 5.
    Rc = 6 + (ceil((Rc + 2)/10)*2 + ceil((Rc + 5)/10)*4)/2: 6 -> 6 + (2 + 8)/2 = 11 -> 6 + (4 + 8)/2 = 12 -> 12."""
    answer = answer_for({"workers": 2, "tasks": unblocked(("a", 2, 10), ("b", 4, 10), ("c", 6, 20))})

    assert responses(answer) == {"a": 2.0, "b": 5.0, "c": 12.0}
    assert answer["bound"]["verdict"] == "inconclusive" and "one-worker test" in answer["bound"]["reason"]
    assert "global" in answer["analysis"]


def test_on_several_workers_blocking_counts_two_n_minus_one_lower_sections() -> None:
    """Two workers: a (2, 20) is blocked by 3 of b's sections of 4: B = 12, Ra = 2 + 12/2 = 8.
    Rb = 4 + ceil((Rb + 8)/20)*2/2: 4 -> 5 -> 5."""
    answer = answer_for({"workers": 2, "tasks": [{"name": "a", "wcet_ms": 2, "period_ms": 20},
                                                 {"name": "b", "wcet_ms": 4, "period_ms": 40}]})

    assert answer["tasks"][0]["blocking_ms"] == 12.0 and answer["tasks"][0]["blocking_source"].startswith("3 x")
    assert responses(answer) == {"a": 8.0, "b": 5.0}


def test_on_several_workers_a_task_below_one_without_a_bound_has_none_either() -> None:
    answer = answer_for({"workers": 2, "tasks": unblocked(("a", 30, 20), ("b", 1, 40))})

    assert responses(answer) == {"a": None, "b": None}
    assert "higher-priority task 'a'" in answer["tasks"][1]["reason"]


def test_one_worker_is_the_classic_analysis_not_the_global_bound() -> None:
    one = answer_for({"workers": 1, "tasks": unblocked(("a", 2, 10), ("b", 4, 10), ("c", 6, 20))})

    # Rb = 4 + ceil(Rb/10)*2: 6 -> 6. Rc = 6 + ceil(Rc/10)*(2 + 4): 12 -> 18 -> 18.
    assert responses(one) == {"a": 2.0, "b": 6.0, "c": 18.0}


def test_more_utilisation_than_workers_is_said_to_have_no_schedule() -> None:
    answer = answer_for({"tasks": unblocked(("a", 6, 10), ("b", 6, 10))})

    assert answer["feasible"] is False and "no schedule meets every deadline" in answer["bound"]["reason"]


# --- properties -----------------------------------------------------------------------------

task_sets = st.lists(st.tuples(st.integers(1, 20), st.integers(5, 200)), min_size=1, max_size=6).filter(
    lambda tasks: all(c <= t for c, t in tasks))


@given(task_sets)
def test_whatever_the_bound_accepts_response_times_accept(tasks: list[tuple[int, int]]) -> None:
    """The bound is sufficient, never more permissive than the exact test (blocking included)."""
    answer = answer_for({"tasks": [{"name": f"t{i}", "wcet_ms": c, "period_ms": t} for i, (c, t) in enumerate(tasks)]})
    if answer["bound"]["verdict"] == "feasible":
        assert answer["feasible"]


@given(task_sets)
def test_every_response_time_is_a_fixed_point_of_its_equation(tasks: list[tuple[int, int]]) -> None:
    answer = answer_for({"tasks": [{"name": f"t{i}", "wcet_ms": c, "period_ms": t} for i, (c, t) in enumerate(tasks)]})
    for index, task in enumerate(answer["tasks"]):
        if task["response_ms"] is None:
            continue
        higher = answer["tasks"][:index]
        demand = task["wcet_ms"] + task["blocking_ms"] + sum(
            math.ceil(task["response_ms"] / other["period_ms"]) * other["wcet_ms"] for other in higher)
        assert demand == pytest.approx(task["response_ms"])
        assert task["response_ms"] <= task["deadline_ms"]


def test_the_bound_and_the_job_count_are_the_textbook_ones() -> None:
    assert liu_layland_bound(1) == 1.0
    assert liu_layland_bound(2) == pytest.approx(0.828427, abs=1e-6)
    assert jobs_released(20.0, 10.0) == 2  # the job released at 20 is not in [0, 20)
    assert jobs_released(0.1 + 0.2, 0.3) == 1  # a rounding error above 1 is still 1
    assert jobs_released(20.5, 10.0) == 3


def test_priority_order_follows_the_policy() -> None:
    a = PeriodicTask(name="a", wcet_ms=1, period_ms=10, deadline_ms=3, section_ms=1)
    b = PeriodicTask(name="b", wcet_ms=1, period_ms=5, deadline_ms=5, section_ms=1)

    assert [task.name for task in priority_order([a, b], "rate-monotonic")] == ["b", "a"]
    assert [task.name for task in priority_order([a, b], "deadline-monotonic")] == ["a", "b"]


# --- the analysis's work -------------------------------------------------------------------

SLOW_SET = {"tasks": [{"name": "t000", "period_ms": 1, "wcet_ms": 0.9999999}] + [
    {"name": f"t{i:03d}", "period_ms": 86_400_000 - i, "wcet_ms": 0.5} for i in range(1, MAX_TASKS)]}
"""One task of period 1 at full load over 255 of a day: each lower task's iteration adds one job of
t000 a step and would take 5,000,000 steps, so each stops at MAX_STEPS; 10,000 x 256^2 / 2 operations
(a minute of CPU) without a budget per request."""


def test_a_set_that_would_take_minutes_stops_at_the_request_s_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted, not timed: every operation is a jobs_released call. The 12 most urgent lower tasks each
    spend MAX_STEPS steps (10,000 x (1 + 2 + ... + 12) + the step counts = 781,000 + 130,000 of the
    1,000,000), the 13th runs out part way, and the other 242 are not started."""
    calls = 0
    counted = analysis.jobs_released

    def counting(window_ms: float, period_ms: float) -> float:
        nonlocal calls
        calls += 1
        return counted(window_ms, period_ms)

    monkeypatch.setattr(analysis, "jobs_released", counting)

    answer = answer_for(SLOW_SET)

    assert calls <= WORK_BUDGET
    reasons = [task["reason"] for task in answer["tasks"]]
    assert reasons[0].startswith("passes its deadline")  # t000: 0.9999999 + B 0.5 > 1
    assert reasons[1:13] == [f"not proven: no fixed point within {MAX_STEPS:,} steps"] * 12
    assert reasons[13].startswith(f"not proven: the analysis's budget of {WORK_BUDGET:,} operations per request "
                                  "ran out after 7,142 steps")
    assert reasons[14:] == [f"not proven: the analysis's budget of {WORK_BUDGET:,} operations per request ran out "
                            "before this task; ask about fewer tasks, or periods less far apart, in one request"] * 242
    assert answer["feasible"] is False and all(task["response_ms"] is None for task in answer["tasks"])


@pytest.mark.parametrize(("first_period", "feasible"), [(1000, True), (230, False)])
def test_the_budget_leaves_a_full_set_of_ordinary_tasks_exact(first_period: int, feasible: bool) -> None:
    """256 tasks of 1 ms, blocking 0, periods from `first_period` up in steps of 1 ms. From 1 s (U = 0.23)
    every task converges at its first step: the lowest's R is 256 jobs of 1 ms, none released twice
    in 256 ms. From 230 ms (U = 0.75) the iterations run up to 231 steps, about 240,000 operations in
    all; every task is still decided (met or missed), none cut short by the budget."""
    answer = answer_for({"tasks": [{"name": f"t{i:03d}", "wcet_ms": 1, "period_ms": first_period + i,
                                    "blocking_ms": 0} for i in range(MAX_TASKS)]})

    assert answer["feasible"] is feasible
    assert all(task["reason"].startswith(("meets:", "passes its deadline:")) for task in answer["tasks"])
    if feasible:
        assert answer["tasks"][-1]["response_ms"] == 256.0


def test_the_global_bound_stops_at_its_budget_too() -> None:
    """The global bound's equation at N = 1 under the slow set's t000: R = 0.5 + ceil((R + 1)/1) x 0.9999999
    gains about one job a step, for millions of steps. At 2 operations a step, a budget of 1,000 stops
    it after 500. (At N = 2 it converges at once: t000 loads half of each worker.)"""
    fast = PeriodicTask(name="fast", wcet_ms=0.9999999, period_ms=1, deadline_ms=1, section_ms=0.9999999)
    day = PeriodicTask(name="day", wcet_ms=0.5, period_ms=86_400_000, deadline_ms=86_400_000, section_ms=0.5)

    response = global_response(day, [(fast, 0.9999999)], 0.0, 1, budget=1_000)

    assert response.ms is None and response.work <= 1_000
    assert "budget" in response.reason and "ran out after 500 steps" in response.reason


# --- times too short to divide by ----------------------------------------------------------


def test_a_period_too_short_to_divide_by_counts_as_unbounded_jobs_not_an_error() -> None:
    """5e-324 passes `gt=0`; 1 / 5e-324 is inf and ceil(inf) raised (a 500). The analysis, called with
    such a task without the request's validation, answers not proven instead."""
    tiny = PeriodicTask(name="a", wcet_ms=5e-324, period_ms=5e-324, deadline_ms=5e-324, section_ms=5e-324)
    day = PeriodicTask(name="b", wcet_ms=1, period_ms=86_400_000, deadline_ms=86_400_000, section_ms=1)

    answer = analyse([tiny, day], policy="rate-monotonic", workers=1)

    assert jobs_released(1.0, 5e-324) == math.inf
    assert answer["tasks"][1]["name"] == "b" and answer["tasks"][1]["meets"] is False
    assert answer["tasks"][1]["reason"].startswith("not proven: the iteration is no finite number (inf)")


@pytest.mark.parametrize("field", ["period_ms", "wcet_ms", "deadline_ms", "section_ms"])
def test_a_time_under_a_microsecond_is_refused_naming_the_field(field: str) -> None:
    task = {"name": "t", "wcet_ms": 1, "period_ms": 10} | {field: 5e-324}

    with pytest.raises(ValidationError) as refused:
        TaskSet.model_validate({"tasks": [task]})
    assert f"tasks.0.{field}\n  Value error, 4.94066e-324 ms is shorter than the least the analysis takes, " \
           "0.001 ms" in str(refused.value)
    assert TaskSet.model_validate({"tasks": [{"name": "t", "wcet_ms": 0.001, "period_ms": 0.001}]})


# --- costs from a model's profile -----------------------------------------------------------

PROFILED = {"ref": "m@v1", "name": "m", "version": "v1", "profile_status": "ready", "static_profile": {},
            "profile": {"source": "measured", "device": "cpu", "points": [
                {"batch_size": 64, "latency_ms": 5.0, "p99_ms": 6.0, "rows_per_second": 12_800.0},
                {"batch_size": 128, "latency_ms": 8.0, "p99_ms": 10.0, "rows_per_second": 16_000.0}]}}


def cost_of(record: dict[str, Any] = PROFILED, **kwargs: Any) -> Any:
    options = {"task": "t", "rows": 1000, "batch_size": 128, "chunk_size": 512, "item_overhead_ms": 2.0,
               "device": None} | kwargs
    return model_cost(ModelRecord.of(record), **options)


def test_a_model_task_costs_its_mini_batches_at_p99_and_each_queue_item_its_overhead() -> None:
    """1,000 rows in chunks of 512: 512 and 488 rows; in batches of 128: 4, then 3 and one of 104.
    P99: 10 ms at 128 rows, 6 + (10 - 6) * 40/64 = 8.5 ms at 104. Compute 7 * 10 + 8.5 = 78.5 ms;
    3 queue items (2 chunks, the merge) at 2 ms: C = 84.5. Longest section: 4 * 10 + 2 = 42 ms."""
    cost = cost_of()

    assert cost.wcet_ms == pytest.approx(84.5)
    assert cost.section_ms == pytest.approx(42.0)
    assert cost.detail["batches"] == 8 and cost.detail["chunks"] == 2
    assert cost.wcet_source == "8 mini-batches x p99 of the profile measured on cpu, + 3 queue items x 2 ms overhead"


def test_a_profile_without_p99_falls_back_to_its_median_and_says_so() -> None:
    old = {**PROFILED, "profile": {**PROFILED["profile"], "points": [
        {key: value for key, value in point.items() if key != "p99_ms"} for point in PROFILED["profile"]["points"]]}}

    cost = cost_of(old, rows=128, chunk_size=128)

    assert cost.wcet_ms == pytest.approx(8.0 + 2 * 2.0)
    assert "median (profile has no p99)" in cost.wcet_source


@pytest.mark.parametrize(("record", "says"), [
    ({**PROFILED, "profile": None}, "has no measured profile; register it again with profile_mode: full"),
    ({**PROFILED, "profile": {**PROFILED["profile"], "source": "observed"}}, "only an observed profile"),
    ({**PROFILED, "profile": None, "profile_status": "pending"}, "still being profiled"),
    ({**PROFILED, "profile": None, "profile_status": "failed", "profile_error": "out of memory"},
     "(profiling failed: out of memory)"),
    ({**PROFILED, "static_profile": {"sequence_axis": {"input": "ids", "axis": 1}}}, "is a token model"),
])
def test_a_model_without_a_usable_measured_profile_is_refused_saying_what_to_do(
        record: dict[str, Any], says: str) -> None:
    with pytest.raises(Conflict, match="task 't'") as refused:
        cost_of(record)
    assert says in refused.value.message


def test_a_device_kind_other_than_the_profiles_is_refused_and_the_same_kind_accepted() -> None:
    on_gpu = {**PROFILED, "profile": {**PROFILED["profile"], "device": "gpu:0"}}

    with pytest.raises(Conflict, match="runs on cpu, but model m@v1 was profiled on gpu:0"):
        cost_of(on_gpu, device="cpu")
    assert cost_of(on_gpu, device="cuda").wcet_ms == cost_of(on_gpu, device="gpu:1").wcet_ms == cost_of(on_gpu).wcet_ms


def test_a_chunk_size_that_makes_too_many_chunks_is_refused() -> None:
    with pytest.raises(Conflict, match="more than 100,000 chunks"):
        cost_of(rows=200_001, chunk_size=1, batch_size=1)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "says"), [
    ({"name": "t", "wcet_ms": 1, "period_ms": 0}, "period_ms\n  Input should be greater than 0"),
    ({"name": "t", "wcet_ms": 0, "period_ms": 10}, "wcet_ms\n  Input should be greater than 0"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "deadline_ms": 12}, "deadline_ms 12 is past its period_ms 10"),
    ({"name": "t", "period_ms": 10}, "task 't' has no wcet_ms"),
    ({"name": "t", "model": "m", "period_ms": 10}, "task 't' has no rows"),
    ({"name": "t", "wcet_ms": 1, "model": "m", "rows": 8, "period_ms": 10}, "gives both wcet_ms and model/rows"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "section_ms": 2}, "section_ms 2 is longer than its wcet_ms 1"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "device": "cpu"}, "device only apply to a task given as model"),
    ({"name": "t", "model": "m", "rows": 8, "period_ms": 10, "device": "tpu"}, "device 'tpu' is not a device kind"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "blocking_ms": -1}, "greater than or equal to 0"),
    ({"name": "t", "wcet_ms": 1, "period_ms": math.nan}, "period_ms\n  Input should be a finite number"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "blocking_ms": math.nan}, "blocking_ms\n  Input should be a finite"),
    ({"name": "t", "wcet_ms": "1", "period_ms": 10}, "Input should be a valid number"),
    ({"name": "no spaces", "wcet_ms": 1, "period_ms": 10}, "task name 'no spaces' must be"),
    ({"name": "t", "wcet_ms": 1, "period_ms": 10, "priority": 3}, "Extra inputs are not permitted"),
])
def test_an_invalid_task_is_refused_saying_what_is_wrong(task: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        TaskSet.model_validate({"tasks": [task]})
    assert says in str(refused.value)


def test_a_task_set_needs_tasks_with_unique_names_and_a_known_policy() -> None:
    task = {"name": "t", "wcet_ms": 1, "period_ms": 10}
    for body, says in (({"tasks": []}, "at least 1 item"), ({"tasks": [task, task]}, "'t' appear more than once"),
                       ({"tasks": [task], "policy": "edf"}, "'rate-monotonic' or 'deadline-monotonic'"),
                       ({"tasks": [task], "workers": 0}, "greater than or equal to 1")):
        with pytest.raises(ValidationError) as refused:
            TaskSet.model_validate(body)
        assert says in str(refused.value), body


def test_the_defaults_are_rate_monotonic_one_worker_and_the_measured_overhead() -> None:
    task_set = TaskSet.model_validate({"tasks": [{"name": "t", "wcet_ms": 1, "period_ms": 10}]})

    assert (task_set.policy, task_set.workers, task_set.item_overhead_ms) == (
        "rate-monotonic", 1, DEFAULT_ITEM_OVERHEAD_MS)
    assert given_task(task_set.tasks[0]).deadline_ms == 10
