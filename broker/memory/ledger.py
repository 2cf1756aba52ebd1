"""One device's memory reservations: what running batches hold, in granularity units, and the
fragmentation, batches running and memory reserved over time that the worker reports.

Memory is reserved in `gpu_memory_granularity` units (`cpu_memory_granularity` on a CPU worker)
against the device's capacity; a batch's need is its activation bytes from the model profile.
Fragmentation = reserved but unused bytes / reserved bytes. The ledger also remembers `Claim`s,
what job chunks that did not fit really need, and what a row of a model that ran out of device
memory needs at least (`learn_oom`). The decisions taken on it are `reservation.py`'s.
One in-process ledger per worker (one worker owns one device); thread-safe.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from broker.jobs.records import chunk_job_id


def round_up(need_bytes: int, granularity: int) -> int:
    """The reservation for `need_bytes`: whole granularity units, at least one."""
    return max(1, math.ceil(need_bytes / granularity)) * granularity


@dataclass(frozen=True)
class Claim:
    """A job chunk that was leased at the head of its model's queue and did not fit: what its job's
    chunks need.

    Admissions are sized by a model's online batch limits, but a chunk runs mini-batches of its
    job's `batch_size` (with a batch of riders on top): its real need is known only once it is
    leased. A chunk that does not fit goes back to its queue at once, and while chunks of its job
    head the queue, admissions count their real need for the model's head, so that they are
    neither leased and returned over and over nor starved by smaller batches that keep the memory
    busy. A claim is replaced by the model's next one and ignored once its job's chunks are gone.
    """

    job_id: str
    """The job whose chunks it stands for: they all run the same mini-batches, so it counts for
    every chunk of the job that heads the queue (item ids `<job id>:c<index>`), not only the one
    that was returned."""
    need_bytes: int
    seconds: float

    def covers(self, item_id: str | None) -> bool:
        """Is `item_id` one of the claimed job's chunks?"""
        return item_id is not None and chunk_job_id(item_id) == self.job_id


@dataclass
class _Running:
    reserved: int
    used: int
    ends_at: float
    hold: bool = False
    """A decision's placeholder until its lease is reserved for real (`admit_and_hold`): it keeps the
    memory from other slots, but no batch runs in it, so the stats leave it out."""


