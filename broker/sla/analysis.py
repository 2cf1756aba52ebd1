"""Schedulability of periodic task sets under fixed priorities: the Liu-Layland bound and response times.

Pure functions over `sla_task_sets.PeriodicTask` (no Redis, no clock). Priorities
follow the policy: rate-monotonic puts shorter periods first, deadline-monotonic
shorter deadlines; ties go by task name, so an answer never depends on the
order the tasks were written in.

One worker is the classic uniprocessor analysis: R = C + B + sum over
higher-priority tasks j of ceil(R / Tj) * Cj, iterated from C + B to a fixed
point or until it passes D. SITS switches work only between queue items, so
B defaults to the longest non-preemptible section of lower-priority work.
Several workers share one queue, so a task's jobs run on any of them (its
chunks even side by side): the analysis is then a sufficient global test,
not a partition. docs/sla.md derives both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from broker.sla.task_sets import PeriodicTask

Policy = Literal["rate-monotonic", "deadline-monotonic"]

MAX_STEPS = 10_000
"""Most fixed-point steps per task: each adds at least one higher-priority job, so only a set of
wildly different periods comes near it; past it the task is reported as not proven."""

WORK_BUDGET = 1_000_000
"""Most operations (one per higher-priority task in a step, plus one a step) in one request's analysis.

MAX_STEPS alone bounds a task, not a set: each of n tasks may take 10,000 steps over up to n - 1
others, 10,000 x n^2 / 2 operations, a minute of CPU for one 256-task body. A real set needs far
fewer: 256 tasks at U = 0.75, up to 231 steps each, take about 240,000. Once the budget is spent the
tasks not yet proven are reported not proven; all of it took about 0.25 s of one core of a 2-core
development machine.
"""

_TOLERANCE = 1e-9


def priority_order(tasks: Sequence[PeriodicTask], policy: Policy) -> list[PeriodicTask]:
    """The tasks, most urgent first: by period (rate-monotonic) or deadline (deadline-monotonic), then name."""
    if policy == "rate-monotonic":
        return sorted(tasks, key=lambda task: (task.period_ms, task.name))
    return sorted(tasks, key=lambda task: (task.deadline_ms, task.name))


def liu_layland_bound(n: int) -> float:
    """n(2^(1/n) - 1): the utilisation up to which rate-monotonic meets every implicit deadline."""
    return n * (2 ** (1 / n) - 1)


def jobs_released(window_ms: float, period_ms: float) -> float:
    """ceil(window / period): jobs of a task released in a window [0, window) that starts with one.

    A quotient a rounding error above a whole number counts as that number: the job released exactly
    at the window's end is not in it. A quotient that is not a finite number (a period so short that
    it overflows) counts as infinitely many jobs: the safe side, where math.ceil would raise.
    """
    quotient = window_ms / period_ms
    if not math.isfinite(quotient):
        return math.inf
    return math.ceil(quotient - _TOLERANCE * max(1.0, quotient))


@dataclass(frozen=True)
class Blocking:
    """A task's blocking term B and where it came from."""

    ms: float
    source: str


def blocking_terms(ordered: Sequence[PeriodicTask], workers: int) -> list[Blocking]:
    """B of each task in `ordered` (most urgent first): the one given, else from lower-priority sections.

    One worker: the longest section among lower-priority tasks (0 for the lowest), since a worker
    runs a queue item to its end once started, and never starts lower work while higher work waits.
    N workers: N such sections may be running when a job is released, and N - 1 more may start on
    workers that fall idle while all of its ready work runs, before its last step (a job's final
    merge) is ready: (2N - 1) times the longest.
    """
    terms = []
    for index, task in enumerate(ordered):
        if task.blocking_ms is not None:
            terms.append(Blocking(task.blocking_ms, "given"))
            continue
        lower = ordered[index + 1:]
        if not lower:
            terms.append(Blocking(0.0, "none: no lower-priority task"))
            continue
        longest = max(lower, key=lambda other: (other.section_ms, other.name))
        section = f"task '{longest.name}' ({_ms(longest.section_ms)} ms)"
        if workers == 1:
            terms.append(Blocking(longest.section_ms, f"the longest lower-priority section: {section}"))
        else:
            count = 2 * workers - 1
            terms.append(Blocking(count * longest.section_ms,
                                  f"{count} x the longest lower-priority section, {section}: {workers} running "
                                  f"at its release and {workers - 1} more before its last step"))
    return terms


@dataclass(frozen=True)
class Response:
    """A task's response-time bound, or None with the reason it has none."""

    ms: float | None
    steps: int
    reason: str
    work: int = 0
    """Operations spent, counted against the request's WORK_BUDGET."""


