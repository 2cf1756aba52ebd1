"""Priority scores: the sort key of a ready queue (lower is served first).

CP-Score (docs/scheduling.md, "CP-Score"): an item's priority points are
`level + α·(100 ms / estimated latency, at most 10) + β·SLA weight + γ·complexity`,
where level is its priority 0-15 (raised by PSA jumps), the SLA weight is
vip 3 / premium 2 / free 1 and complexity is in [0, 1] (sequence length
relative to the model's maximum). Aging adds `δ` points per second waited.

Aging lives in the static key: points + δ·age = points − δ·enqueued_at + δ·now,
and δ·now is the same for every item at any instant, so ordering by
`δ·enqueued_at − points` (ascending) is ordering by current priority, for
every instant, without re-scoring anything because time passed. Express
items (level ≥ 12, or a token request shorter than 128 tokens) get a bonus
that puts them ahead of everything else.

Under the `fifo` ordering the key is the enqueue time alone. Items with equal
keys are ordered by member (Redis compares bytes); chunk ids are zero-padded,
so a job's chunks wait in row order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from broker.models.model_record import ModelRecord
from broker.setting_types import MAX_PRIORITY, UserTier

SLA_WEIGHTS: dict[UserTier, float] = {"vip": 3.0, "premium": 2.0, "free": 1.0}
_EPOCH = 1_704_067_200.0  # 2024-01-01T00:00:00Z; keeps keys small and exact in a double
_LATENCY_UNIT_MS = 100.0
_MAX_LATENCY_POINTS = 10.0

Ordering = Literal["fifo", "dynamic"]


@dataclass(frozen=True)
class Weights:
    """The hot-updatable weights and thresholds of CP-Score, express lane and PSA."""

    alpha: float = 0.4
    beta: float = 0.3
    gamma: float = 0.2
    delta: float = 0.1
    """Priority points gained per second of waiting."""
    express_level: int = 12
    express_max_tokens: int = 128
    express_bonus: float = 1000.0
    psa_rtd_ms: float = 200.0
    psa_load: float = 0.75
    psa_max_base_level: int = 8

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (stored in Redis, served by the API)."""
        return asdict(self)


