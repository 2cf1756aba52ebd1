"""Device memory reservations and the graph-aware backfill decision (EASY backfilling).

Memory is reserved in `gpu_memory_granularity` units against the device's
capacity; a batch's need is its activation bytes from the model profile (per
token for a token model, so a token batch's reservation follows its token
count, not a fixed batch size). Fragmentation = reserved but unused bytes /
reserved bytes.

Under `graph-aware-backfill` the model at the head of the priority order
keeps its claim: when its batch does not fit now, other models' batches may
run only if they fit in the free memory and, by their profiled latency,
finish before the head's batch could start (when enough running batches have
ended) — so they never delay it. The other policies simply wait for memory.
Pure logic and one in-process ledger per worker (one worker owns one device).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def round_up(need_bytes: int, granularity: int) -> int:
    """The reservation for `need_bytes`: whole granularity units, at least one."""
    return max(1, math.ceil(need_bytes / granularity)) * granularity


def batch_need_bytes(static_profile: dict[str, Any], *, rows: int, tokens: int | None) -> int:
    """Activation memory of one batch from the static profile (per token for token models)."""
    if static_profile.get("sequence_axis") and tokens:
        return int(static_profile.get("activation_bytes_per_token") or 0) * tokens
    return int(static_profile.get("activation_bytes_per_sample") or 0) * rows


@dataclass
class _Running:
    reserved: int
    used: int
    ends_at: float


@dataclass
class MemoryLedger:
    """Reservations of one device; thread-safe (a worker's stream threads share it)."""

    capacity_bytes: int
    granularity: int
    _running: dict[int, _Running] = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reserved_area: float = 0.0  # byte-seconds reserved, since the ledger was made
    _used_area: float = 0.0
    _changed_at: float | None = None

    def _integrate(self, now: float) -> None:
        """Add the time since the last change to the reserved and used byte-seconds (lock held)."""
        if self._changed_at is not None and now > self._changed_at:
            elapsed = now - self._changed_at
            self._reserved_area += elapsed * sum(run.reserved for run in self._running.values())
            self._used_area += elapsed * sum(run.used for run in self._running.values())
        self._changed_at = now

    def reserve(self, need_bytes: int, *, now: float, expected_seconds: float) -> int:
        """Reserve for a batch that starts now; returns the handle to release. May exceed capacity
        when one batch alone is larger than the device (it must run somewhere)."""
        with self._lock:
            self._integrate(now)
            self._next += 1
            self._running[self._next] = _Running(round_up(need_bytes, self.granularity), need_bytes,
                                                 now + expected_seconds)
            return self._next

    def release(self, handle: int, *, now: float | None = None) -> None:
        """The batch ended: its memory is free again."""
        with self._lock:
            if now is not None:
                self._integrate(now)
            self._running.pop(handle, None)

    def free_bytes(self) -> int:
        """Capacity not reserved."""
        with self._lock:
            return self.capacity_bytes - sum(run.reserved for run in self._running.values())

    def fits(self, need_bytes: int) -> bool:
        """Would a batch needing `need_bytes` fit now (or is the device idle)?"""
        with self._lock:
            reserved = sum(run.reserved for run in self._running.values())
            return not self._running or reserved + round_up(need_bytes, self.granularity) <= self.capacity_bytes

    def shadow_time(self, need_bytes: int, *, now: float) -> float:
        """When, by the expected end of running batches, a batch needing `need_bytes` could start."""
        with self._lock:
            runs = sorted(self._running.values(), key=lambda run: run.ends_at)
            reserved = sum(run.reserved for run in runs)
        target = round_up(need_bytes, self.granularity)
        for run in runs:
            if reserved + target <= self.capacity_bytes:
                break
            reserved -= run.reserved
            now = max(now, run.ends_at)
        return now

    def stats(self) -> dict[str, Any]:
        """Reserved and used bytes, fragmentation, batches running."""
        with self._lock:
            reserved = sum(run.reserved for run in self._running.values())
            used = sum(run.used for run in self._running.values())
            count = len(self._running)
            reserved_area, used_area = self._reserved_area, self._used_area
        return {"capacity_bytes": self.capacity_bytes, "reserved_bytes": reserved, "used_bytes": used,
                "fragmentation": round((reserved - used) / reserved, 4) if reserved else 0.0,
                "fragmentation_mean": round(1 - used_area / reserved_area, 4) if reserved_area else 0.0,
                "batches_running": count}


def admissible_models(ordered: Sequence[str], need_of: Callable[[str], int], seconds_of: Callable[[str], float],
                      ledger: MemoryLedger, *, now: float, backfill: bool) -> list[str]:
    """The models a free stream slot may lease from now, in order.

    The head (first in `ordered`) if its batch fits. Otherwise nothing, unless `backfill`: then
    the others whose batch fits now and ends before the head's batch could start.
    """
    if not ordered:
        return []
    head = ordered[0]
    if ledger.fits(need_of(head)):
        return list(ordered)
    if not backfill:
        return []
    shadow = ledger.shadow_time(need_of(head), now=now)
    return [model for model in ordered[1:]
            if ledger.fits(need_of(model)) and now + seconds_of(model) <= shadow]