def uniprocessor_response(task: PeriodicTask, higher: Sequence[PeriodicTask], blocking_ms: float,
                          budget: int = WORK_BUDGET) -> Response:
    """R = C + B + sum ceil(R / Tj) Cj over `higher`, iterated to a fixed point or past D.

    Each step costs len(higher) + 1 operations; past `budget` of them the task is not proven, so that
    the caller can bound a whole set's work (WORK_BUDGET).
    """
    cost = len(higher) + 1
    response = task.wcet_ms + blocking_ms + sum(other.wcet_ms for other in higher)
    for step in range(1, MAX_STEPS + 1):
        if (beyond := _beyond(response, task, "iteration", step, cost)) is not None:
            return beyond
        if step * cost > budget:
            return Response(None, step - 1, _out_of_budget(f"after {step - 1:,} steps"), (step - 1) * cost)
        following = task.wcet_ms + blocking_ms + sum(jobs_released(response, other.period_ms) * other.wcet_ms
                                                     for other in higher)
        if following <= response * (1 + _TOLERANCE):
            return Response(response, step, _met(response, task, step), step * cost)
        response = following
    return Response(None, MAX_STEPS, f"not proven: no fixed point within {MAX_STEPS:,} steps", MAX_STEPS * cost)


def global_response(task: PeriodicTask, higher: Sequence[tuple[PeriodicTask, float]], blocking_ms: float,
                    workers: int, budget: int = WORK_BUDGET) -> Response:
    """A sufficient bound on `workers` identical workers sharing the queue (docs/sla.md, "Several workers").

    While the job is unfinished, either one of its items runs (at most C in all) or every worker is
    busy with other work: blocking, or higher-priority jobs, of which those of task j released in the
    window or up to Rj before it, at most ceil((R + Rj) / Tj). So R = C + (B + sum of those) / N.
    `higher` pairs each higher-priority task with its own bound Rj. `budget` as for one worker.
    """
    cost = len(higher) + 1
    response = task.wcet_ms + blocking_ms / workers
    for step in range(1, MAX_STEPS + 1):
        if (beyond := _beyond(response, task, "bound", step, cost)) is not None:
            return beyond
        if step * cost > budget:
            return Response(None, step - 1, _out_of_budget(f"after {step - 1:,} steps"), (step - 1) * cost)
        interference = sum(jobs_released(response + bound, other.period_ms) * other.wcet_ms
                           for other, bound in higher)
        following = task.wcet_ms + (blocking_ms + interference) / workers
        if following <= response * (1 + _TOLERANCE):
            return Response(response, step, _met(response, task, step), step * cost)
        response = following
    return Response(None, MAX_STEPS, f"not proven: no fixed point within {MAX_STEPS:,} steps", MAX_STEPS * cost)


def _beyond(response: float, task: PeriodicTask, what: str, step: int, cost: int) -> Response | None:
    """The answer when R has passed D, or is no finite number at all (NaN would compare false both
    ways and iterate to the end); None while the iteration may go on."""
    if not math.isfinite(response):
        return Response(None, step, f"not proven: the {what} is no finite number ({response}); "
                                    "check the task set's times", (step - 1) * cost)
    if response > task.deadline_ms * (1 + _TOLERANCE):
        return Response(None, step, f"passes its deadline: the {what} reached {_ms(response)} ms "
                                    f"> D = {_ms(task.deadline_ms)} ms", (step - 1) * cost)
    return None


def _out_of_budget(when: str) -> str:
    return (f"not proven: the analysis's budget of {WORK_BUDGET:,} operations per request ran out {when}; "
            "ask about fewer tasks, or periods less far apart, in one request")


