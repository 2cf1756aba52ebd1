"""Fault injection's decisions: which run fails, and how (`faults` in the settings).

Small pure functions over the settings, the run's facts and a random draw passed in; the worker
(`sits_worker/serving/fault_injection.py`) raises the error each names, on its real error path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase

import numpy as np

from broker.failures.settings import FaultSettings


def applies_to(faults: FaultSettings, worker: str) -> bool:
    """Whether the worker named `worker` injects the faults: `workers` is empty, or a pattern matches."""
    return not faults.workers or any(fnmatchcase(worker, pattern) for pattern in faults.workers)


def model_fault(faults: FaultSettings, model_ref: str, *, first_failure_at: float | None = None,
                now: float = 0.0, draw: Callable[[], float] | None = None) -> str | None:
    """The failure class this run of `model_ref` (`name@version`) is to raise; None for none: a model
    not in `fail_models`, a run not among the `fail_models_share` of runs (one `draw()` in [0, 1) when a
    share is set), and every run once `fail_models_for` has passed since the worker's first injected
    model failure (`first_failure_at`)."""
    if faults.fail_models_for and first_failure_at is not None and now - first_failure_at >= faults.fail_models_for:
        return None
    failure_class = faults.fail_models.get(model_ref.partition("@")[0])
    if failure_class is None or not faults.fail_models_share:
        return failure_class
    return failure_class if draw is not None and draw() < faults.fail_models_share else None


def oom_fault(faults: FaultSettings, rows: int, draw: Callable[[], float]) -> str | None:
    """Why a run of `rows` rows is to fail as out of device memory (None: it is not): it has more rows
    than `oom_above_rows`, or it is among the `oom_share` of runs (one `draw()` in [0, 1) when a share is set)."""
    if faults.oom_above_rows and rows > faults.oom_above_rows:
        return f"{rows} rows is above faults.oom_above_rows ({faults.oom_above_rows})"
    if faults.oom_share and draw() < faults.oom_share:
        return f"one of faults.oom_share ({faults.oom_share:g}) of runs"
    return None


def failing_rows(faults: FaultSettings, row_indices: Iterable[int]) -> list[int]:
    """The job rows among `row_indices` that `fail_rows` names, in order."""
    if not faults.fail_rows:
        return []
    named = set(faults.fail_rows)
    return [int(index) for index in row_indices if int(index) in named]


def failing_value(faults: FaultSettings, feed: Mapping[str, np.ndarray]) -> float | None:
    """A `fail_values` value that the inputs of a run hold (None: none does)."""
    if not faults.fail_values:
        return None
    values = np.asarray(faults.fail_values)
    for array in feed.values():
        if array.dtype.kind in "biuf":
            hits = np.isin(values, array)
            if hits.any():
                return float(values[int(np.argmax(hits))])
    return None


def redis_drop_due(faults: FaultSettings, draw: Callable[[], float]) -> bool:
    """Whether the running thread's Redis connection drops after this run (`redis_drop_share`)."""
    return bool(faults.redis_drop_share) and draw() < faults.redis_drop_share


def run_latency(faults: FaultSettings) -> float:
    """Seconds added before each run."""
    return faults.run_latency


def memory_jitter_offset(faults: FaultSettings, *, reading: int, since_first: float) -> int:
    """What the `reading`-th memory reading (0-based), taken `since_first` seconds after the first one,
    adds to the real reading: `memory_jitter` on every other reading while the jitter lasts, else 0."""
    if not faults.memory_jitter or since_first < faults.memory_jitter_after:
        return 0
    if faults.memory_jitter_for and since_first >= faults.memory_jitter_after + faults.memory_jitter_for:
        return 0
    return faults.memory_jitter if reading % 2 else 0
