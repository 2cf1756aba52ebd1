"""Degrading a worker's lower priority classes while its device memory jitters.

A worker reads its device memory every `degrade.sample_interval` (`sits_worker/device/memory_watch.py`).
Memory that swings hard, up and down, is a device near its edge: the next large batch may not fit. So the worker
sheds its least important work first, one step at a time:

- step 0, normal: every class is served as usual;
- step 1, P1 served as P2: P0 work is leased before any other, and P1 work ranks with P2 work, as
  if it had P2's top level;
- step 2, P2 paused: as step 1, and P2 work is not leased by this worker (it stays queued for the
  calm workers, and for this one once it steps back).

The classes are bands of priority levels: P0 from `degrade.top_level` up (the express levels at
the defaults), P1 from `degrade.middle_level`, P2 below. An item's class is the level it was
submitted at, so a P2 item that a PSA jump raised stays P2. P0 is never paused. Pure functions,
clock passed in; docs/failures.md, "Degrading under memory jitter".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.failures.settings import DegradeSettings
from broker.queueing.scoring import Ordering
from broker.setting_types import MAX_PRIORITY

NORMAL, P1_AS_P2, P2_PAUSED = 0, 1, 2
MOST_DEGRADED = P2_PAUSED
STEP_NAMES = {NORMAL: "normal", P1_AS_P2: "p1-as-p2", P2_PAUSED: "p2-paused"}
"""Each step's name, as `/v1/status` and the logs give it."""


@dataclass(frozen=True)
class Reading:
    """One reading of a worker's device memory."""

    at: float
    used_bytes: int


def memory_jitter(readings: Sequence[Reading], capacity_bytes: int) -> float:
    """How far `readings` both rose and fell, as a share of `capacity_bytes`: the smaller of their
    largest rise and their largest fall. A one-way change (a model loading, a cache filling) is no
    jitter; memory that swings by 2 GiB up and down is 2 GiB of it. 0 for fewer than two readings or no
    capacity."""
    if len(readings) < 2 or capacity_bytes <= 0:
        return 0.0
    lowest = highest = readings[0].used_bytes
    rise = fall = 0
    for reading in readings:  # (the first one changes nothing; a deque cannot be sliced)
        rise, fall = max(rise, reading.used_bytes - lowest), max(fall, highest - reading.used_bytes)
        lowest, highest = min(lowest, reading.used_bytes), max(highest, reading.used_bytes)
    return min(rise, fall) / capacity_bytes


def within_window(readings: Sequence[Reading], *, now: float, window: float) -> list[Reading]:
    """The readings taken within the last `window` seconds."""
    return [reading for reading in readings if now - reading.at <= window]


@dataclass(frozen=True)
class DegradeState:
    """Where a worker stands: its step, since when, and how calm its memory has been."""

    step: int = NORMAL
    changed_at: float = float("-inf")
    """When the step last changed (never: -inf)."""
    calm_since: float | None = None
    """Since when the jitter has stayed within the threshold (None: it is above it now)."""
    jitter: float = 0.0
    """The last jitter measured."""

    @property
    def name(self) -> str:
        """The step's name (`STEP_NAMES`)."""
        return STEP_NAMES[self.step]


def next_state(state: DegradeState, jitter: float, *, now: float, settings: DegradeSettings) -> DegradeState:
    """The state after measuring `jitter` at `now`: one step down when it is above the threshold and the
    last step is `step_interval` old; one step back when it has been within it for `calm_for` and the
    last step is that old too; else the same step."""
    if jitter > settings.jitter_threshold:
        state = dataclasses.replace(state, calm_since=None, jitter=jitter)
        if state.step < MOST_DEGRADED and now - state.changed_at >= settings.step_interval:
            return dataclasses.replace(state, step=state.step + 1, changed_at=now)
        return state
    calm_since = now if state.calm_since is None else state.calm_since
    state = dataclasses.replace(state, calm_since=calm_since, jitter=jitter)
    if state.step > NORMAL and now - calm_since >= settings.calm_for and now - state.changed_at >= settings.calm_for:
        return dataclasses.replace(state, step=state.step - 1, changed_at=now)
    return state


def priority_class(level: int, settings: DegradeSettings) -> int:
    """The class of priority level `level`: 0 (P0, the top), 1 (P1) or 2 (P2)."""
    if level >= settings.top_level:
        return 0
    return 1 if level >= settings.middle_level else 2


def lowest_leased_level(step: int, settings: DegradeSettings) -> int:
    """The lowest priority level a worker at `step` leases (0: every level)."""
    return settings.middle_level if step >= P2_PAUSED else 0


def lease_classes(step: int, settings: DegradeSettings, ordering: Ordering, window: int) -> dict[str, Any] | None:
    """The `classes` option of `lease_batch.lua` at `step` (None at step 0: the queue order as it is).

    `ranks[level]`: 1 for P0, 2 for P1 and P2, 0 (not leased) for P2 once paused. `demote[level]`:
    added to a P1 item's score within its rank, the priority points of its level above P2's top
    (under the `dynamic` ordering, where a score is points subtracted; `fifo` scores are arrival
    times, which no level changes). `window`: how many waiting items the lease may weigh."""
    if step <= NORMAL:
        return None
    ranks, demote = [], []
    p2_top = settings.middle_level - 1
    for level in range(MAX_PRIORITY + 1):
        cls = priority_class(level, settings)
        ranks.append(1 if cls == 0 else 0 if cls == 2 and step >= P2_PAUSED else 2)
        demote.append(level - p2_top if cls == 1 and ordering == "dynamic" else 0)
    return {"ranks": ranks, "demote": demote, "window": window}