@dataclass
class MemoryLedger:
    """Reservations of one device; thread-safe (a worker's stream threads share it)."""

    capacity_bytes: int
    granularity: int
    _running: dict[int, _Running] = field(default_factory=dict)
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    deciding: threading.Lock = field(default_factory=threading.Lock)
    """Held by `admit_and_hold` so that two stream slots never admit batches on the same free memory."""
    _reserved_area: float = 0.0  # byte-seconds reserved, since the first reservation
    _used_area: float = 0.0
    _running_area: float = 0.0  # batch-seconds: the integral of the number of batches running
    _first_at: float | None = None
    _changed_at: float | None = None
    _events: dict[str, int] = field(default_factory=lambda: {"memory_waits": 0, "backfills": 0})
    _claims: dict[str, Claim] = field(default_factory=dict)
    _learnt_row_bytes: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Model -> (bytes a row needs at least, when that was learnt), from device OOMs (`learn_oom`)."""

    def learn_oom(self, model: str, rows: int, estimated_bytes: int, *, now: float) -> int:
        """A run of `rows` rows of `model` ran out of device memory: its real need was larger than
        its estimate (`estimated_bytes`). A row then counts twice its estimate (at least a
        granularity unit for the run), but never more than the room the run had. Returns the bytes
        per row that `row_bytes` gives from now on."""
        with self._lock:
            others = sum(run.reserved for run in self._running.values())
            room = max(self.granularity, self.capacity_bytes - others + round_up(estimated_bytes, self.granularity))
            need = min(room, 2 * max(estimated_bytes, self.granularity))
            floor = -(-need // max(1, rows))
            known = self._learnt_row_bytes.get(model)
            floor = max(floor, known[0]) if known is not None else floor
            self._learnt_row_bytes[model] = (floor, now)
            return floor

    def row_bytes(self, model: str, estimated: int, *, now: float, keep_seconds: float) -> int:
        """The bytes a row of `model` needs: `estimated` (the profile's), or more when an OOM taught
        so within the last `keep_seconds`."""
        with self._lock:
            learnt = self._learnt_row_bytes.get(model)
            if learnt is not None and now - learnt[1] > keep_seconds:
                del self._learnt_row_bytes[model]
                learnt = None
        return max(estimated, learnt[0]) if learnt is not None else estimated

    def claim(self, model: str, claim: Claim) -> None:
        """Remember what the chunk heading `model`'s queue needs (it did not fit when leased)."""
        with self._lock:
            self._claims[model] = claim

    def claim_of(self, model: str, head_item: str | None) -> Claim | None:
        """The claim on `model` while a chunk of the claimed job heads its queue (`head_item`)."""
        with self._lock:
            claim = self._claims.get(model)
        return claim if claim is not None and claim.covers(head_item) else None

    def count(self, event: str) -> None:
        """Count an admission decision for the stats: 'memory_waits' (a free slot with work waiting
        got nothing, for memory) or 'backfills' (it got batches around a head that did not fit)."""
        with self._lock:
            self._events[event] = self._events.get(event, 0) + 1

    def whole_units(self, nbytes: int) -> int:
        """`nbytes` rounded down to whole granularity units: what reservations can really use of it."""
        return max(0, nbytes) // self.granularity * self.granularity

    def _integrate(self, now: float) -> None:
        """Add the time since the last change to the reserved, used and running integrals (lock held)."""
        if self._changed_at is not None and now > self._changed_at:
            elapsed = now - self._changed_at
            batches = [run for run in self._running.values() if not run.hold]
            self._reserved_area += elapsed * sum(run.reserved for run in batches)
            self._used_area += elapsed * sum(run.used for run in batches)
            self._running_area += elapsed * len(batches)
        self._first_at = now if self._first_at is None else self._first_at
        self._changed_at = now

    def reserve(self, need_bytes: int, *, now: float, expected_seconds: float, hold: bool = False) -> int:
        """Reserve for a batch that starts now (or, `hold`, for a decision until its lease is reserved);
        returns the handle to release. May exceed capacity when one batch alone is larger than the
        device (it must run somewhere)."""
        with self._lock:
            self._integrate(now)
            self._next += 1
            self._running[self._next] = _Running(round_up(need_bytes, self.granularity), need_bytes,
                                                 now + expected_seconds, hold)
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

    def fits(self, need_bytes: int, *, instead_of: int | None = None) -> bool:
        """Would a batch needing `need_bytes` fit now, taking the place of the reservation
        `instead_of` if given (or is nothing else running)?"""
        with self._lock:
            others = [run.reserved for handle, run in self._running.items() if handle != instead_of]
            return not others or sum(others) + round_up(need_bytes, self.granularity) <= self.capacity_bytes

    def room_in_place_of(self, lender: int | None) -> int | None:
        """Whole units a batch running in place of the batch holding `lender` may use (its reservation
        and the free memory); None: no limit, nothing else runs (see `reserve_in_place_of`)."""
        with self._lock:
            others = sum(run.reserved for handle, run in self._running.items() if handle != lender)
        return None if not others else self.whole_units(self.capacity_bytes - others)

    def reserve_in_place_of(self, lender: int | None, need_bytes: int, *, now: float,
                            expected_seconds: float) -> int | None:
        """Reserve for a batch that runs on the thread of the batch holding `lender`, between two of
        its runs (a job chunk's mini-batches: its activation memory lies idle meanwhile), so only
        what `lender` does not cover is reserved anew; None when that does not fit beside the
        others (with nothing else running it always does). Returns the handle to release."""
        with self._lock:
            lent = self._running[lender].reserved if lender in self._running else 0
            others = sum(run.reserved for handle, run in self._running.items() if handle != lender)
            target = round_up(need_bytes, self.granularity)
            if others and others + max(target, lent) > self.capacity_bytes:
                return None
            self._integrate(now)
            self._next += 1
            self._running[self._next] = _Running(max(0, target - lent), max(0, need_bytes - lent),
                                                 now + expected_seconds)
            return self._next

    def head_window(self, need_bytes: int, *, now: float) -> tuple[float, int]:
        """(When a batch needing `need_bytes` could start, by the expected end of running batches;
        the bytes still free beside it then): EASY's shadow time and extra memory."""
        with self._lock:
            runs = sorted(self._running.values(), key=lambda run: run.ends_at)
            reserved = sum(run.reserved for run in runs)
        target = round_up(need_bytes, self.granularity)
        for run in runs:
            if reserved + target <= self.capacity_bytes:
                break
            reserved -= run.reserved
            now = max(now, run.ends_at)
        return now, max(0, self.capacity_bytes - reserved - target)

    def stats(self) -> dict[str, Any]:
        """Reserved and used bytes, fragmentation, batches running: now, and time-weighted means.

        The means run from the first reservation to the last release: `batches_running_mean` below
        the stream count while work waited means stream slots stood idle (waiting for memory, or
        for work); `reserved_share_mean` is how full the reservations kept the device. The counts
        `memory_waits` and `backfills` are admission decisions (a waiting slot polls about every
        millisecond, so waits are roughly milliseconds of one slot).
        """
        with self._lock:
            batches = [run for run in self._running.values() if not run.hold]
            reserved = sum(run.reserved for run in batches)
            used = sum(run.used for run in batches)
            count = len(batches)
            reserved_area, used_area, running_area = self._reserved_area, self._used_area, self._running_area
            span = (self._changed_at or 0.0) - (self._first_at or 0.0)
            events = dict(self._events)
        return {**events, "capacity_bytes": self.capacity_bytes, "granularity_bytes": self.granularity,
                "reserved_bytes": reserved, "used_bytes": used,
                "fragmentation": round((reserved - used) / reserved, 4) if reserved else 0.0,
                "fragmentation_mean": round(1 - used_area / reserved_area, 4) if reserved_area else 0.0,
                "batches_running": count,
                "batches_running_mean": round(running_area / span, 4) if span > 0 else 0.0,
                "reserved_share_mean": round(reserved_area / (span * self.capacity_bytes), 4) if span > 0 else 0.0}
