"""When would a job finish? The pure arithmetic behind deadline admission and a job's `predicted_finish`.

SITS serves waiting work in queue-score order (`broker/queueing/scoring.py`), one chunk per stream slot at a
time, and a chunk runs to its end once started. So a job's finish is predicted by list scheduling
over the fleet's slots: jobs in score order, each chunk to the slot that frees first. A job with
fewer chunks than slots leaves slots to the jobs behind it, which then run side by side with it, as
they do. Each job's time is its remaining rows at its model's measured seconds per row on one slot
(at the job's batch size), plus a fixed cost per chunk (lease, part file, fsync, ack), spread evenly
over its chunks. Chunks of later work that are running hold their slots for `blocking_seconds` (a
chunk runs to its end once started), and each job ends `job_latency_seconds` after its last chunk.
A job of more chunks than `EXACT_CHUNKS` is spread over the slots as a fluid (the chunks are then
small beside the job, and placing each would cost time at every submit).

Slots of one worker share its cores (or its device): a chunk runs slower beside a heavy neighbour.
Where the fleet knows by how much (`Fleet.contention`, learnt per pair of models from what ran beside
each chunk), a chunk's time is scaled by the pair it starts in: its model and the models running on the
other slots of its worker at that moment.

Nothing here reads Redis or the clock: `broker/sla/figures.py` gathers the figures, and `broker/sla/admission.py`
passes them and `now`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CHUNK_OVERHEAD_SECONDS = 0.005
"""A chunk's fixed cost besides its rows (lease, input read set-up, part file fsync, ack): about 4 ms on
the 2-core reference machine (docs/benchmarks.md), rounded up."""


@dataclass(frozen=True)
class Work:
    """One job's remaining work as the predictor sees it."""

    job_id: str
    score: float
    """Its chunks' queue score: lower is served first."""
    seconds: float
    """Slot seconds its remaining rows need (on one stream slot)."""
    deadline_at: float | None = None
    chunks: int = 1
    """Its remaining chunks: the most slots it can use at once."""
    model: str = ""
    """Its model version, for the slow-down beside other models (`Fleet.contention`); '' for none."""
    chunk_started_at: float | None = None
    """When its latest chunk began to run (a running job's); None where not known."""
    chunk_seconds: float | None = None
    """Slot seconds of one whole chunk of it (its last may be shorter); None: `seconds` over `chunks`."""
    max_slots: int | None = None
    """Its slot cap (`max_slots`): the most of its chunks that run at once; None: as many as are free."""


