"""Online requests at the edge: validate tensors, score, queue, optionally wait for the result.

Shared by the v1 REST endpoint and the Open Inference Protocol (v2) endpoints,
which differ only in how tensors are spelled.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from broker import policy, registry, requests
from broker.config import Settings
from broker.requests import RequestSpec
from broker.scoring import SLA_WEIGHTS, Factors, estimate_latency_ms, queue_key
from broker.store import Store
from sits_api.dispatch import Dispatcher
from sits_worker.model.tensors import request_tensors

DEFAULT_MAX_SEQUENCE = 512


def submit(settings: Settings, store: Store, dispatcher: Dispatcher, *, model: str, inputs: dict[str, Any],
           priority: int, deadline_ms: float | None, user_tier: str, tokens: int | None, owner: str,
           now: float, request_id: str | None = None) -> RequestSpec:
    """Check the request against the model's signature, score it with the live policy and queue it."""
    record = _model_record(store, model, now=now)
    tensors = request_tensors(record["signature"], inputs)
    rows = next(iter(tensors.values())).shape[0]
    sequence = _sequence_length(record, tensors)
    if tokens is None and sequence is not None:
        tokens = sequence * rows
    factors = Factors(
        level=priority,
        sla_weight=SLA_WEIGHTS[user_tier],
        est_latency_ms=estimate_latency_ms(record, rows=rows, tokens=tokens),
        complexity=min(1.0, sequence / _max_sequence(record)) if sequence else 0.0,
        enqueued_at=now,
        tokens=tokens if sequence is not None else None,
    )
    weights, ordering = policy.get_policy(store, default=policy.default_ordering(settings.scheduler.policy))
    spec = RequestSpec(
        request_id=request_id or requests.new_request_id(),
        model_name=record["name"],
        model_version=record["version"],
        inputs=tensors,
        rows=rows,
        tokens=tokens,
        bucket=";".join(f"{name}:{'x'.join(map(str, array.shape[1:]))}" for name, array in sorted(tensors.items())),
        factors=factors.to_dict(),
        deadline_at=now + deadline_ms / 1000 if deadline_ms else None,
        owner=owner,
    )
    requests.submit_request(store, spec, score=queue_key(factors, weights, ordering), now=now,
                            max_age_seconds=max(settings.online.result_ttl, 3600))
    dispatcher.wake_workers()
    return spec


_RECORD_TTL_SECONDS = 2.0
_records: dict[str, tuple[float, dict[str, Any]]] = {}


def _model_record(store: Store, ref: str, *, now: float) -> dict[str, Any]:
    """The registry record, kept a moment per process: the hot path reads it on every request, and a
    bare name moves to a newly registered version (or a profile lands) within seconds anyway."""
    cached = _records.get(ref)
    if cached and now - cached[0] < _RECORD_TTL_SECONDS:
        return cached[1]
    record = registry.get_model(store, ref)
    _records[ref] = (now, record)
    return record


def wait_seconds(settings: Settings, deadline_ms: float | None) -> float:
    """How long a waiting call holds on: until the deadline, at most `online.max_wait`."""
    return min(deadline_ms / 1000, settings.online.max_wait) if deadline_ms else settings.online.max_wait


def _sequence_length(record: dict[str, Any], tensors: dict[str, np.ndarray]) -> int | None:
    axis = (record.get("static_profile") or {}).get("sequence_axis")
    if not axis or axis["input"] not in tensors:
        return None
    return int(tensors[axis["input"]].shape[axis["axis"]])


def _max_sequence(record: dict[str, Any]) -> int:
    static = record.get("static_profile") or {}
    value = (static.get("metadata") or {}).get("sits.max_sequence")
    return int(value) if value else DEFAULT_MAX_SEQUENCE


def to_json_result(result: dict[str, Any]) -> dict[str, Any]:
    """A stored request as the v1 API answers it: outputs as nested lists."""
    outputs = result.get("outputs")
    body = {k: v for k, v in result.items() if k != "outputs" and not (isinstance(v, float) and math.isnan(v))}
    body["outputs"] = {name: array.tolist() for name, array in outputs.items()} if outputs else None
    return body
