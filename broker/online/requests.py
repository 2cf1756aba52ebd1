"""Online inference requests: stored in a hash with their inputs, queued as one item each.

A request's tensors travel through Redis as text ("dtype;shape;base64", the
clients are text-decoding), are merged into batches by the worker that leases them,
and its outputs come back into the same hash. The finished request's fields are
also pushed to whoever waits: the inbox of the API process that submitted it
(`reply_to`, one list for all of that process's requests), so no waiter polls.
A request nobody waits for keeps its result in its hash alone.
"""

from __future__ import annotations

import base64
import io
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import orjson

from broker.errors import Conflict, NotFound, PayloadTooLarge, QueueFull, SitsError
from broker.online.records import RequestRecord
from broker.queueing.leases import LeasedItem
from broker.state.held_calls import send_held
from broker.state.replies import SubmitReply
from broker.state.store import Store, translate_redis_errors
from broker.tenants.usage import BILL_KEEP_SECONDS, day_number
from broker.tracing import spans

REQUEST_ID_PATTERN = re.compile(r"r[0-9a-f]{16}")
"""Every request id `new_request_id` makes: an id a client sends that is not one is no request's, and is
not looked up (a key built from it could be another record's)."""

INBOX_KEEP_SECONDS = 60.0
"""How long an inbox keeps a finished request's copy after its last push (at most `online.result_ttl`). A live
waiter pops it at once; only a copy its waiter no longer takes (it gave up, or its process died) stays, and it
counts against its tenant's `max_queued_bytes` meanwhile."""


def new_request_id() -> str:
    """A short random id, safe in keys."""
    return "r" + secrets.token_hex(8)