@dataclass(frozen=True)
class Fleet:
    """What runs the work: how many stream slots, how long a running chunk of later work holds one (and on
    how many slots such chunks run), and the latency each job has besides its chunks."""

    slots: int
    blocking_seconds: float = 0.0
    blocked_slots: int = 1
    job_latency_seconds: float = 0.0
    """From submit to its first chunk's lease and from its last ack to its finish (the final merge)."""
    slots_per_worker: int = 1
    """Slots that share one worker's cores or device: slots `i` and `j` are one worker's when
    `i // slots_per_worker == j // slots_per_worker`."""
    contention: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(model, neighbour model) -> how much longer the model's chunks run beside that neighbour than its
    time says (its calibration's average over whatever it ran beside); a pair not in it: 1."""
    running_models: Sequence[str] = ()
    """The models whose chunks run now, slot by slot as far as known: what the first chunks planned run
    beside (a slot that frees at the moment a chunk starts is taken to go on with the model it ran)."""

    def slowdown(self, model: str, neighbours: Sequence[str]) -> float:
        """The factor of a chunk of `model` started beside `neighbours` (the models running on its worker's
        other slots; '' where one runs work of an unknown model): the mean over them of the pair's."""
        known = [self.contention.get((model, other), 1.0) for other in neighbours if other]
        return sum(known) / len(known) if model and known else 1.0


@dataclass(frozen=True)
class Verdict:
    """What admission decides for a job with a deadline."""

    predicted_finish: float
    feasible: bool
    earliest_deadline: float
    """The earliest deadline that would be accepted now (`predicted_finish` with the margin, where the
    job's own deadline does not move it ahead of other work)."""
    reason: str = ""
    """Why it is infeasible: its own finish, another job it would push past its deadline, or no worker."""
    tipped_deadline: float | None = None
    """The deadline of the accepted job this one would push past it, when that is the reason."""


def work_seconds(rows: int, *, seconds_per_row: float, chunks: int) -> float:
    """Device seconds for `rows` rows in `chunks` chunks at `seconds_per_row`."""
    return max(0, rows) * seconds_per_row + max(0, chunks) * CHUNK_OVERHEAD_SECONDS


EXACT_CHUNKS = 64
"""Jobs of up to this many remaining chunks are placed chunk by chunk; larger ones as a fluid."""


def finishes(ordered: Sequence[Work], fleet: Fleet, *, now: float) -> list[float]:
    """The predicted finish of each job of `ordered` (already in score order), its chunks placed on the
    `fleet.slots` slots as each frees (list scheduling), each chunk's time scaled by what runs beside it
    as it starts (`Fleet.slowdown`). Infinite without a slot."""
    if fleet.slots < 1:
        return [math.inf] * len(ordered)
    slots = _Slots(fleet, now)
    out = []
    for work in ordered:
        chunks = max(1, work.chunks)
        lanes = min(chunks, work.max_slots or chunks)
        if chunks <= EXACT_CHUNKS:
            each, finish = work.seconds / chunks, now
            held: list[tuple[float, int]] = []  # (end, slot) of each slot a capped job holds
            for _ in range(chunks):
                if len(held) < lanes:
                    end, slot = slots.place(work.model, each)
                else:  # (its next chunk goes on as one of its own ends, on that slot, as a worker's drain does)
                    _, slot = heapq.heappop(held)
                    end = slots.place_on(slot, work.model, each)
                heapq.heappush(held, (end, slot))
                finish = max(finish, end)
        else:
            finish = slots.pour(work.model, work.seconds, most=lanes)
        out.append(finish + fleet.job_latency_seconds)
    return out


class _Slots:
    """The fleet's slots as list scheduling fills them: when each frees, and which model it runs until then."""

    def __init__(self, fleet: Fleet, now: float) -> None:
        self.fleet = fleet
        self.free = [now] * fleet.slots
        self.models = [*fleet.running_models[:fleet.slots], *[""] * (fleet.slots - len(fleet.running_models))]
        for slot in range(min(fleet.slots, max(0, fleet.blocked_slots))):
            self.free[slot] += fleet.blocking_seconds
        self.heap = [(free, slot) for slot, free in enumerate(self.free)]
        heapq.heapify(self.heap)

    def neighbours(self, slot: int, at: float) -> list[str]:
        """The models running at `at` on the other slots of `slot`'s worker (one that frees at `at` goes on
        with the model it ran, as far as the plan knows)."""
        group = max(1, self.fleet.slots_per_worker)
        first = slot // group * group
        return [self.models[other] for other in range(first, min(first + group, self.fleet.slots))
                if other != slot and self.free[other] >= at]

    def place(self, model: str, seconds: float) -> tuple[float, int]:
        """One chunk of `model` of `seconds` on the slot that frees first; returns its end and that slot."""
        while True:
            free, slot = heapq.heappop(self.heap)
            if free == self.free[slot]:  # (entries of slots `place_on` moved since are stale)
                break
        return self.place_on(slot, model, seconds), slot

    def place_on(self, slot: int, model: str, seconds: float) -> float:
        """One chunk of `model` of `seconds` on `slot` as soon as it frees; returns its end."""
        start = self.free[slot]
        end = start + seconds * self.fleet.slowdown(model, self.neighbours(slot, start))
        self.free[slot], self.models[slot] = end, model
        heapq.heappush(self.heap, (end, slot))
        return end

    def pour(self, model: str, seconds: float, *, most: int | None = None) -> float:
        """A job of many chunks spread as a fluid (`_pour`) over the slots, or over the `most` that free
        first (its slot cap), beside itself on every worker of more than one slot; returns its end."""
        factor = self.fleet.slowdown(model, [model] if self.fleet.slots_per_worker > 1 else [])
        reached = sorted(range(len(self.free)), key=self.free.__getitem__)[:most or len(self.free)]
        level = _pour([self.free[slot] for slot in reached], seconds * factor)
        for slot in reached:
            if self.free[slot] < level:
                self.free[slot], self.models[slot] = level, model
        self.heap = [(free, slot) for slot, free in enumerate(self.free)]
        heapq.heapify(self.heap)
        return level


def _pour(free: Sequence[float], seconds: float) -> float:
    """The level at which `seconds` of work spread over slots free at `free`, the earliest-free first
    (water filling), ends on all the slots it reaches."""
    times = sorted(free)
    level, filled = times[0], 0
    left = seconds
    while filled < len(times):
        filled += 1
        nxt = times[filled] if filled < len(times) else math.inf
        room = (nxt - level) * filled
        if left <= room:
            level += left / filled
            break
        left -= room
        level = nxt
    return level


def admit(new: Work, active: Sequence[Work], fleet: Fleet, *, now: float, margin: float,
          margin_floor: float = 0.0) -> Verdict:
    """Whether `new` (with a deadline) can finish by it, and would push no accepted job past its own.

    `margin` is a share of the predicted time from now kept in hand for what the prediction misses
    (a 0.1 margin accepts a job predicted to need 100 s only with a deadline 110 s away), and at least
    `margin_floor` seconds (what a job's fixed costs vary by, which a share of a short job misses). An accepted
    job that has come within its margin (its chunks ran slower than foreseen) is still protected: a
    newcomer that would push it further is refused while it is predicted on time without the margin.
    Only one predicted to miss its deadline outright does not make the newcomer infeasible.
    """
    if new.deadline_at is None:
        raise ValueError(f"job {new.job_id} has no deadline to admit it against")
    before = _finish_by_job(active, fleet, now=now)
    after = _finish_by_job([*active, new], fleet, now=now)
    finish = after[new.job_id]
    if math.isinf(finish):
        return Verdict(finish, False, math.inf, "no live worker can run it")
    needed = _with_margin(finish, now=now, margin=margin, floor=margin_floor)
    if needed > new.deadline_at:
        return Verdict(finish, False, needed, "its own work and the work ahead of it")
    for work in active:
        if work.deadline_at is None:
            continue
        was, now_would = before[work.job_id], after[work.job_id]
        if now_would > was and was <= work.deadline_at < _with_margin(now_would, now=now, margin=margin,
                                                                      floor=margin_floor):
            return Verdict(finish, False, needed, "an accepted job would then miss its deadline",
                           work.deadline_at)  # (whose, not told: it may be another tenant's)
    return Verdict(finish, True, needed)


def _finish_by_job(works: Sequence[Work], fleet: Fleet, *, now: float) -> dict[str, float]:
    ordered = sorted(works, key=lambda work: (work.score, work.job_id))
    return dict(zip([work.job_id for work in ordered], finishes(ordered, fleet, now=now), strict=True))


def _with_margin(finish: float, *, now: float, margin: float, floor: float = 0.0) -> float:
    """`finish` with the time kept in hand: `margin` of the time from now, at least `floor` seconds."""
    return finish + max((finish - now) * margin, floor)


def sla_risk(predicted_finish: float | None, deadline_at: float | None, *, now: float,
             spread: float = 0.15) -> float | None:
    """How likely the job misses its deadline, 0 to 1, from its predicted finish alone: 0.5 when it is
    predicted to finish exactly on time, towards 1 as the prediction passes the deadline. The
    prediction's error is taken to grow with the time left (`spread` of it, at least a second): 6 s
    late on a prediction of a minute is as sure a miss as 6 minutes late on one of an hour, and 6 s
    late on an hour is nearly even."""
    if deadline_at is None or predicted_finish is None:
        return None
    if math.isinf(predicted_finish):
        return 1.0
    scale = max(1.0, spread * max(predicted_finish - now, 0.0))
    lateness = (predicted_finish - deadline_at) / scale
    return round(1 / (1 + math.exp(-max(-30.0, min(30.0, lateness * 3)))), 4)


CALIBRATION_WEIGHT = 0.3
"""How much one finished job moves its model's calibration (an exponentially weighted mean)."""
CALIBRATION_BOUNDS = (0.5, 10.0)
"""A calibration stays within these: one job slowed by a flood of other work says little about the next."""


def recalibrated(factor: float, *, real: float, predicted: float, samples: int = 0) -> float:
    """A model's calibration `factor` after one of its jobs ran `real` seconds (first lease to finish) where
    its profile foresaw `predicted`: its predicted device time is multiplied by the result, so a fleet
    slower than its profiles (per-chunk costs, streams that share cores, online traffic, other
    processes) is learnt. The job is the model's `samples`-th: the first ones are averaged plainly (the
    first sets the factor), later ones weigh `CALIBRATION_WEIGHT`."""
    if predicted <= 0 or real <= 0:
        return factor
    low, high = CALIBRATION_BOUNDS
    observed = min(high, max(low, real / predicted))
    weight = max(CALIBRATION_WEIGHT, 1 / samples) if samples > 0 else CALIBRATION_WEIGHT
    return round((1 - weight) * factor + weight * observed, 4)
