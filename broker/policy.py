"""The live scoring policy: CP-Score weights and the queue ordering, hot-updatable.

Stored as one JSON string in Redis so every API process scores new items
with the same weights the re-score applied to waiting ones.
"""

from __future__ import annotations

import json
from dataclasses import fields

from broker.errors import BadInput
from broker.scoring import Ordering, Weights
from broker.store import Store, translate_redis_errors

ORDERINGS = ("fifo", "dynamic")


def default_ordering(policy_name: str) -> Ordering:
    """The `fifo` scheduler policy orders by arrival; the others by dynamic priority."""
    return "fifo" if policy_name == "fifo" else "dynamic"


def get_policy(store: Store, *, default: Ordering) -> tuple[Weights, Ordering]:
    """The live weights and ordering (defaults until someone set them)."""
    with translate_redis_errors():
        raw = store.client.get(store.keys.policy)
    if not raw:
        return Weights(), default
    data = json.loads(raw)
    return Weights(**data["weights"]), data["ordering"]


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
    for name in set(body) & known:
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise BadInput(f"policy key '{name}' must be a number >= 0, got {value!r}")
        values[name] = type(values[name])(value)
    return Weights(**values), new_ordering


def save_policy(store: Store, weights: Weights, ordering: Ordering) -> None:
    """Make `weights` and `ordering` the live policy (new items are scored with them at once)."""
    with translate_redis_errors():
        store.client.set(store.keys.policy, json.dumps({"weights": weights.to_dict(), "ordering": ordering}))
