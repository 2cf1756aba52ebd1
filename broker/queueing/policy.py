"""The live scoring policy: CP-Score weights and the queue ordering, hot-updatable.

Stored as one JSON string in Redis so every API process scores new items
with the same weights the re-score applied to waiting ones.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import fields

from broker.errors import BadInput
from broker.queueing.queues import QueueSnapshot
from broker.queueing.scoring import Ordering, Weights
from broker.state.store import Store, translate_redis_errors

ORDERINGS = ("fifo", "dynamic")
log = logging.getLogger(__name__)


def default_ordering(policy_name: str) -> Ordering:
    """The `fifo` scheduler policy orders by arrival; the others by dynamic priority."""
    return "fifo" if policy_name == "fifo" else "dynamic"


def get_policy(store: Store, *, default: Ordering) -> tuple[Weights, Ordering]:
    """The live weights and ordering (defaults until someone set them)."""
    return _decode_policy(read_raw_policy(store), default)


def read_raw_policy(store: Store) -> str:
    """The live policy exactly as stored ('' until someone set one)."""
    with translate_redis_errors():
        return store.client.get(store.keys.policy) or ""


class LivePolicy:
    """The live policy as this process last read it, for the submit hot path.

    Submitting passes the raw JSON it scored with to the submit script, which refuses the item
    when the stored policy differs (`requests.PolicyChanged`); the caller then calls `refresh`
    and scores again. So no read per request, and still no item queued with a replaced policy.
    """

    def __init__(self, store: Store, *, default: Ordering) -> None:
        self._store, self._default = store, default
        self._current: tuple[str, Weights, Ordering] | None = None

    def current(self) -> tuple[str, Weights, Ordering]:
        """(raw JSON, weights, ordering) as last read; read now if never read."""
        return self._current or self.refresh()

    def refresh(self) -> tuple[str, Weights, Ordering]:
        """Read the live policy again (after a submit was refused for a changed policy)."""
        raw = read_raw_policy(self._store)
        self._current = (raw, *_decode_policy(raw, self._default))
        return self._current


@functools.lru_cache(maxsize=32)
def _decode_policy(raw: str | None, default: Ordering) -> tuple[Weights, Ordering]:
    """The stored policy; a weight that is out of range (stored by a version that did not check, e.g. a
    NaN written back as null) reads as its default, so scoring and `PUT /v1/policy` keep working.

    Cached by the raw JSON (Weights are frozen): drain loops decode the policy they read on every
    look at the queues, and a bad stored value is logged once, not every millisecond."""
    if not raw:
        return Weights(), default
    data = json.loads(raw)
    values = Weights().to_dict()
    for name, value in data["weights"].items():
        if name not in values:
            continue
        try:
            values[name] = _policy_value(name, value, integral=isinstance(values[name], int))
        except BadInput as err:
            log.warning("stored policy: %s; using the default %r", err, values[name])
    ordering = data.get("ordering")
    return Weights(**values), ordering if ordering in ORDERINGS else default


POLICY_RANGES: dict[str, tuple[float, float]] = {
    "alpha": (0, 1000), "beta": (0, 1000), "gamma": (0, 1000),
    "delta": (0, 1000),  # points per second of waiting, times epoch seconds in the sort key: kept far from overflow
    "express_level": (0, 16),  # 16: no level is express
    "express_max_tokens": (0, 10**9),
    "express_bonus": (0, 10**9),
    "psa_rtd_ms": (0, 10**7),
    "psa_load": (0, 1),  # a share of the queue's capacity
    "psa_max_base_level": (0, 16),  # 16: every level below it may jump
}
"""The values `PUT /v1/policy` accepts for each weight and threshold, inclusive: scores must stay
finite and sortable (a NaN or overflowing weight would make every enqueue's Lua call fail)."""


def parse_policy_update(body: dict, current: Weights, ordering: Ordering) -> tuple[Weights, Ordering]:
    """Merge a `PUT /v1/policy` body into the current policy; BadInput names a wrong key or value."""
    known = {field.name for field in fields(Weights)}
    unknown = set(body) - known - {"ordering"}
    if unknown:
        raise BadInput(f"unknown policy keys {sorted(unknown)}; known: ordering, {', '.join(sorted(known))}")
    new_ordering = body.get("ordering", ordering)
    if new_ordering not in ORDERINGS:
        raise BadInput(f"ordering must be one of {ORDERINGS}, got {new_ordering!r}")
    values = current.to_dict()
    for name in sorted(set(body) & known):
        values[name] = _policy_value(name, body[name], integral=isinstance(values[name], int))
    return Weights(**values), new_ordering


def _policy_value(name: str, value: object, *, integral: bool) -> float | int:
    """`value` for policy key `name`, checked against `POLICY_RANGES`; BadInput says what is allowed."""
    low, high = POLICY_RANGES[name]
    kind = "a whole number" if integral else "a number"
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or not low <= value <= high or (integral and value != int(value))):
        raise BadInput(f"policy key '{name}' must be {kind} from {low:g} to {high:g}, got {value!r}")
    return int(value) if integral else float(value)


