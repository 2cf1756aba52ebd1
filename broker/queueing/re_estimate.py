"""The beat's re-scoring: waiting requests re-estimated when their model's profile moved, and PSA for every queue.

Aging lives in the static key (`scoring.py`), so time passing re-scores nothing. What does need a re-score is
an input fixed at submit that has moved since: a request's `est_latency_ms` comes from its model's record as
intake read it, and an observed profile (`sits_worker/device/observed_profiles.py`) or a re-profile replaces
that record while the request waits. A pass (`rescore_queues`, sent by the beat every `beat.rescore_every`)
estimates each waiting request again from the current record, as intake would now, and writes the new
estimate where it moved by more than `TOLERANCE`, re-scored in the same step (`re_estimate.lua`, a
compare-and-set per item), a bounded slice at a time. Then it runs PSA for every queue with an item near its
deadline, as a drain loop does before each batch choice: a queue no drain loop looks at (its slots all busy
with long chunks) still jumps. docs/scheduling.md, "The beat's re-scoring".

Only online requests carry an estimate: a job's chunks are scored without one (`jobs.records.job_factors`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from broker.errors import ModelNotFound
from broker.models import registry
from broker.models.cache import API_RECORD_TTL_SECONDS
from broker.models.model_record import ModelRecord
from broker.queueing import policy
from broker.queueing.scoring import Ordering, Weights, estimate_latency_ms
from broker.state.store import Store, translate_redis_errors

TOLERANCE = 0.10
"""A stored estimate is rewritten when the current one differs from it by more than this share of it: an
observed profile moves a little at every flush, and a re-score per flush would buy nothing."""
SLICE = 32
"""Requests per ZSCAN step and per `re_estimate.lua` call (what `policy.rescore_all` walks per call)."""
SETTLE_SECONDS = API_RECORD_TTL_SECONDS + 1.0
"""How long after a pass first sees a model's new profile its queue is walked again: an API process may score
with the record it cached before for `API_RECORD_TTL_SECONDS`, and its submit may reach Redis a moment later."""
LATENCY, PSA = "latency", "psa"
"""Why an item moved (`rescore_moved_<reason>` in `keys.counters`, `sits_rescore_moved_items_total`)."""


@dataclass(frozen=True)
class StaleEstimate:
    """A waiting request whose estimate moved: as stored (None: none) and as its model's record says now."""

    item_id: str
    stored_ms: float | None
    new_ms: float


@dataclass(frozen=True)
class WalkMark:
    """The profile a queue was last walked for, and until when it is walked again all the same."""

    fingerprint: str
    walk_until: float
    settled: bool = False
    """A walk that started after `walk_until` is complete: the queue needs none until the profile moves."""


@dataclass
class ModelMoves:
    """What one pass did to one model's waiting items."""

    re_estimated: int = 0
    moved_ahead: int = 0
    """Re-estimated items whose score fell: they now wait nearer the head."""
    moved_back: int = 0
    largest_move_points: float = 0.0
    """The largest change of one item's priority points (its score's change)."""
    psa_jumps: int = 0


@dataclass
class RescoreReport:
    """What one pass looked at and moved; JSON for the Celery task's result (Flower shows it)."""

    models_looked_at: int = 0
    models_walked: list[str] = field(default_factory=list)
    calls: int = 0
    """`re_estimate.lua` calls made."""
    largest_call_items: int = 0
    moves: dict[str, ModelMoves] = field(default_factory=dict)

    def total(self, what: str) -> int:
        """The sum over models of a `ModelMoves` count."""
        return sum(getattr(moves, what) for moves in self.moves.values())

    def to_json(self) -> dict[str, Any]:
        """Totals first, then each model that moved."""
        return {"models_looked_at": self.models_looked_at, "models_walked": self.models_walked,
                **{what: self.total(what) for what in ("re_estimated", "moved_ahead", "moved_back", "psa_jumps")},
                "largest_move_points": max((m.largest_move_points for m in self.moves.values()), default=0.0),
                "calls": self.calls, "largest_call_items": self.largest_call_items,
                "by_model": {ref: asdict(moves) for ref, moves in sorted(self.moves.items())}}


def profile_fingerprint(record: ModelRecord) -> str:
    """A digest of what `estimate_latency_ms` reads of `record`: equal digests give equal estimates."""
    read = [record.profile_points, (record.profile or {}).get("sequence_length"), record.token_model,
            record.static_profile.get("flops_per_sample")]
    return hashlib.sha1(json.dumps(read, sort_keys=True, default=str).encode()).hexdigest()[:16]