def encode_array(array: np.ndarray) -> str:
    """An array as base64 `.npy` text, the form clients may send large tensors in."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def pack_array(array: np.ndarray) -> str:
    """An array as text for Redis: "dtype;shape;base64 of the raw bytes" (';' because a dtype string may hold '|').

    Not `.npy`: reading an .npy header parses a Python literal, which cost more than the whole
    inference of a small request; this form decodes with one split and `np.frombuffer`.
    """
    array = np.asarray(array, order="C")  # not ascontiguousarray: that turns a 0-d array into 1-d
    shape = ",".join(str(dim) for dim in array.shape)
    return f"{array.dtype.str};{shape};{base64.b64encode(array.data).decode('ascii')}"


def unpack_array(text: str) -> np.ndarray:
    """The inverse of `pack_array` (a read-only view of the decoded bytes)."""
    dtype, shape, data = text.split(";", 2)
    dims = tuple(int(dim) for dim in shape.split(",")) if shape else ()
    return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(dims)


class QueueAtLimit(Exception):
    """The request's model queue (`level` None) or priority level holds `waiting` requests, its limit,
    or (`tenant` True) its tenant has `waiting` requests not answered, its `max_queued`: nothing was
    queued. Internal control flow between `submit_request` and its caller, which answers with a
    `QueueFull` (it knows how fast the queue drains)."""

    def __init__(self, waiting: int, level: int | None, tenant: bool = False) -> None:
        super().__init__(waiting, level, tenant)
        self.waiting, self.level, self.tenant = waiting, level, tenant


class TenantBytesAtLimit(QueueAtLimit):
    """The request's `request_bytes` of inputs would take its tenant past its `max_queued_bytes`, `budget`:
    the inputs of its `waiting` requests not answered yet and its `kept` results kept hold `queued_bytes`.
    Nothing was queued; the caller answers a `QueueFull` (429) as for `max_queued`, since the bytes come free
    as kept results expire (enough of them by `kept_free_at`, None: they hold too little) and the requests
    are answered."""

    def __init__(self, waiting: int, *, queued_bytes: int, request_bytes: int, budget: int, kept: int = 0,
                 kept_free_at: float | None = None) -> None:
        super().__init__(waiting, None, tenant=True)
        self.queued_bytes, self.request_bytes, self.budget = queued_bytes, request_bytes, budget
        self.kept, self.kept_free_at = kept, kept_free_at


class PolicyChanged(Exception):
    """The live policy changed after the request was scored; score it again and resubmit.

    Internal control flow between `submit_request` and its caller, not a `SitsError`.
    """


@dataclass(frozen=True)
class RequestSpec:
    """A validated online request, ready to queue."""

    request_id: str
    model_name: str
    model_version: str
    inputs: Mapping[str, np.ndarray]
    rows: int
    tokens: int | None
    bucket: str
    factors: dict[str, Any]
    deadline_at: float | None = None
    owner: str = ""
    tenant: str = ""
    """The tenant it is billed to and shares the fleet as ('' for the owner's name)."""
    padded_tokens: int | None = None
    """Tokens the request may cost in a padded batch (rows x its length class); counted against
    `max_batch_tokens` instead of `tokens` when set."""
    expires_at: float | None = None
    """When set (its timeout under `timeout_action: reject`, `broker.online.queue_policy`), a request still
    waiting then fails as timed out (`broker.online.timeouts`), and a worker that leases it later than
    this does not run it (`sits_worker.serving.request_runs`). A v1 `deadline_ms` is a tolerable delay that
    orders the queue, and such a request still runs late."""
    delay_at: float | None = None
    """When set (its timeout under `timeout_action: delay`), a request still waiting then drops to the
    lowest priority level (`broker.online.timeouts`); it still runs."""
    reply_to: str = ""
    """The inbox LIST (`keys.inbox`) the finished request's fields are pushed to, where its submitter's
    process waits for it; '' when nobody waits (the result stays in the request's hash alone)."""

    @property
    def model_ref(self) -> str:
        """The queue the request waits in."""
        return f"{self.model_name}@{self.model_version}"


@spans.traced("sits.enqueue", lambda store, spec, **_: {"sits.request_id": spec.request_id,
                                                       "sits.model_ref": spec.model_ref,
                                                       "sits.tenant": spec.tenant or spec.owner,
                                                       "sits.rows": spec.rows})
def submit_request(store: Store, spec: RequestSpec, *, score: float, now: float, max_age_seconds: float,
                   policy_json: str = "", ticket_target: int = 0, max_waiting: int = 0,
                   max_waiting_at_level: int = 0, tenant_max_queued: int = 0,
                   tenant_max_queued_bytes: int = 0) -> list[str]:
    """Store the request, queue it, ring the doorbell and top tickets up to `ticket_target`, in one call.

    `policy_json` is the live policy as read when `score` was computed ('' for the defaults); if it
    is no longer live, nothing is written and PolicyChanged is raised. With `max_waiting` (the
    model's `max_queue_size`) or `max_waiting_at_level` (its level's), a queue that holds that many
    waiting requests takes nothing, atomically with the check: QueueAtLimit; so does a tenant with
    `tenant_max_queued` requests not answered yet (`keys.tenant_queued`; `complete_requests` takes a
    request off it), and a request whose inputs would take the bytes of those requests, and of the
    tenant's results kept, past `tenant_max_queued_bytes` (`keys.tenant_queued_bytes`; kept results expired
    by `now` are freed first): TenantBytesAtLimit. Inputs larger than that
    whole budget could never be queued: PayloadTooLarge (413), not a 429 that no retry ends. Returns the
    new ticket ids, each to be sent as a drain task.
    """
    keys = store.keys
    tenant = spec.tenant or spec.owner
    inputs = orjson.dumps({name: pack_array(array) for name, array in spec.inputs.items()})
    input_bytes = len(inputs)  # (what the request's hash holds for them: ASCII, one byte a character)
    if 0 < tenant_max_queued_bytes < input_bytes:
        raise PayloadTooLarge(f"the request's inputs take {input_bytes:,} bytes queued, more than tenant "
                              f"'{tenant}' may have queued at all ({tenant_max_queued_bytes:,} bytes, "
                              f"tenants.{tenant}.max_queued_bytes); send fewer rows per request")
    fields = {
        "id": spec.request_id,
        "model": spec.model_name,
        "model_version": spec.model_version,
        "status": "queued",
        "rows": spec.rows,
        "created_at": now,
        "deadline_at": spec.deadline_at or "",
        "owner": spec.owner,
        "tenant": tenant,
        "inputs": inputs.decode(),
        "bytes_budget": tenant_max_queued_bytes,  # (its outputs are held to it too: `complete_requests.lua`)
    }
    payload = {"kind": "request", "req": spec.request_id, "model_ref": spec.model_ref, "rows": spec.rows,
               "tokens": spec.tokens, "padded_tokens": spec.padded_tokens, "bucket": spec.bucket, "score": score,
               "factors": spec.factors, "tenant": tenant, "owner": spec.owner,
               **({"expires_at": spec.expires_at} if spec.expires_at else {}),
               **({"deadline_at": spec.deadline_at} if spec.deadline_at else {}),
               **({"delay_at": spec.delay_at} if spec.delay_at else {}),
               **({"reply_to": spec.reply_to} if spec.reply_to else {}),
               **spans.traceparent_field()}  # (the enqueue span's: a worker continues the request's trace)
    timeout_at = spec.expires_at or spec.delay_at
    with translate_redis_errors():
        reply = store.scripts.submit_request(
            keys=[keys.ready(spec.model_ref), keys.items, keys.queues, keys.request(spec.request_id),
                  keys.deadlines(spec.model_ref), keys.policy, keys.tickets, keys.ticket_seq, keys.doorbell,
                  keys.queues_version, keys.waiting_requests(spec.model_ref), keys.request_timeouts(spec.model_ref),
                  keys.counters, keys.tenant_queued(tenant), keys.tenant_queued_bytes(tenant),
                  keys.tenant_kept(tenant)],
            args=[spec.model_ref, spec.request_id, orjson.dumps({k: str(v) for k, v in fields.items()}), score,
                  orjson.dumps(payload), spec.deadline_at or "", int(max_age_seconds), policy_json, now,
                  ticket_target, int(spec.factors.get("level") or 0), max_waiting, max_waiting_at_level,
                  "" if timeout_at is None else repr(timeout_at), tenant_max_queued, tenant_max_queued_bytes,
                  input_bytes],
        )
    status = SubmitReply(int(reply[0]))
    if status in (SubmitReply.QUEUE_FULL, SubmitReply.LEVEL_FULL):
        level = None if status is SubmitReply.QUEUE_FULL else int(spec.factors.get("level") or 0)
        raise QueueAtLimit(int(reply[1]), level)
    if status is SubmitReply.TENANT_FULL:
        raise QueueAtLimit(int(reply[1]), None, tenant=True)
    if status is SubmitReply.TENANT_BYTES_FULL:
        raise TenantBytesAtLimit(int(reply[2]), queued_bytes=int(reply[1]), request_bytes=input_bytes,
                                 budget=tenant_max_queued_bytes, kept=int(reply[3]),
                                 kept_free_at=float(reply[4]) if reply[4] else None)
    if status is SubmitReply.POLICY_CHANGED:
        raise PolicyChanged(spec.request_id)
    if status is SubmitReply.EXISTS:
        raise Conflict(f"request {spec.request_id} already exists")
    return [str(ticket) for ticket in reply[1:]]


def load_inputs(store: Store, items: Sequence[LeasedItem]) -> list[dict[str, np.ndarray] | None]:
    """The input tensors of each leased request (None where the request hash has expired): as its lease
    read them (`LeasedItem.inputs`), else from its hash, those in one round trip."""
    unread = [item for item in items if item.inputs is None]
    raws = dict(zip((item.item_id for item in unread), _read_inputs(store, unread), strict=True)) if unread else {}
    return [_unpacked(raws[item.item_id] if item.inputs is None else item.inputs) for item in items]


def _unpacked(raw: str | bytes | None) -> dict[str, np.ndarray] | None:
    """A request's packed `inputs` field as tensors (None for a missing field)."""
    return {name: unpack_array(text) for name, text in orjson.loads(raw).items()} if raw else None


def _read_inputs(store: Store, items: Sequence[LeasedItem]) -> list[Any]:
    """The `inputs` fields of the requests' hashes, in one round trip (None where a hash has expired)."""
    commands = [("HGET", store.keys.request(item.payload["req"]), "inputs") for item in items]

    def pipelined() -> list[Any]:
        pipe = store.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute())

    with translate_redis_errors():
        return list(send_held(store.client, commands, pipelined))


