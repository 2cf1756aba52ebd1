"""Which batches a free stream slot may lease, by their memory need (the graph-aware backfill
decision, EASY backfilling), on a worker's `ledger.MemoryLedger`.

A batch's need is its activation bytes from the model profile (per token for a token model, so a
token batch's reservation follows its token count, not a fixed batch size). When the full batch
of the model at the head of the priority order does not fit now, the batch that is really waiting
for it may still: the head is leased all or nothing, formed under its full limits and run only if
it fits the free memory (a queue of four requests needs four rows, not a full batch's worth).
Under `graph-aware-backfill` the head otherwise keeps its claim on a full batch: batches that
would not delay it may run, sized by the profile (bytes and seconds per row or token) to the
free memory and to end before the head's batch could start, or to the memory the head leaves free
beside it then. Inference batches are divisible, so a backfill batch is cut to the hole rather
than refused (the specification's "smaller batches from other models fill the remaining memory");
a part of the head model's own queue may go the same way. The other policies simply wait for
memory. Pure logic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from broker.memory.ledger import Claim, MemoryLedger
from broker.models.model_record import ModelRecord
from broker.queueing.scoring import estimate_latency_ms


def batch_need_bytes(static_profile: dict[str, Any], *, rows: int, tokens: int | None) -> int:
    """Activation memory of one batch from the static profile (per token for token models)."""
    return BatchCost.of(ModelRecord.of({"static_profile": static_profile}), max_rows=rows, max_tokens=0).need_bytes(
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
    def of(cls, record: ModelRecord, *, max_rows: int, max_tokens: int) -> BatchCost:
        """The cost of a registry record's batches: static activation bytes, profiled seconds per row."""
        static = record.static_profile
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
    batch does not fit: what waits for it may; see `leases.lease_batch`)."""

    def reserved_size(self) -> tuple[int, int]:
        """(Rows, tokens) the decision holds memory for: the most this admission can lease."""
        return self.whole_within or (self.max_rows, self.max_tokens)

    def allows_chunk(self, need_bytes: int, seconds: float) -> bool:
        """Does a job chunk needing `need_bytes` for `seconds` stay within this admission's cut?"""
        return not self.cut or (need_bytes <= self.budget_bytes and seconds <= self.budget_seconds)


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