def save_policy(store: Store, weights: Weights, ordering: Ordering) -> None:
    """Make `weights` and `ordering` the live policy (new items are scored with them at once)."""
    with translate_redis_errors():
        store.client.set(store.keys.policy, json.dumps({"weights": weights.to_dict(), "ordering": ordering}))


def rescore_all(store: Store, weights: Weights, ordering: Ordering, *, count: int = 32,
                settle_seconds: float = 0.1) -> dict[str, float]:
    """Re-score every waiting item (and every leased item's payload) in bounded slices.

    Each call to the `rescore` script walks about `count` members (32: about 0.35 ms of Redis time
    measured on 2 vCPUs, against the 5 ms bound), so Redis is never blocked for long and enqueue
    and lease go on between calls. Call after `save_policy`. An enqueue that read the old policy
    just before it was saved may write its item after the first walk passed that spot, so a second
    walk runs, starting at least `settle_seconds` after the first began: an enqueue takes about a
    millisecond from reading the policy to its Lua call. Returns how many items were re-scored, in
    how many calls, and the longest call seen from the client (round trip included).
    """
    started = time.monotonic()
    first = _walk(store, weights, ordering, count)
    time.sleep(max(0.0, settle_seconds - (time.monotonic() - started)))
    second = _walk(store, weights, ordering, count)
    return {"rescored": first["rescored"], "calls": first["calls"] + second["calls"],
            "longest_call_ms": max(first["longest_call_ms"], second["longest_call_ms"]),
            "largest_call_items": max(first["largest_call_items"], second["largest_call_items"])}


def _walk(store: Store, weights: Weights, ordering: Ordering, count: int) -> dict[str, float]:
    keys = store.keys
    rescored = calls = largest = 0
    longest = 0.0
    weight_args = _weight_args(weights)
    with translate_redis_errors():
        for ref in sorted(store.client.smembers(keys.queues)):
            for kind, queue in (("ready", keys.ready(ref)), ("inflight", keys.inflight(ref))):
                cursor = "0"
                while True:
                    began = time.perf_counter()
                    cursor, done = store.scripts.rescore(keys=[queue, keys.items],
                                                         args=[cursor, count, kind, ordering, *weight_args])
                    longest = max(longest, time.perf_counter() - began)
                    rescored += int(done)
                    largest = max(largest, int(done))
                    calls += 1
                    if str(cursor) == "0":
                        break
    return {"rescored": rescored, "calls": calls, "longest_call_ms": round(longest * 1000, 3),
            "largest_call_items": largest}


def _weight_args(weights: Weights) -> list[float]:
    return [weights.alpha, weights.beta, weights.gamma, weights.delta, weights.express_level,
            weights.express_max_tokens, weights.express_bonus]


def apply_psa(store: Store, model_ref: str, weights: Weights, ordering: Ordering, *, now: float,
              capacity: int) -> list[str]:
    """PSA priority jumps for one model's waiting items; returns the ids that jumped (now re-scored)."""
    keys = store.keys
    with translate_redis_errors():
        reply = store.scripts.psa_jump(
            keys=[keys.deadlines(model_ref), keys.ready(model_ref), keys.inflight(model_ref), keys.items],
            args=[now, weights.psa_rtd_ms, weights.psa_load, weights.psa_max_base_level, max(capacity, 1)],
        )
        jumped = [str(item_id) for item_id in reply[1:]]
    rescore_items(store, model_ref, jumped, weights, ordering)
    return jumped


def rescore_items(store: Store, model_ref: str, item_ids: list[str], weights: Weights, ordering: Ordering) -> None:
    """Re-score the waiting items `item_ids` of `model_ref` from their payloads' factors (after a PSA
    jump or a `delay` timeout changed their level); an id no longer waiting is not queued again."""
    if item_ids:
        with translate_redis_errors():
            store.scripts.rescore(keys=[store.keys.ready(model_ref), store.keys.items],
                                  args=["0", 0, "ids", ordering, *_weight_args(weights), *item_ids])


def model_order(heads: dict[str, float], policy_name: str, last_served: str | None) -> list[str]:
    """The order in which a free stream slot tries the model queues that have waiting work.

    `fifo` and `graph-aware-backfill` take the model whose head item has the best score first
    (the head of the global priority order); `round-robin` starts with the model after the one
    served last, in name order, so every model with work gets turns.
    """
    if policy_name != "round-robin":
        return sorted(heads, key=heads.__getitem__)
    names = sorted(heads)
    if last_served is None:
        return names
    start = next((i for i, name in enumerate(names) if name > last_served), 0)
    return names[start:] + names[:start]


def psa_pass(store: Store, snapshot: QueueSnapshot, capacity_of: Callable[[str], int], *, default: Ordering,
             now: float) -> bool:
    """PSA for every model with a waiting item near its deadline; True if any item jumped.

    The snapshot (one round trip, taken by the drain loop anyway) carries the live policy and each
    model's earliest deadline, so a drain loop with no urgent item pays nothing more for PSA.
    """
    weights, ordering = _decode_policy(snapshot.raw_policy, default)
    horizon = now + weights.psa_rtd_ms / 1000
    due = [ref for ref, first in snapshot.earliest_deadlines.items() if first < horizon]
    return any([apply_psa(store, ref, weights, ordering, now=now, capacity=capacity_of(ref)) for ref in due])
