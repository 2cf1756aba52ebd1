"""Staggering a window's runs: a release offset and a slot cap per schedule that lower the fleet's peak
while every run still finishes before its deadline.

Pure: the runs, the fleet's stream slots and the models' speeds come in (`sits_api/schedules/planner.py`
reads them from Redis); nothing here reads a clock. A run is a fluid of slot seconds (its rows at its
model's seconds per row on one slot, plus each chunk's fixed cost, as admission counts them) that runs
on at most its cap's slots at once. The plan is the smallest peak of slots in use for which each
schedule, in order of its earliest deadline, finds the narrowest cap and the earliest offset that fit
under that peak and end before every deadline with `margin` in hand. One offset and one cap serve all of
a schedule's runs in the window, for they are stored on the schedule. docs/schedules.md, "Planning a
window", says how to read the answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from broker.errors import BadInput
from broker.jobs.finish_prediction import work_seconds

GRID_STEPS = 720
"""Time steps of the planning grid over the window's span (a step is at least `MIN_STEP` seconds)."""
MIN_STEP = 1.0


@dataclass(frozen=True)
class PlanRun:
    """One run of a schedule in the window: when its slot falls, by when it must be done, what it costs."""

    member: str
    """The schedule (`tenant|name`): the runs of one schedule share its offset and cap."""
    slot: float
    deadline_at: float
    rows: int
    chunks: int
    seconds_per_row: float
    """On one stream slot, calibrated as admission calibrates it."""

    @property
    def slot_seconds(self) -> float:
        """Slot seconds of its whole work."""
        return work_seconds(self.rows, seconds_per_row=self.seconds_per_row, chunks=self.chunks)

    def seconds_on(self, slots: int) -> float:
        """How long it runs on `slots` slots (it can use no more than its chunks)."""
        return self.slot_seconds / max(1, min(slots, self.chunks))


@dataclass(frozen=True)
class Release:
    """What the plan stores on a schedule: how long after each slot its release is due, and its runs' cap."""

    offset: float
    slots: int | None
    """The most stream slots its runs' chunks hold at once (None: as many as are free)."""


@dataclass(frozen=True)
class Load:
    """How the fleet's load runs under some releases: its peak and when each run ends."""

    peak_slots: int
    peak_rows_per_second: float
    finishes: Mapping[tuple[str, float], float]
    """(member, slot) -> when that run ends."""
    starts: Mapping[tuple[str, float], float]

    def late(self, runs: Iterable[PlanRun]) -> list[PlanRun]:
        """The runs that end after their deadline (or never)."""
        return [run for run in runs if self.finishes.get((run.member, run.slot), math.inf) > run.deadline_at]


PLAN_WORK = 10_000_000
"""The most work one plan may do, in grid cells and simulation steps looked at (a second or two of CPU on the
2-core reference machine): a plan is worked out inside an API request, so a window of many runs on a large
fleet is refused rather than allowed to hold a server process for long."""


CALL_COST = 5_000
"""What one pass of numpy over the grid costs besides its cells, in the same units (measured: a pass over a
grid of 720 cells takes about as long as 5,000 cells' work, most of it the calls themselves)."""


class PlanTooLarge(BadInput):
    """A plan would need more than its work budget."""

    code = "plan_too_large"


@dataclass
class WorkBudget:
    """Work left to one plan (`PLAN_WORK`): each step spends what it looks at; PlanTooLarge once it runs out."""

    left: int = PLAN_WORK

    def spend(self, cells: int) -> None:
        self.left -= cells
        if self.left < 0:
            raise PlanTooLarge("this plan needs more work than one request may take: plan a shorter window, fewer "
                               "schedules, or fewer slots (slots=N)")


def unstaggered(runs: Sequence[PlanRun]) -> dict[str, Release]:
    """Every schedule released at its slot, without a cap: what a window looks like before a plan."""
    return {run.member: Release(0.0, None) for run in runs}


def simulate(runs: Sequence[PlanRun], releases: Mapping[str, Release], *, fleet_slots: int,
             step: float | None = None, budget: WorkBudget | None = None) -> Load:
    """The fleet's load when each run is released at its slot plus its offset and holds at most its cap's
    slots: at each step the free slots go to the released runs by deadline (the order their chunks wait in),
    each taking what its cap and its chunks left allow."""
    if not runs:
        return Load(0, 0.0, {}, {})
    step = step or grid_step(runs)
    left = {(run.member, run.slot): run.slot_seconds for run in runs}
    chunk_seconds = {(run.member, run.slot): run.slot_seconds / max(1, run.chunks) for run in runs}
    ordered = sorted(runs, key=lambda run: (run.deadline_at, run.slot, run.member))
    released = {(run.member, run.slot): run.slot + releases[run.member].offset for run in runs}
    finishes: dict[tuple[str, float], float] = {}
    starts: dict[tuple[str, float], float] = {}
    now = min(released.values())
    peak_slots, peak_rate = 0, 0.0
    budget = budget or WorkBudget()
    while len(finishes) < len(runs):
        budget.spend(len(ordered) * 10)
        free, in_use, rate = fleet_slots, 0, 0.0
        for run in ordered:
            key = (run.member, run.slot)
            if key in finishes or released[key] > now:
                continue
            chunks_left = math.ceil(left[key] / chunk_seconds[key] - 1e-9)
            cap = releases[run.member].slots or fleet_slots
            taken = min(free, cap, chunks_left)
            if taken <= 0:
                continue
            starts.setdefault(key, now)
            free -= taken
            in_use += taken
            rate += taken / run.seconds_per_row
            work = taken * step
            if work >= left[key]:
                finishes[key] = now + left[key] / taken
                left[key] = 0.0
            else:
                left[key] -= work
        peak_slots, peak_rate = max(peak_slots, in_use), max(peak_rate, rate)
        waiting = [released[key] for key in released if key not in finishes and released[key] > now]
        if in_use == 0 and waiting:
            now = min(waiting)
        elif in_use == 0:
            break  # (no slot at all: what is left never ends)
        else:
            now += step
    return Load(peak_slots, round(peak_rate, 1), finishes, starts)