@dataclass(frozen=True)
class RequestResult:
    """What a worker reports for one request of a batch."""

    item: LeasedItem
    outputs: Mapping[str, np.ndarray] | None = None
    error: str = ""
    code: str = ""
    """With an `error`: the `code` of the SitsError it came from (`errors.error_for_code` turns it back)."""
    ran: bool = True
    """Whether the request was in the run (its queue and compute time count in the model's statistics);
    False for one failed without running (expired, past its timeout)."""


@spans.traced("sits.ack", lambda store, results, **_: {"sits.model_ref": results[0].item.model_ref,
                                                      "sits.items": len(results)})
def complete_requests(store: Store, results: Sequence[RequestResult], *, now: float, keep_seconds: float,
                      batch_size: int, worker: str, job_rows: int = 0, run_started: float | None = None,
                      run_rows: int = 0) -> int:
    """Store results, drop the leases, free their tenants' places (`max_queued`), count what Redis keeps of
    each answer against its tenant's bytes instead of its inputs (`max_queued_bytes`: its hash until
    `keep_seconds` from `now`, its inbox copy until `INBOX_KEEP_SECONDS`) and wake every waiter, in one
    atomic call; returns how many
    were completed (not those already completed, or waiting again after their lease expired: their
    tenants are settled only for the requests this call took off, `_settle_tenants`). The
    requests are of one model (a batch is); /metrics counts them by status (`keys.counters`), and the
    model's statistics (`broker.monitoring.model_stats`) their times, the queue and compute time of those that
    ran in the run begun at `run_started`, of `run_rows` rows (the statistics' batch size), and the latency
    histograms (`broker.monitoring.sla_metrics`) both, by the priority level each request was submitted at."""
    keys = store.keys
    request_keys: list[str] = []
    model_ref = results[0].item.model_ref
    args: list[Any] = [now, int(keep_seconds), batch_size, worker, job_rows, model_ref,
                       "" if run_started is None else repr(run_started), run_rows, int(INBOX_KEEP_SECONDS)]
    for result in results:
        request_id, tenant = result.item.payload["req"], str(result.item.payload.get("tenant") or "")
        request_keys += [keys.request(request_id), result.item.payload.get("reply_to") or keys.request(request_id),
                         keys.tenant_queued(tenant), keys.tenant_queued_bytes(tenant), keys.tenant_kept(tenant)]
        outputs = {name: pack_array(array) for name, array in (result.outputs or {}).items()}
        factors = result.item.payload.get("factors") or {}
        args += [result.item.item_id, "failed" if result.error else "succeeded", orjson.dumps(outputs), result.error,
                 (result.code or SitsError.code) if result.error else "", "1" if result.ran else "",
                 int(factors.get("base_level", factors.get("level")) or 0)]
    with translate_redis_errors():
        reply = store.scripts.complete_requests(
            keys=[keys.inflight(model_ref), keys.items, keys.attempts, keys.deadlines(model_ref),
                  keys.ready(model_ref), keys.counters, keys.model_stats, keys.model_batch_stats, keys.latency_buckets,
                  keys.tenants_served(model_ref), *request_keys],
            args=args,
        )
        _settle_tenants(store, [_as_answered(results, int(position)) for position in reply[1:]], now=now)
    return int(reply[0])