def walk_plan(mark: WalkMark | None, fingerprint: str, *, now: float, settle_seconds: float) -> WalkMark | None:
    """The mark to keep once a walk started at `now` is complete; None: no walk needed.

    A new profile is walked at every pass for `settle_seconds` from when a pass first saw it, since intake may
    still score with the old one that long; one walk that starts after that is the last it needs."""
    if mark is None or mark.fingerprint != fingerprint:
        return WalkMark(fingerprint, now + settle_seconds)
    if mark.settled:
        return None
    return WalkMark(fingerprint, mark.walk_until, settled=now > mark.walk_until)


def estimate_moved(stored_ms: float | None, new_ms: float, tolerance: float) -> bool:
    """Whether `new_ms` differs from the stored estimate by more than `tolerance` of it (none stored: yes)."""
    return stored_ms is None or abs(new_ms - stored_ms) > tolerance * max(stored_ms, 1e-9)


def stale_estimates(payloads: Mapping[str, str | None], record: ModelRecord, *,
                    tolerance: float) -> list[StaleEstimate]:
    """The requests among `payloads` (item id -> payload JSON; None: gone) whose estimate, made again from
    `record` as intake makes it, moved by more than `tolerance`."""
    stale = []
    for item_id, raw in payloads.items():
        item = json.loads(raw) if raw else None
        if not item or item.get("kind") != "request" or not isinstance(item.get("factors"), dict):
            continue
        stored = item["factors"].get("est_latency_ms")
        stored_ms = float(stored) if isinstance(stored, int | float) else None
        new_ms = estimate_latency_ms(record, rows=max(int(item.get("rows") or 1), 1), tokens=item.get("tokens"))
        if math.isfinite(new_ms) and estimate_moved(stored_ms, new_ms, tolerance):
            stale.append(StaleEstimate(item_id, stored_ms, new_ms))
    return stale


def rescore_queues(store: Store, *, now: float, default: Ordering, capacity_of: Callable[[str], int],
                   tolerance: float = TOLERANCE, count: int = SLICE,
                   settle_seconds: float = SETTLE_SECONDS) -> RescoreReport:
    """One pass over every queue with waiting items: re-estimate its requests where its model's profile moved
    since the last complete walk (or may still be met at intake), then PSA; the moves are counted for
    /metrics. Two passes at once are harmless: each item is re-estimated by one of them."""
    keys = store.keys
    refs, waiting, marks, earliest = _queue_state(store)
    raw_policy, weights, ordering = policy.LivePolicy(store, default=default).refresh()
    report = RescoreReport(models_looked_at=len(refs))
    gone = sorted(set(marks) - set(refs))  # (a version's queue pruned: its mark goes with it)
    if gone:
        with translate_redis_errors():
            store.client.hdel(keys.rescore_marks, *gone)
    for ref in refs:
        try:
            record = registry.get_model(store, ref)
        except ModelNotFound:
            continue  # (a version deleted with items still queued: nothing to estimate them from)
        mark = walk_plan(marks.get(ref), profile_fingerprint(record), now=now, settle_seconds=settle_seconds)
        if mark is None:
            continue
        if ref in waiting:  # (with none waiting the walk is complete at once: only the mark is kept)
            report.models_walked.append(ref)
        if ref not in waiting or _walk(store, ref, record, raw_policy, weights, ordering, report,
                                       tolerance=tolerance, count=count):
            with translate_redis_errors():
                store.client.hset(keys.rescore_marks, ref, json.dumps(asdict(mark)))
    horizon = now + weights.psa_rtd_ms / 1000
    for ref in refs:
        if ref in earliest and earliest[ref] < horizon:  # (the drain loop's test: `policy.psa_pass`)
            jumped = policy.apply_psa(store, ref, weights, ordering, now=now, capacity=capacity_of(ref))
            if jumped:
                report.moves.setdefault(ref, ModelMoves()).psa_jumps += len(jumped)
    _count(store, report)
    return report


