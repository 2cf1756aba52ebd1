"""Device memory reservations and the graph-aware backfill decision (EASY backfilling).

Memory is reserved in `gpu_memory_granularity` units against the device's
capacity; a batch's need is its activation bytes from the model profile (per
token for a token model, so a token batch's reservation follows its token
count, not a fixed batch size). Fragmentation = reserved but unused bytes /
reserved bytes.

When the full batch of the model at the head of the priority order does
not fit now, the batch that is really waiting for it may still: the head is
leased all or nothing, formed under its full limits and run only if it fits
the free memory (a queue of four requests needs four rows, not a full batch's
worth). Under `graph-aware-backfill` the head otherwise
keeps its claim on a full batch: when that does not fit now, batches that
would not delay it may run: sized by the profile (bytes and seconds per row
or token) to the free memory and to end before the head's batch could start,
or to the memory the head leaves free beside it then. Inference batches are
divisible, so a backfill batch is cut to the hole rather than refused (the
specification's "smaller batches from other models fill the remaining
memory"); a part of the head model's own queue may go the same way. The
other policies simply wait for memory. Pure logic and one in-process ledger
per worker (one worker owns one device).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from broker.scoring import estimate_latency_ms


def round_up(need_bytes: int, granularity: int) -> int:
    """The reservation for `need_bytes`: whole granularity units, at least one."""
    return max(1, math.ceil(need_bytes / granularity)) * granularity


def batch_need_bytes(static_profile: dict[str, Any], *, rows: int, tokens: int | None) -> int:
    """Activation memory of one batch from the static profile (per token for token models)."""
    return BatchCost.of({"static_profile": static_profile}, max_rows=rows, max_tokens=0).need_bytes(
        rows=rows, tokens=tokens)


@dataclass(frozen=True)
class BatchCost:
    """What one model's batches cost by its profile, within its configured batch limits.

    Token models (a sequence axis) are costed per token: memory and time scale with the tokens
    in the batch; one row at the profile's reference length is `reference_tokens` tokens.
    """

    bytes_per_row: int
    seconds_per_row: float
    max_rows: int
    max_tokens: int = 0
    """The configured token limit (0: none)."""
    bytes_per_token: int = 0
    reference_tokens: int = 0
    """0 for a model without a sequence axis."""

    @classmethod
    def of(cls, record: dict[str, Any], *, max_rows: int, max_tokens: int) -> BatchCost:
        """The cost of a registry record's batches: static activation bytes, profiled seconds per row."""
        static = record.get("static_profile") or {}
        per_row = int(static.get("activation_bytes_per_sample") or 0)
        per_token = int(static.get("activation_bytes_per_token") or 0) if static.get("sequence_axis") else 0
        reference = int(static.get("reference_sequence_length") or 0) or (per_row // per_token if per_token else 0)
        return cls(bytes_per_row=per_row, seconds_per_row=estimate_latency_ms(record, rows=1, tokens=None) / 1000,
                   max_rows=max_rows, max_tokens=max_tokens, bytes_per_token=per_token,
                   reference_tokens=max(reference, 1) if per_token else 0)

    @property
    def full_tokens(self) -> int:
        """Tokens of a full batch: `max_rows` rows at the reference length, within `max_tokens`."""
        full = self.max_rows * self.reference_tokens
        return min(full, self.max_tokens) if self.max_tokens else full

    def need_bytes(self, *, rows: int, tokens: int | None = None) -> int:
        """Activation bytes of a batch of `rows` rows (`tokens` tokens for a token model)."""
        if self.reference_tokens and tokens:
            return self.bytes_per_token * tokens
        return self.bytes_per_row * rows

    def full_need(self) -> int:
        """Bytes of a full batch (what the head of the priority order claims)."""
        return self.need_bytes(rows=self.max_rows, tokens=self.full_tokens or None)

    def seconds(self, *, rows: int, tokens: int | None = None) -> float:
        """Expected run time of a batch of `rows` rows (`tokens` tokens for a token model)."""
        if self.reference_tokens and tokens:
            return self.seconds_per_row * tokens / self.reference_tokens
        return self.seconds_per_row * rows

    def within(self, model: str, free_bytes: int, seconds: float) -> Admission | None:
        """The largest batch that needs at most `free_bytes` and runs at most `seconds` (inf: any
        time), or None when not even one row (one reference-length sequence) would."""
        def most(unit_bytes: int, unit_seconds: float, limit: int) -> int:
            by_memory = free_bytes // unit_bytes if unit_bytes > 0 else limit
            by_time = int(seconds / unit_seconds) if unit_seconds > 0 and seconds < math.inf else limit
            return min(limit, by_memory, by_time)

        if self.reference_tokens:
            tokens = most(self.bytes_per_token, self.seconds_per_row / self.reference_tokens, self.full_tokens)
            smallest = min(self.reference_tokens, self.full_tokens)
            if tokens < smallest:
                return None
            return Admission(model, self.max_rows, tokens, cut=True, budget_bytes=free_bytes, budget_seconds=seconds)
        rows = most(self.bytes_per_row, self.seconds_per_row, self.max_rows)
        if rows < 1:
            return None
        return Admission(model, rows, self.max_tokens, cut=True, budget_bytes=free_bytes, budget_seconds=seconds)


@dataclass(frozen=True)
class Admission:
    """A model a free stream slot may lease from now, and the most rows and tokens its batch may take."""

    model: str
    max_rows: int
    max_tokens: int
    """0: no token limit."""
    cut: bool = False
    """The batch is cut to free memory (or to end in time): it must not outgrow its limits, not
    even by its first request, and takes no job chunk along."""
    budget_bytes: int = field(default=0, compare=False)
    """A cut batch's memory budget, and the time it must end in (inf: any): a job chunk leased under
    it runs only if its mini-batches fit both (see `Claim`)."""
    budget_seconds: float = field(default=math.inf, compare=False)
    claim: Claim | None = field(default=None, compare=False)
    """The claim of the job chunk at the head of the model's queue, if one is known."""
    whole_within: tuple[int, int] | None = None
    """(Rows, tokens; 0: no token limit): the batch formed under `max_rows` and `max_tokens` is
    leased only if it stays within these, else nothing (the head of the priority order when its full
    batch does not fit: what waits for it may; see `queues.lease_batch`)."""

    def reserved_size(self) -> tuple[int, int]:
        """(Rows, tokens) the decision holds memory for: the most this admission can lease."""
        return self.whole_within or (self.max_rows, self.max_tokens)

    def allows_chunk(self, need_bytes: int, seconds: float) -> bool:
        """Does a job chunk needing `need_bytes` for `seconds` stay within this admission's cut?"""
        return not self.cut or (need_bytes <= self.budget_bytes and seconds <= self.budget_seconds)


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
        return item_id is not None and item_id.startswith(f"{self.job_id}:c")


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


def admit(ordered: Sequence[str], cost_of: Callable[[str], BatchCost], ledger: MemoryLedger, *, now: float,
          backfill: bool, head_items: Mapping[str, str] | None = None) -> list[Admission]:
    """The batches a free stream slot may lease from now, in order, each with its row and token limits.

    The head (first in `ordered`) with its full limits when its full batch fits (the others, tried
    when the head's queue is empty by the time the slot leases, cut to the free memory). Otherwise
    the head all or nothing (`Admission.whole_within`: the batch waiting for it, if that fits the
    free memory), and, with `backfill`, then every model, the head's own included, with a batch cut by its
    profile to the free memory and to end before the head's full batch could start, or to the
    memory the head leaves free beside it then (no time limit): either way the head is not delayed.
    The lease always takes the first waiting request, so a token limit can be passed by one request.

    `head_items` (model -> id of the item heading its queue) lets a `Claim` count: a model whose
    queue is headed by a claimed chunk needs the chunk's bytes (as the head, or to be admitted
    beside it), and is admitted around only where the chunk fits and ends in time.
    """
    if not ordered:
        return []
    claims = {model: claim for model in ordered
              if (claim := ledger.claim_of(model, (head_items or {}).get(model))) is not None}
    head_cost = cost_of(ordered[0])
    head_need = max(head_cost.full_need(), claims[ordered[0]].need_bytes if ordered[0] in claims else 0)
    free = ledger.whole_units(ledger.free_bytes())
    if ledger.fits(head_need):
        head = Admission(ordered[0], head_cost.max_rows, head_cost.max_tokens, claim=claims.get(ordered[0]))
        others = (_cut(model, cost_of(model), claims.get(model), free, math.inf) for model in ordered[1:])
        return [head, *(admission for admission in others if admission)]
    formed = _whole(ordered[0], head_cost, claims.get(ordered[0]), free)
    if formed is not None:  # what happens is known after the lease: the slot counts it (`count_lease`)
        return [formed, *(_backfills(ordered, cost_of, ledger, claims, free, head_need, now) if backfill else [])]
    if not backfill:
        ledger.count("memory_waits")
        return []
    admitted = _backfills(ordered, cost_of, ledger, claims, free, head_need, now)
    ledger.count("backfills" if admitted else "memory_waits")
    return admitted


def count_lease(ledger: MemoryLedger, allowed: Sequence[Admission], leased: Admission | None) -> None:
    """Count what a slot got from admissions headed by a whole one (`admit` cannot know): nothing
    when the head's waiting batch ran, a backfill when a batch around it did, a memory wait when
    nothing was leased (or the queue emptied meanwhile)."""
    if not allowed or allowed[0].whole_within is None or leased is allowed[0]:
        return
    ledger.count("backfills" if leased is not None else "memory_waits")


def _backfills(ordered: Sequence[str], cost_of: Callable[[str], BatchCost], ledger: MemoryLedger,
               claims: Mapping[str, Claim], free: int, head_need: int, now: float) -> list[Admission]:
    """Every model's batch cut to not delay the head: to end before its full batch could start, or to
    the memory it leaves free beside it then."""
    start, beside = ledger.head_window(head_need, now=now)
    admitted = []
    for model in ordered:
        cost, claim = cost_of(model), claims.get(model)
        in_time = _cut(model, cost, claim, free, start - now)
        beside_head = _cut(model, cost, claim, min(free, ledger.whole_units(beside)), math.inf)
        choices = [admission for admission in (in_time, beside_head) if admission]
        if choices:  # both cut the same model, so the larger is the one with more rows, then tokens
            admitted.append(max(choices, key=lambda admission: (admission.max_rows, admission.max_tokens)))
    return admitted


def _whole(model: str, cost: BatchCost, claim: Claim | None, free_bytes: int) -> Admission | None:
    """The head's batch all or nothing: formed under its full limits, leased only if it stays within
    the rows and tokens that fit `free_bytes`; None when not even one row would, or when a claimed
    chunk heads the model's queue (its need is known: the head's full need counted it)."""
    if claim is not None:
        return None
    fitting = cost.within(model, free_bytes, math.inf)
    if fitting is None:
        return None
    return Admission(model, cost.max_rows, cost.max_tokens, cut=True, budget_bytes=free_bytes,
                     whole_within=(fitting.max_rows, fitting.max_tokens))


def _cut(model: str, cost: BatchCost, claim: Claim | None, free_bytes: int, seconds: float) -> Admission | None:
    """`cost.within(...)`, refused when the model's queue is headed by a claimed chunk that would not fit it."""
    if claim is not None and (claim.need_bytes > free_bytes or claim.seconds > seconds):
        return None
    admission = cost.within(model, free_bytes, seconds)
    return replace(admission, claim=claim) if admission is not None and claim is not None else admission


def admit_and_hold(ordered: Sequence[str], cost_of: Callable[[str], BatchCost], ledger: MemoryLedger, *,
                   now: float, backfill: bool,
                   head_items: Mapping[str, str] | None = None) -> tuple[list[Admission], int | None]:
    """`admit`, and a reservation held at once for the largest admitted batch (its handle, or None):
    the slot leases the first of them whose queue still has work.

    A slot leases its batch a Redis round trip after the decision; without the hold, another slot
    of the worker deciding meanwhile would see the same memory free and admit a batch on it too.
    The slot swaps the hold for its real batch's reservation once leased (`MemoryLedger.fits(instead_of=)`),
    or releases it when it leased nothing.
    """
    with ledger.deciding:
        allowed = admit(ordered, cost_of, ledger, now=now, backfill=backfill, head_items=head_items)
        if not allowed:
            return allowed, None
        needs = []
        for admission in allowed:
            cost = cost_of(admission.model)
            rows, most_tokens = admission.reserved_size()
            tokens = most_tokens or None
            needs.append((cost.need_bytes(rows=rows, tokens=tokens), cost.seconds(rows=rows, tokens=tokens)))
            if admission.claim is not None:
                needs.append((admission.claim.need_bytes, admission.claim.seconds))
        need, seconds = max(needs)
        return allowed, ledger.reserve(need, now=now, expected_seconds=seconds, hold=True)