def _as_answered(results: Sequence[RequestResult], position: int) -> RequestResult:
    """The result at a position the completion script replied (at -1 - it: one that ran, but whose outputs it
    refused for its tenant's bytes, a failure to bill as such)."""
    if position >= 0:
        return results[position]
    return replace(results[-1 - position], outputs=None, error="its outputs passed its tenant's max_queued_bytes",
                   code=QueueFull.code)


def _settle_tenants(store: Store, results: Sequence[RequestResult], *, now: float) -> None:
    """Count the failed ones of the answered requests on their tenants' bills of the day (total, and by
    model version and key, so `GET /v1/usage?by=model` shows each A/B arm's errors). Their places were
    freed, and their bytes turned into their kept results', by the completion itself, in the same step that
    answered them."""
    by_tenant: dict[str, list[RequestResult]] = {}
    for result in results:
        tenant = result.item.payload.get("tenant")
        if tenant and result.error:  # (a batch that succeeded costs no call)
            by_tenant.setdefault(tenant, []).append(result)
    if not by_tenant:
        return
    keys = store.keys
    with translate_redis_errors(), store.client.pipeline(transaction=False) as pipe:
        for tenant, failed in by_tenant.items():
            bill = keys.tenant_bill(tenant, day_number(now))
            pipe.hincrby(bill, "failed", len(failed))
            for result in failed:
                pipe.hincrby(bill, f"model:{result.item.model_ref}:failed", 1)
                pipe.hincrby(bill, f"key:{result.item.payload.get('owner') or ''}:failed", 1)
            pipe.expire(bill, BILL_KEEP_SECONDS)
        pipe.execute()


def get_request(store: Store, request_id: str) -> RequestRecord:
    """The request's record: status, timings and decoded outputs; NotFound when unknown or expired. (An
    id from a client is checked against `REQUEST_ID_PATTERN` first.)"""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.request(request_id))
    if not raw:
        raise request_not_found(request_id)
    return record_from_fields(raw)


def request_not_found(request_id: str) -> NotFound:
    """The error for an unknown or expired request id; the API answers the same for another
    tenant's request, so that a caller cannot tell the two apart."""
    return NotFound(f"no request with id '{request_id}' (results are kept for a limited time)")


def record_from_fields(raw: Mapping[str, str]) -> RequestRecord:
    """A request hash's fields as its typed record: what `get_request` answers, and a waiter makes of the
    fields `complete_requests` pushed to it."""
    return RequestRecord.from_fields(raw, unpack_array)


POLL_SECONDS = 0.002
"""How often `wait_for_request` reads the request again."""


def wait_for_request(store: Store, request_id: str, *, timeout: float,
                     clock: Any = time.monotonic) -> RequestRecord | None:
    """The request once it is done, as `get_request` reports it, or None if it is not within `timeout`;
    NotFound for one unknown or expired.

    For scripts and tests that hold no inbox: it reads the request's hash every `POLL_SECONDS`. The
    API's waiting calls get their results pushed to their process's inbox instead (`reply_to`).
    """
    ends = clock() + timeout
    while True:
        record = get_request(store, request_id)
        if record.status not in _NOT_DONE or clock() >= ends:
            return None if record.status in _NOT_DONE else record
        time.sleep(POLL_SECONDS)


_NOT_DONE = ("queued", "running")
