"""Online requests at the edge: validate tensors, score, queue, optionally wait for the result.

Shared by the v1 REST endpoint and the Open Inference Protocol (v2) endpoints,
which differ only in how tensors are spelled.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from broker.config.settings import Settings
from broker.errors import BadInput, QueueFull, RetryableError
from broker.models.cache import API_RECORD_TTL_SECONDS, ModelRecordCache
from broker.models.model_record import ModelRecord
from broker.models.repository import RepositoryServing
from broker.monitoring import model_stats
from broker.online import queue_policy, requests
from broker.online import timeouts as request_timeouts
from broker.online.batching import configured
from broker.online.records import RequestRecord
from broker.online.requests import RequestSpec
from broker.queueing import policy
from broker.queueing.scoring import SLA_WEIGHTS, Factors, estimate_latency_ms, queue_key
from broker.setting_types import MAX_PRIORITY, UserTier
from broker.state.store import Store
from broker.tracing import spans
from sits_api.intake.result_inbox import Answer
from sits_api.intake.task_sender import Dispatcher
from sits_worker.model.padding import (
    MaskSpec,
    mask_spec,
    max_sequence,
    shape_bucket,
    token_limits,
)
from sits_worker.model.tensors import request_tensors


def submit(settings: Settings, store: Store, dispatcher: Dispatcher, live_policy: policy.LivePolicy, *,
           model: str, inputs: dict[str, Any], priority: int, deadline_ms: float | None, user_tier: UserTier,
           tokens: int | None, owner: str, now: float, request_id: str | None = None,
           timeout_ms: float | None = None, reply_to: str = "", tenant: str = "",
           max_queued: int = 0, max_queued_bytes: int = 0, max_priority: int = MAX_PRIORITY) -> RequestSpec:
    """Check the request against the model's signature, score it with the live policy and queue it,
    under its model's queue policy (`broker.online.queue_policy`): QueueFull when its queue is full, and
    `timeout_ms`, the request's own timeout (v1 `timeout_ms`, v2 `timeout`), where the policy lets it;
    `ModelUnavailable` (503) when its model version's breaker is open on every live worker.
    `reply_to` is the inbox its result is pushed to (`sits_api.intake.result_inbox`), '' for none (its hash
    alone holds it).
    `tenant` is who it is billed to ('' for the owner), `max_queued` its tenant's cap on requests not
    answered yet and `max_queued_bytes` on their inputs' bytes (QueueFull beyond either; 0: none;
    PayloadTooLarge for inputs past the whole byte budget). `max_priority` is its tenant's cap, which no
    PSA jump raises the request past (`scoring.Factors.max_level`)."""
    record, mask = model_record(store, model)
    tensors = request_tensors(record.signature, inputs, mask=mask)
    rows = next(iter(tensors.values())).shape[0]
    serving = RepositoryServing.of(record)
    if serving is not None and 0 < serving.max_batch_size < rows:  # (Triton's refusal, as Triton words it)
        raise BadInput(f"inference request batch-size must be <= {serving.max_batch_size} for '{record.name}'")
    sequence = _sequence_length(record, tensors)
    longest = max_sequence(record.static_profile)
    tokens = _checked_tokens(record, tensors, mask, rows=rows, sequence=sequence, claimed=tokens)
    bucket, padded_length = shape_bucket(tensors, mask, longest)
    queue = queue_policy.resolve(configured(settings.online, record), priority)
    timeout = queue_policy.request_timeout(queue, timeout_ms / 1000 if timeout_ms else None)
    factors = Factors(
        level=priority,
        sla_weight=SLA_WEIGHTS[user_tier],
        est_latency_ms=estimate_latency_ms(record, rows=rows, tokens=tokens),
        complexity=min(1.0, sequence / longest) if sequence else 0.0,
        enqueued_at=now,
        tokens=tokens if sequence is not None else None,
        max_level=max_priority,
    )
    spec = RequestSpec(
        request_id=request_id or requests.new_request_id(),
        model_name=record.name,
        model_version=record.version,
        inputs=tensors,
        rows=rows,
        tokens=tokens,
        bucket=bucket,
        padded_tokens=rows * padded_length if padded_length else None,
        factors=factors.to_dict(),
        deadline_at=now + deadline_ms / 1000 if deadline_ms else None,
        owner=owner,
        tenant=tenant or owner,
        expires_at=now + timeout if timeout is not None and queue.timeout_action == "reject" else None,
        delay_at=now + timeout if timeout is not None and queue.timeout_action == "delay" else None,
        reply_to=reply_to,
    )
    dispatcher.breakers.check(spec.model_ref, now=now)  # 503 when every live worker's breaker of it is open
    raw_policy, weights, ordering = live_policy.current()
    for _ in range(_POLICY_RETRIES):
        try:
            new_tickets = requests.submit_request(
                store, spec, score=queue_key(factors, weights, ordering), now=now,
                max_age_seconds=max(settings.online.result_ttl, 3600), policy_json=raw_policy,
                ticket_target=dispatcher.ticket_target(now), max_waiting=queue.max_queue_size,
                max_waiting_at_level=queue.level_max_queue_size, tenant_max_queued=max_queued,
                tenant_max_queued_bytes=max_queued_bytes)
            break
        except requests.PolicyChanged:
            raw_policy, weights, ordering = live_policy.refresh()
        except requests.QueueAtLimit as full:
            raise queue_full(store, record, spec, full, live_slots=dispatcher.live_slots(now)) from None
    else:
        raise RetryableError("the scoring policy is being updated right now; retry the request")
    dispatcher.send_tickets(new_tickets)
    return spec


def queue_full(store: Store, record: ModelRecord, spec: RequestSpec, full: requests.QueueAtLimit, *,
               live_slots: int) -> QueueFull:
    """The 429 of a request its full queue refused, with a Retry-After from the queue's drain rate: the
    waiting requests times the seconds one takes (the model version's statistics, else its profile's
    batch of one), over the live workers' stream slots (`queue_policy.retry_after_seconds`; as the
    dispatcher keeps them, read at most once a second, since refusals come many at once)."""
    each = queue_policy.seconds_per_request(model_stats.run_totals(store, spec.model_ref))
    if each is None:
        each = estimate_latency_ms(record, rows=spec.rows, tokens=spec.tokens) / 1000
    retry_after = queue_policy.retry_after_seconds(full.waiting, each, live_slots)
    if isinstance(full, requests.TenantBytesAtLimit):
        if full.kept_free_at is not None:  # (its kept results free the room by then, whatever the queue does;
            # with none of its requests waiting, only they can)
            kept_after = queue_policy.retry_after_seconds(1, full.kept_free_at - time.time(), 1)
            retry_after = kept_after if full.waiting == 0 else min(retry_after, kept_after)
        return QueueFull(f"tenant '{spec.tenant}' holds {full.queued_bytes:,} bytes in Redis: the inputs of its "
                         f"{full.waiting} requests not answered yet and {full.kept} results kept of those answered "
                         f"(each counts until it expires, online.result_ttl after its answer); this request's "
                         f"{full.request_bytes:,} bytes would take it past its budget of {full.budget:,} bytes "
                         f"(tenants.{spec.tenant}.max_queued_bytes); the request was not queued: retry after "
                         f"{retry_after} s (Retry-After)", retry_after=retry_after)
    if full.tenant:
        return QueueFull(f"tenant '{spec.tenant}' has {full.waiting} requests not answered yet, its limit "
                         f"(tenants.{spec.tenant}.max_queued); the request was not queued: retry after "
                         f"{retry_after} s (Retry-After)", retry_after=retry_after)
    if full.level is None:
        what, key = f"model '{spec.model_ref}'", f"online.models.{spec.model_name}.max_queue_size"
    else:
        what, key = (f"priority level {full.level} of model '{spec.model_ref}'",
                     f"online.models.{spec.model_name}.priority_levels.{full.level}.max_queue_size")
    return QueueFull(f"{what} has {full.waiting} requests waiting, its limit ({key}); the request was not "
                     f"queued: retry after {retry_after} s (Retry-After)", retry_after=retry_after)


@spans.traced("sits.await_result", lambda settings, store, live_policy, answer, spec, **_: {
    "sits.request_id": spec.request_id, "sits.model_ref": spec.model_ref})
def wait_for_result(settings: Settings, store: Store, live_policy: policy.LivePolicy, answer: Answer,
                    spec: RequestSpec, *, seconds: float) -> RequestRecord | None:
    """The finished request, as `answer` brings it within `seconds`, else None. A request still waiting
    at its timeout is dealt with then, whether workers are free or not (`broker.online.timeouts`):
    rejected, its failure is the answer at once; delayed, the wait goes on."""
    began = time.monotonic()
    timeout_at = spec.expires_at or spec.delay_at
    if timeout_at is None or not answer.reply_to or timeout_at - time.time() >= seconds:
        return answer.wait(seconds)
    result = answer.wait(timeout_at - time.time())
    if result is not None:
        return result
    _, weights, ordering = live_policy.current()
    request_timeouts.expire_timed_out(store, spec.model_ref, now=max(time.time(), timeout_at), weights=weights,
                                      ordering=ordering, keep_seconds=settings.online.result_ttl)
    return answer.wait(seconds - (time.monotonic() - began))


_POLICY_RETRIES = 5
"""Submits refused because `PUT /v1/policy` changed the policy in between; one retry is the usual case."""

_RECORDS = ModelRecordCache(API_RECORD_TTL_SECONDS)
"""This process's model records: the hot path reads one on every request."""
_masks: dict[str, tuple[ModelRecord, MaskSpec | None]] = {}