def grid_step(runs: Sequence[PlanRun]) -> float:
    """The planning grid's step: the span from the first slot to the last deadline over `GRID_STEPS`."""
    span = max(run.deadline_at for run in runs) - min(run.slot for run in runs)
    return max(MIN_STEP, span / GRID_STEPS)


def stagger(runs: Sequence[PlanRun], *, fleet_slots: int, margin: float = 0.1,
            budget: WorkBudget | None = None) -> dict[str, Release] | None:
    """The releases of the lowest peak under which every schedule's runs fit before their deadlines with
    `margin` (a share of each run's time from its slot to its deadline) in hand, checked by `simulate`;
    None when not even the whole fleet fits them. The peak is found by halving, so a plan takes about
    log2(slots) placements, within `budget` (PlanTooLarge past it)."""
    if not runs:
        return {}
    step = grid_step(runs)
    budget = budget or WorkBudget()

    def fits(peak: int) -> dict[str, Release] | None:
        releases = _place(runs, peak=peak, step=step, margin=margin, budget=budget)
        if releases is None or simulate(runs, releases, fleet_slots=fleet_slots, step=step,
                                        budget=budget).late(runs):
            return None
        return releases

    best = fits(fleet_slots)
    low, high = 1, fleet_slots  # (a binary search: a peak that fits is taken to leave a higher one fitting)
    while best is not None and low < high:
        middle = (low + high) // 2
        found = fits(middle)
        if found is None:
            low = middle + 1
        else:
            best, high = found, middle
    return best


def _place(runs: Sequence[PlanRun], *, peak: int, step: float, margin: float,
           budget: WorkBudget) -> dict[str, Release] | None:
    """Each schedule's offset and cap on a grid of slots in use, none above `peak`: the schedules by their
    earliest deadline, each the narrowest cap whose runs all fit at one offset, at the earliest such."""
    origin = min(run.slot for run in runs)
    size = math.ceil((max(run.deadline_at for run in runs) - origin) / step) + 2
    used = np.zeros(size, dtype=np.int64)
    by_member: dict[str, list[PlanRun]] = {}
    for run in runs:
        by_member.setdefault(run.member, []).append(run)
    order = sorted(by_member, key=lambda member: (min(run.deadline_at for run in by_member[member]), member))
    releases: dict[str, Release] = {}
    for member in order:
        mine = by_member[member]
        placed = _fit(mine, used, origin=origin, peak=peak, step=step, margin=margin, budget=budget)
        if placed is None:
            return None
        offset_steps, cap = placed
        for run in mine:
            first = _index(run.slot - origin, step) + offset_steps
            used[first:first + _steps(run.seconds_on(cap), step)] += min(cap, run.chunks)
        releases[member] = Release(round(offset_steps * step, 3), cap)
    return releases


def _fit(mine: Sequence[PlanRun], used: np.ndarray, *, origin: float, peak: int, step: float, margin: float,
         budget: WorkBudget) -> tuple[int, int] | None:
    """(offset in steps, cap) of the narrowest cap at which every run of one schedule fits at one offset, the
    earliest such offset. Caps narrower than any run's deadline allows are not tried; at each cap a run's
    possible offsets are tested at once: an offset fits where no cell of its span is too full for its width."""
    firsts = [_index(run.slot - origin, step) for run in mine]
    ends = [_index(run.deadline_at - margin * (run.deadline_at - run.slot) - origin, step, up=False) for run in mine]
    widest = min(peak, max(run.chunks for run in mine))
    narrowest = max(math.ceil(run.slot_seconds / max((end - first) * step, 1e-9) - 1e-9)
                    for run, first, end in zip(mine, firsts, ends, strict=True))
    for cap in range(max(1, narrowest), widest + 1):
        lengths = [_steps(run.seconds_on(cap), step) for run in mine]
        latest = min(end - length - first for first, end, length in zip(firsts, ends, lengths, strict=True))
        if latest < 0:
            continue
        fits = np.ones(latest + 1, dtype=bool)
        for run, first, length in zip(mine, firsts, lengths, strict=True):
            budget.spend(len(used) + CALL_COST)
            blocked = np.concatenate(([0], np.cumsum(used + min(cap, run.chunks) > peak)))
            starts = np.arange(first, first + latest + 1)
            fits &= blocked[starts + length] == blocked[starts]
            if not fits.any():
                break
        found = np.flatnonzero(fits)
        if found.size:
            return int(found[0]), cap
    return None


def _index(seconds: float, step: float, *, up: bool = True) -> int:
    cells = seconds / step
    return math.ceil(cells - 1e-9) if up else math.floor(cells + 1e-9)


def _steps(seconds: float, step: float) -> int:
    return max(1, math.ceil(seconds / step - 1e-9))
