"""Device out-of-memory: halve the batch, then offload; each model's learnt batch ceiling.

Pure decisions, clock passed in; the worker carries them out (`WorkerContext.run`). A batch that
ran out of device memory is halved and each half run again, down to one row. What still does not
fit at one row runs on a CPU session (`cpu-offload-on-oom`) or fails (`fail`). After an OOM the
model's runs are cut to a ceiling below the size that failed; it doubles every
`scheduler.oom_ceiling_decay` until it reaches that size again, and is then forgotten.
See docs/failures.md, "Device out of memory".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

OomStep = Literal["halve", "offload", "fail"]

_MOST_DOUBLINGS = 40


def after_oom(rows: int, fallback_strategy: str) -> OomStep:
    """What to do with a run of `rows` rows that ran out of device memory: halve it while it has
    more than one row; then offload it to the CPU, or fail, as `fallback_strategy` says."""
    if rows > 1:
        return "halve"
    return "offload" if fallback_strategy == "cpu-offload-on-oom" else "fail"


def halves(start: int, stop: int) -> list[tuple[int, int]]:
    """The two halves of the rows [start, stop), the first one the larger; the piece itself when it
    has one row."""
    if stop - start <= 1:
        return [(start, stop)]
    middle = start + (stop - start + 1) // 2
    return [(start, middle), (middle, stop)]


def pieces(rows: int, ceiling: int | None) -> list[tuple[int, int]]:
    """The runs a batch of `rows` rows is cut into under a ceiling of `ceiling` rows (None: one run)."""
    if ceiling is None or rows <= ceiling:
        return [(0, rows)]
    return [(start, min(start + ceiling, rows)) for start in range(0, rows, ceiling)]


@dataclass(frozen=True)
class Ceiling:
    """A model's batch ceiling after a device OOM."""

    rows: int
    """The most rows a run may have when it was set."""
    failed_rows: int
    """The smallest run that ran out of memory: the ceiling is forgotten once it grows back to it."""
    set_at: float

    def rows_at(self, now: float, decay_seconds: float) -> int | None:
        """The ceiling at `now`: `rows`, doubled once per `decay_seconds` since it was set; None once
        that reaches `failed_rows` (or without a decay: it never lasts)."""
        if decay_seconds <= 0:
            return None
        doublings = min(_MOST_DOUBLINGS, max(0, int((now - self.set_at) // decay_seconds)))
        rows = self.rows * 2**doublings
        return None if rows >= self.failed_rows else rows


def lowered(current: Ceiling | None, failed_rows: int, *, now: float, decay_seconds: float) -> Ceiling:
    """The ceiling after a run of `failed_rows` rows ran out of memory at `now`: half of it (at least
    one row), and never above the ceiling still in force."""
    rows = max(1, failed_rows // 2)
    in_force = current.rows_at(now, decay_seconds) if current is not None else None
    if current is not None and in_force is not None:
        rows = min(rows, in_force)
        failed_rows = min(failed_rows, current.failed_rows)
    return Ceiling(rows=rows, failed_rows=max(failed_rows, rows + 1), set_at=now)


class Ceilings:
    """One worker's batch ceilings by model version; thread-safe (its stream threads share it)."""

    def __init__(self, decay_seconds: float) -> None:
        self.decay_seconds = decay_seconds
        self._ceilings: dict[str, Ceiling] = {}
        self._lock = threading.Lock()

    def rows(self, model_ref: str, *, now: float) -> int | None:
        """The most rows a run of `model_ref` may have at `now` (None: no ceiling)."""
        with self._lock:
            ceiling = self._ceilings.get(model_ref)
            rows = ceiling.rows_at(now, self.decay_seconds) if ceiling is not None else None
            if ceiling is not None and rows is None:
                del self._ceilings[model_ref]
            return rows

    def in_force(self, *, now: float) -> dict[str, int]:
        """Model ref -> its ceiling at `now`, of every model that has one (for the heartbeat)."""
        with self._lock:
            refs = list(self._ceilings)
        return {ref: rows for ref in refs if (rows := self.rows(ref, now=now)) is not None}

    def lower(self, model_ref: str, failed_rows: int, *, now: float) -> int:
        """Note that a run of `failed_rows` rows of `model_ref` ran out of memory; the new ceiling."""
        with self._lock:
            ceiling = lowered(self._ceilings.get(model_ref), failed_rows, now=now, decay_seconds=self.decay_seconds)
            self._ceilings[model_ref] = ceiling
            return ceiling.rows
