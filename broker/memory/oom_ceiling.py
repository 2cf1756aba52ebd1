"""Device out-of-memory: halve the batch, then offload; each model's learnt batch ceiling.

Pure decisions, clock passed in; the worker carries them out (`WorkerContext.run`). A batch that
ran out of device memory is halved and each half run again, down to one row. What still does not
fit at one row runs on a CPU session (`cpu-offload-on-oom`) or fails (`fail`). After an OOM the
model's runs are cut to a ceiling below the size that failed; it doubles every
`scheduler.oom_ceiling_decay` until it reaches that size again, and is then forgotten. For a token
model the ceiling is learnt at the padded width of the run that ran out and bounds the batches at least
that wide, in rows x width: a narrower batch is not bounded by it (it learns its own, should it run out),
so one tenant's long row padded beside others' does not cut everyone's short batches. See
docs/failures.md, "Device out of memory".
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


def rows_at_width(rows: int, learnt_width: int | None, width: int | None) -> int:
    """`rows` rows learnt at `learnt_width` tokens a row, as rows of `width` tokens: the same rows x width (at
    least one row). Either width None (a model without a sequence axis): `rows` as they are."""
    if learnt_width is None or width is None or width == learnt_width:
        return rows
    return max(1, rows * learnt_width // max(1, width))


@dataclass(frozen=True)
class Ceiling:
    """A model's batch ceiling after a device OOM."""

    rows: int
    """The most rows a run may have when it was set (of `tokens_per_row` tokens, for a token model)."""
    failed_rows: int
    """The smallest run that ran out of memory: the ceiling is forgotten once it grows back to it."""
    set_at: float
    tokens_per_row: int | None = None
    """The padded width of the runs that ran out (None for a model without a sequence axis): the ceiling
    bounds rows x this width (`rows_at_width`)."""

    def rows_at(self, now: float, decay_seconds: float, tokens_per_row: int | None = None) -> int | None:
        """The ceiling at `now` for runs of `tokens_per_row` tokens a row: `rows`, doubled once per
        `decay_seconds` since it was set, at that width; None once that reaches `failed_rows` (or without a
        decay: it never lasts), and for runs narrower than the ones that ran out (`bounds`)."""
        if decay_seconds <= 0:
            return None
        doublings = min(_MOST_DOUBLINGS, max(0, int((now - self.set_at) // decay_seconds)))
        rows = self.rows * 2**doublings
        if rows >= self.failed_rows or not self.bounds(tokens_per_row):
            return None
        return rows_at_width(rows, self.tokens_per_row, tokens_per_row)

    def bounds(self, tokens_per_row: int | None) -> bool:
        """Whether the ceiling bounds runs of `tokens_per_row` tokens a row: those at least as wide as the runs
        that ran out (every run of a model without a sequence axis)."""
        return self.tokens_per_row is None or tokens_per_row is None or tokens_per_row >= self.tokens_per_row


def lowered(current: Ceiling | None, failed_rows: int, *, now: float, decay_seconds: float,
            tokens_per_row: int | None = None) -> Ceiling:
    """The ceiling after a run of `failed_rows` rows of `tokens_per_row` tokens a row ran out of memory at
    `now`: half of it (at least one row) at that width, and never above the ceiling still in force there."""
    rows = max(1, failed_rows // 2)
    in_force = current.rows_at(now, decay_seconds, tokens_per_row) if current is not None else None
    if current is not None and in_force is not None:
        rows = min(rows, in_force)
        failed_rows = min(failed_rows, rows_at_width(current.failed_rows, current.tokens_per_row, tokens_per_row))
    return Ceiling(rows=rows, failed_rows=max(failed_rows, rows + 1), set_at=now, tokens_per_row=tokens_per_row)


class Ceilings:
    """One worker's batch ceilings by model version; thread-safe (its stream threads share it)."""

    def __init__(self, decay_seconds: float) -> None:
        self.decay_seconds = decay_seconds
        self._ceilings: dict[str, Ceiling] = {}
        self._lock = threading.Lock()

    def rows(self, model_ref: str, *, now: float, tokens_per_row: int | None = None) -> int | None:
        """The most rows a run of `model_ref` of `tokens_per_row` tokens a row may have at `now` (None: no
        ceiling)."""
        with self._lock:
            ceiling = self._ceilings.get(model_ref)
            if ceiling is None:
                return None
            if ceiling.rows_at(now, self.decay_seconds) is None:  # (grown back at its own width: forgotten)
                del self._ceilings[model_ref]
                return None
            return ceiling.rows_at(now, self.decay_seconds, tokens_per_row)

    def in_force(self, *, now: float) -> dict[str, int]:
        """Model ref -> its ceiling at `now`, in rows of the width it was learnt at, of every model that has
        one (for the heartbeat)."""
        in_force: dict[str, int] = {}
        with self._lock:
            for ref, ceiling in list(self._ceilings.items()):
                rows = ceiling.rows_at(now, self.decay_seconds)  # (at the width it was learnt at)
                if rows is None:
                    del self._ceilings[ref]
                else:
                    in_force[ref] = rows
        return in_force

    def lower(self, model_ref: str, failed_rows: int, *, now: float, tokens_per_row: int | None = None) -> int:
        """Note that a run of `failed_rows` rows of `model_ref`, of `tokens_per_row` tokens a row, ran out of
        memory; the new ceiling, in rows of that width."""
        with self._lock:
            ceiling = lowered(self._ceilings.get(model_ref), failed_rows, now=now, decay_seconds=self.decay_seconds,
                              tokens_per_row=tokens_per_row)
            self._ceilings[model_ref] = ceiling
            return ceiling.rows