def model_record(store: Store, ref: str) -> tuple[ModelRecord, MaskSpec | None]:
    """The registry record and padding spec of `ref`, kept a moment per process (`broker/models/cache.py`);
    the spec is derived again only when the record is read again."""
    record = _RECORDS.get(store, ref)
    cached = _masks.get(ref)
    if cached is None or cached[0] is not record:
        cached = _masks[ref] = (record, mask_spec(record.static_profile))
    return record, cached[1]


def wait_seconds(settings: Settings, deadline_ms: float | None) -> float:
    """How long a waiting call holds on: until the deadline, at most `online.max_wait`."""
    return min(deadline_ms / 1000, settings.online.max_wait) if deadline_ms else settings.online.max_wait


def _checked_tokens(record: ModelRecord, tensors: dict[str, np.ndarray], mask: MaskSpec | None, *,
                    rows: int, sequence: int | None, claimed: int | None) -> int | None:
    """The request's token count, always counted from its sequence axis (rows x sequence length): what
    its run costs, and what the scheduler weighs (requests under `express_max_tokens` take the express
    lane), so it is never taken from the client. A count the client sent must be that one or, for a
    model with an attention mask, the unmasked tokens; either way the counted one is used (a long
    sequence mostly masked still runs at its length). A model's own `sits.max_sequence` bounds the
    sequence length here, and its vocabulary the token ids, before anything is queued."""
    name = record.name
    if sequence is None:
        if claimed is not None:
            raise BadInput(f"model '{name}' has no sequence axis, so 'tokens' does not apply to it; leave it out")
        return None
    limits = token_limits(record.static_profile)
    if limits is not None:
        limits.check(tensors, name)
    counted = sequence * rows
    if claimed is None or claimed == counted:
        return counted
    unmasked = int(np.count_nonzero(tensors[mask.mask_input])) if mask and mask.mask_input in tensors else None
    if claimed == unmasked:
        return counted
    also = f" ({unmasked} unmasked)" if unmasked is not None else ""
    raise BadInput(f"'tokens' is {claimed} but the input holds {counted} tokens{also}; "
                   "leave 'tokens' out and the server counts them")


def _sequence_length(record: ModelRecord, tensors: dict[str, np.ndarray]) -> int | None:
    axis = record.static_profile.get("sequence_axis")
    if not axis or axis["input"] not in tensors:
        return None
    return int(tensors[axis["input"]].shape[axis["axis"]])


def to_json_result(result: RequestRecord) -> dict[str, Any]:
    """A stored request as the v1 API answers it: outputs as nested lists."""
    fields = result.to_json()
    body = {k: v for k, v in fields.items() if k != "outputs" and not (isinstance(v, float) and math.isnan(v))}
    body["outputs"] = {name: array.tolist() for name, array in result.outputs.items()} if result.outputs else None
    return body
