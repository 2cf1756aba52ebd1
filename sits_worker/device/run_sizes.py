"""The largest runs of each model that worked on this worker: whether a run that failed was the device's fault.

A run that runs out of memory or time may fail because the device is short (another process took its
memory, a driver is stuck), or because of what it was asked: more rows than ever, or one request of more
tokens a row than any run so far. Only the first says anything about the worker; the second is the
request's own. Counting it on the model's breaker, or lowering the model's batch ceiling for it, would let
one tenant's oversized request (a 6,000-token row on a model that runs 512) take the model from every
tenant on the worker. So a run's failure is the device's when the run was no larger, in rows and in
tokens a row, than runs that worked; until one has worked, every failure is the device's (a device that
cannot run a model at all still opens its breaker).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class RunSize:
    """A run's rows and, for a token model, its tokens a row (None for other models)."""

    rows: int
    tokens_per_row: int | None = None

    @classmethod
    def of(cls, rows: int, tokens: int | None) -> RunSize:
        """From a run's rows and its tokens in all (`broker.monitoring.batch_sizes.run_size`)."""
        return cls(rows, None if tokens is None or rows <= 0 else -(-tokens // rows))

    def within(self, largest: RunSize) -> bool:
        """Whether this run is no larger than `largest` in rows and in tokens a row."""
        return self.rows <= largest.rows and (self.tokens_per_row or 0) <= (largest.tokens_per_row or 0)


def larger(known: RunSize | None, size: RunSize) -> RunSize:
    """`known` grown to take in `size`, in each of its dimensions."""
    if known is None:
        return size
    return RunSize(max(known.rows, size.rows), max(known.tokens_per_row or 0, size.tokens_per_row or 0) or None)


def blames_device(known: RunSize | None, size: RunSize) -> bool:
    """Whether a run of `size` that ran out of memory or time failed for the device rather than for its size:
    no run has worked yet (`known` None), or the run was within the largest that did."""
    return known is None or size.within(known)


class RunSizes:
    """The largest runs that worked, by model version, on this worker; shared by its stream threads."""

    def __init__(self) -> None:
        self._largest: dict[str, RunSize] = {}
        self._lock = threading.Lock()

    def worked(self, model_ref: str, size: RunSize) -> None:
        """Note a run of `size` of `model_ref` that worked."""
        known = self._largest.get(model_ref)
        if known is None or not size.within(known):
            with self._lock:
                self._largest[model_ref] = larger(self._largest.get(model_ref), size)

    def has_worked(self, model_ref: str) -> bool:
        """Whether any run of `model_ref` has worked on this worker."""
        return model_ref in self._largest

    def blames_device(self, model_ref: str, size: RunSize) -> bool:
        """`blames_device` for `model_ref`'s runs on this worker."""
        return blames_device(self._largest.get(model_ref), size)