def _queue_state(store: Store) -> tuple[list[str], set[str], dict[str, WalkMark], dict[str, float]]:
    """(Every queue's ref, those with waiting requests, each one's walk mark, each one's earliest deadline),
    read in one pipeline."""
    keys = store.keys
    with translate_redis_errors():
        refs = sorted(store.client.smembers(keys.queues))
        pipe = store.client.pipeline(transaction=False)
        for ref in refs:
            pipe.zcard(keys.waiting_requests(ref))
            pipe.zrange(keys.deadlines(ref), 0, 0, withscores=True)
        pipe.hgetall(keys.rescore_marks)
        *replies, stored_marks = pipe.execute()
    waiting = {ref for ref, requests in zip(refs, replies[0::2], strict=True) if requests}
    earliest = {ref: float(first[0][1]) for ref, first in zip(refs, replies[1::2], strict=True) if first}
    marks = {ref: WalkMark(**json.loads(raw)) for ref, raw in stored_marks.items()}
    return refs, waiting, marks, earliest


def _walk(store: Store, ref: str, record: ModelRecord, raw_policy: str, weights: Weights, ordering: Ordering,
          report: RescoreReport, *, tolerance: float, count: int) -> bool:
    """Re-estimate `ref`'s waiting requests, a ZSCAN step at a time; False when the live policy changed
    meanwhile (the walk stops; the next pass walks again with the new one)."""
    keys = store.keys
    cursor: int | str = 0
    with translate_redis_errors():
        while True:
            cursor, scanned = store.client.zscan(keys.waiting_requests(ref), cursor, count=count)
            ids = [item_id for item_id, _ in scanned]
            payloads = dict(zip(ids, store.client.hmget(keys.items, ids), strict=True)) if ids else {}
            for part in _slices(stale_estimates(payloads, record, tolerance=tolerance), count):
                moved = write_estimates(store, ref, part, raw_policy, weights, ordering)
                report.calls += 1
                report.largest_call_items = max(report.largest_call_items, len(part))
                if moved is None:
                    return False
                _note_moves(report.moves.setdefault(ref, ModelMoves()), moved)
            if int(cursor) == 0:
                return True


def write_estimates(store: Store, ref: str, stale: Sequence[StaleEstimate], raw_policy: str, weights: Weights,
                    ordering: Ordering) -> list[tuple[str, float, float]] | None:
    """Write the new estimates of `stale` (one `re_estimate.lua` call: keep it to a slice) and re-score those
    items, each only while it waits with the estimate read; returns (id, score before, score now) of each
    written, or None when the live policy is no longer `raw_policy` (nothing written)."""
    keys = store.keys
    # repr: the shortest text that reads back as the same double, so Lua compares equal numbers
    expected = [(item.item_id, "" if item.stored_ms is None else repr(item.stored_ms), repr(item.new_ms))
                for item in stale]
    with translate_redis_errors():
        reply = store.scripts.re_estimate(keys=[keys.ready(ref), keys.items, keys.policy],
                                          args=[raw_policy, ordering, *policy._weight_args(weights),  # (its order)
                                                *(arg for triple in expected for arg in triple)])
    if not int(reply[0]):
        return None
    return [(str(item_id), float(before), float(after))
            for item_id, before, after in zip(reply[1::3], reply[2::3], reply[3::3], strict=True)]


def _slices(stale: Sequence[StaleEstimate], count: int) -> Iterator[Sequence[StaleEstimate]]:
    for start in range(0, len(stale), max(count, 1)):
        yield stale[start:start + max(count, 1)]


def _note_moves(moves: ModelMoves, written: Sequence[tuple[str, float, float]]) -> None:
    for _, before, after in written:
        change = after - before
        moves.re_estimated += 1
        moves.moved_ahead += change < 0
        moves.moved_back += change > 0
        moves.largest_move_points = max(moves.largest_move_points, round(abs(change), 6))


def _count(store: Store, report: RescoreReport) -> None:
    """Add the pass's moves to the running totals /metrics reads (`keys.counters`)."""
    counts = {f"rescore_moved_{LATENCY}:{ref}": moves.moved_ahead + moves.moved_back
              for ref, moves in report.moves.items()}
    counts |= {f"rescore_moved_{PSA}:{ref}": moves.psa_jumps for ref, moves in report.moves.items()}
    counts = {name: total for name, total in counts.items() if total}
    if counts:
        with translate_redis_errors():
            pipe = store.client.pipeline(transaction=False)
            for name, total in counts.items():
                pipe.hincrby(store.keys.counters, name, total)
            pipe.execute()