@dataclass(frozen=True)
class Factors:
    """What an item's score is computed from; kept in its payload so it can be re-scored."""

    level: int
    sla_weight: float = 1.0
    est_latency_ms: float = math.inf
    complexity: float = 0.0
    enqueued_at: float = 0.0
    tokens: int | None = None
    order_at: float | None = None
    """The arrival time the dynamic key ages from, when it is not `enqueued_at`: a job with a deadline
    waits as if it had come `deadline_horizon` before its deadline (`deadline_order_time`)."""
    max_level: int = MAX_PRIORITY
    """Its tenant's `max_priority`: neither a PSA jump nor its deadline lifts it past this level
    (`psa_jump_level`, `deadline_reach`). Kept in the payload only when below 15."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (infinite latency as null)."""
        # spelled out rather than dataclasses.asdict, which deep-copies field by field: this runs on every request
        return {"level": self.level, "sla_weight": self.sla_weight,
                "est_latency_ms": None if math.isinf(self.est_latency_ms) else self.est_latency_ms,
                "complexity": self.complexity, "enqueued_at": self.enqueued_at, "tokens": self.tokens,
                **({"order_at": self.order_at} if self.order_at is not None else {}),
                **({"max_level": self.max_level} if self.max_level < MAX_PRIORITY else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Factors:
        """The inverse of `to_dict`."""
        latency = data.get("est_latency_ms")
        return cls(level=int(data["level"]), sla_weight=float(data.get("sla_weight", 1.0)),
                   est_latency_ms=math.inf if latency is None else float(latency),
                   complexity=float(data.get("complexity", 0.0)), enqueued_at=float(data.get("enqueued_at", 0.0)),
                   tokens=data.get("tokens"),
                   order_at=float(data["order_at"]) if data.get("order_at") is not None else None,
                   max_level=int(data.get("max_level", MAX_PRIORITY)))


def priority_points(factors: Factors, weights: Weights) -> float:
    """CP-Score without aging: higher is more urgent."""
    latency_points = min(_LATENCY_UNIT_MS / max(factors.est_latency_ms, 1e-3), _MAX_LATENCY_POINTS)
    return (factors.level + weights.alpha * latency_points + weights.beta * factors.sla_weight
            + weights.gamma * factors.complexity)


def is_express(factors: Factors, weights: Weights) -> bool:
    """Urgent (level ≥ express_level) or a short token request: served at the next free slot.

    The express lane is a priority: a short request of a tenant whose `max_priority` is below
    `express_level` waits as its level says, for its tenant may not ask that lane's priority."""
    short = (factors.tokens is not None and factors.tokens < weights.express_max_tokens
             and factors.max_level >= weights.express_level)
    return factors.level >= weights.express_level or short


def queue_key(factors: Factors, weights: Weights, ordering: Ordering = "dynamic") -> float:
    """The ready-queue score of an item (ascending = served first)."""
    if ordering == "fifo":
        return factors.enqueued_at - _EPOCH
    key = weights.delta * (aging_since(factors, weights) - _EPOCH) - priority_points(factors, weights)
    return key - weights.express_bonus if is_express(factors, weights) else key


def deadline_order_time(enqueued_at: float, deadline_at: float, horizon: float, reach: float = math.inf) -> float:
    """When an item with a deadline counts as having arrived, for aging: `horizon` seconds before its
    deadline, or when it came if that is earlier. Items whose deadlines fall within the horizon are
    so ordered by deadline (EDF) among equal priority points, and gain up to δ·horizon points as their
    deadline nears; one whose deadline is further away waits in arrival order, so no later arrival of
    its level passes it before its time.

    `reach` (`deadline_reach`) shortens the horizon of a capped tenant's item: its deadlines still
    order its items EDF within that shorter horizon, and gain at most what its cap allows."""
    return min(enqueued_at, deadline_at - min(horizon, reach))


def deadline_reach(level: int, max_level: int, delta: float) -> float:
    """How far ahead (seconds) a deadline may order an item of `level` whose tenant is capped at
    `max_level`: (max_level − level) / δ, so its deadline gains it at most the points of asking its
    cap. A tenant capped at the level it asks so gains nothing from deadlines (they cannot lift its
    work above other tenants' work of a higher level it may not ask). Uncapped (15): no limit."""
    if max_level >= MAX_PRIORITY or delta <= 0:
        return math.inf
    return max(max_level - level, 0) / delta


def aging_since(factors: Factors, weights: Weights) -> float:
    """The arrival time an item ages from: `order_at` if it has one, else `enqueued_at`; never more
    than `deadline_reach` before `enqueued_at`, so a capped item keeps within its cap when a hot
    update raises δ or its level rose after its `order_at` was set."""
    if factors.order_at is None:
        return factors.enqueued_at
    reach = deadline_reach(factors.level, factors.max_level, weights.delta)
    return max(factors.order_at, factors.enqueued_at - reach)


def current_priority(factors: Factors, weights: Weights, *, now: float) -> float:
    """Priority points including aging at `now` (what the static key orders by)."""
    return priority_points(factors, weights) + weights.delta * (now - aging_since(factors, weights))


def check_level(level: int) -> int:
    """`level` if it is a priority level 0-15, else ValueError."""
    if not 0 <= level <= MAX_PRIORITY:
        raise ValueError(f"priority must be between 0 and {MAX_PRIORITY}, got {level}")
    return level


def estimate_latency_ms(record: ModelRecord, *, rows: int, tokens: int | None) -> float:
    """Estimated run time of `rows` rows from the model's profile.

    Measured profile first: the latency measured at that batch size, interpolated between the
    measured sizes (so the batching gain shows: on a GPU 64 rows may cost little more than one),
    per row of the largest one beyond it; for a token model batch-1 latency times its tokens over
    the profile's sequence length (rows of `sequence_length` tokens were measured). A token model
    without one costs about 1.2 ms per token + 120 ms (the specification's prior); otherwise the
    static FLOPs at an assumed 50 GFLOP/s.
    """
    points = record.profile_points
    token_model = record.token_model and tokens is not None
    if points:
        if token_model:
            one_row = float(points[0]["latency_ms"])
            return one_row * float(tokens or 0) / float((record.profile or {}).get("sequence_length") or 128)
        return _interpolated_ms(points, rows)
    if token_model:
        return 1.2 * float(tokens or 0) + 120.0
    return max(float(record.static_profile.get("flops_per_sample") or 0) * rows / 5e7, 0.01)


def rows_to_fill(record: ModelRecord, *, own_rows: int, available: int, max_rows: int, factor: float) -> int:
    """How many of `available` job rows may fill a batch of `own_rows` online rows: up to `max_rows`
    rows in all, while the batch's estimated time stays within `factor` times that of the online
    rows alone. Job rows so take only empty rows that are nearly free (a GPU's flat latency curve),
    and a request riding with a job waits about as long as in a batch of its own."""
    limit = estimate_latency_ms(record, rows=own_rows, tokens=None) * factor
    fill, room = 0, min(available, max_rows - own_rows)
    while fill < room and estimate_latency_ms(record, rows=own_rows + fill + 1, tokens=None) <= limit:
        fill += 1
    return fill


def _interpolated_ms(points: Sequence[Mapping[str, Any]], rows: int) -> float:
    """Latency of `rows` rows from measured (batch_size, latency_ms) points: linear between two sizes,
    per row of the nearest measured size outside them."""
    measured = sorted((int(point["batch_size"]), float(point["latency_ms"])) for point in points)
    below = [(size, ms) for size, ms in measured if size <= rows]
    above = [(size, ms) for size, ms in measured if size >= rows]
    if below and above:
        (low, low_ms), (high, high_ms) = below[-1], above[0]
        return low_ms if high == low else low_ms + (high_ms - low_ms) * (rows - low) / (high - low)
    size, ms = below[-1] if below else above[0]
    return ms * rows / size


def psa_jump_level(*, base_level: int, remaining_ms: float, queue_load: float, weights: Weights,
                   max_level: int = MAX_PRIORITY) -> int | None:
    """PSA: the level an item jumps to, or None.

    Jumps when the remaining tolerable delay is below `psa_rtd_ms`, the queue's load above
    `psa_load` and the base level below `psa_max_base_level`: to 15 under 100 ms, else 12, but never
    past its tenant's `max_level` (a near deadline is no way past the priority a tenant may ask), so
    not at all when that is not above its base level.
    """
    if (remaining_ms >= weights.psa_rtd_ms or queue_load <= weights.psa_load
            or base_level >= weights.psa_max_base_level or max_level <= base_level):
        return None
    return min(15 if remaining_ms < 100 else 12, max_level)