def bound_test(ordered: Sequence[PeriodicTask], blocking: Sequence[Blocking], policy: Policy,
               workers: int) -> dict[str, Any]:
    """What the Liu-Layland bound says: `feasible` or `inconclusive`, and why.

    With blocking, task i must pass U(1..i) + Bi/Ti <= i(2^(1/i) - 1) for every i (the bound of
    Sha, Rajkumar and Lehoczky); without it this is U <= n(2^(1/n) - 1). With deadlines shorter than
    periods, densities C/D replace utilisations, which holds when priorities follow deadlines.
    """
    n = len(ordered)
    utilisation = sum(task.wcet_ms / task.period_ms for task in ordered)
    answer: dict[str, Any] = {"test": "liu-layland", "value": round(liu_layland_bound(n), 6),
                              "utilisation": round(utilisation, 6)}
    over = f"; U = {utilisation:.3f} > {workers}: no schedule meets every deadline" if utilisation > workers else ""
    if workers > 1:
        return answer | {"verdict": "inconclusive",
                         "reason": f"the bound is a one-worker test; on {workers} workers sharing one queue the "
                                   f"response-time bound decides{over}"}
    shorter = any(task.deadline_ms < task.period_ms for task in ordered)
    if shorter and [task.deadline_ms for task in ordered] != sorted(task.deadline_ms for task in ordered):
        return answer | {"verdict": "inconclusive",
                         "reason": "the bound does not apply: some deadlines are shorter than their periods and "
                                   f"{policy} priorities do not follow the deadlines{over}"}
    span, load = ("D", "density") if shorter else ("T", "utilisation")
    answer["load"] = round(sum(task.wcet_ms / (task.deadline_ms if shorter else task.period_ms)
                               for task in ordered), 6)
    total = 0.0
    for index, (task, term) in enumerate(zip(ordered, blocking, strict=True), start=1):
        total += task.wcet_ms / (task.deadline_ms if shorter else task.period_ms)
        with_blocking = total + term.ms / (task.deadline_ms if shorter else task.period_ms)
        if with_blocking > liu_layland_bound(index) * (1 + _TOLERANCE):
            blocked = f" + B/{span} of '{task.name}'" if term.ms else ""
            return answer | {"verdict": "inconclusive",
                             "reason": f"{load} of the {index} most urgent tasks{blocked} is {with_blocking:.3f} > "
                                       f"{index}(2^(1/{index}) - 1) = {liu_layland_bound(index):.3f}: the bound "
                                       f"cannot tell, the response-time analysis decides{over}"}
    blocked = " with blocking" if any(term.ms for term in blocking) else ""
    return answer | {"verdict": "feasible",
                     "reason": f"{load}{blocked} is within n(2^(1/n) - 1) = {liu_layland_bound(n):.3f} for n = {n}"}


def analyse(tasks: Sequence[PeriodicTask], *, policy: Policy, workers: int) -> dict[str, Any]:
    """The whole answer: priorities, the bound's verdict, each task's response time, and `feasible`."""
    ordered = priority_order(tasks, policy)
    blocking = blocking_terms(ordered, workers)
    responses: list[Response] = []
    budget = WORK_BUDGET
    for index, (task, term) in enumerate(zip(ordered, blocking, strict=True)):
        if budget <= index:  # its first step alone would overrun: not started
            responses.append(Response(None, 0, _out_of_budget("before this task")))
            continue
        if workers == 1:
            responses.append(uniprocessor_response(task, ordered[:index], term.ms, budget))
            budget -= responses[-1].work
            continue
        unbounded = next((other for other, done in zip(ordered[:index], responses, strict=True)
                          if done.ms is None), None)
        if unbounded is not None:
            responses.append(Response(None, 0, f"not proven: higher-priority task '{unbounded.name}' has no "
                                               "response-time bound"))
            continue
        higher = [(other, done.ms) for other, done in zip(ordered[:index], responses, strict=True)
                  if done.ms is not None]
        responses.append(global_response(task, higher, term.ms, workers, budget))
        budget -= responses[-1].work
    rows = [_task_answer(rank, task, term, response)
            for rank, (task, term, response) in enumerate(zip(ordered, blocking, responses, strict=True), start=1)]
    missing = [row["name"] for row in rows if not row["meets"]]
    return {
        "policy": policy,
        "workers": workers,
        "feasible": not missing,
        "verdict": "feasible: every task meets its deadline" if not missing else
                   f"not feasible: {len(missing)} of {len(rows)} tasks may miss their deadlines "
                   f"({', '.join(missing)})",
        "analysis": "response-time analysis on one worker (R = C + B + sum ceil(R/Tj) Cj)" if workers == 1 else
                    f"sufficient global response-time bound on {workers} workers sharing one queue "
                    "(R = C + (B + sum ceil((R + Rj)/Tj) Cj) / N)",
        "utilisation": round(sum(task.wcet_ms / task.period_ms for task in ordered), 6),
        "bound": bound_test(ordered, blocking, policy, workers),
        "tasks": rows,
    }


def _task_answer(rank: int, task: PeriodicTask, term: Blocking, response: Response) -> dict[str, Any]:
    meets = response.ms is not None
    row: dict[str, Any] = {
        "name": task.name, "priority": rank,
        "wcet_ms": round(task.wcet_ms, 3), "wcet_source": task.wcet_source,
        "period_ms": task.period_ms, "deadline_ms": task.deadline_ms,
        "section_ms": round(task.section_ms, 3), "section_source": task.section_source,
        "blocking_ms": round(term.ms, 3), "blocking_source": term.source,
        "response_ms": round(response.ms, 3) if response.ms is not None else None,
        "slack_ms": round(task.deadline_ms - response.ms, 3) if response.ms is not None else None,
        "meets": meets, "reason": response.reason,
    }
    if task.detail:
        row["derived"] = task.detail
    return row


def _met(response: float, task: PeriodicTask, step: int) -> str:
    return (f"meets: R = {_ms(response)} ms <= D = {_ms(task.deadline_ms)} ms "
            f"(fixed point after {step} step{'s' if step != 1 else ''})")


def _ms(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")
