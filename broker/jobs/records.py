"""Offline jobs: their ids, their items' ids and payloads, and their Redis hash read back as a record.

A job is split into chunks, each one queue item that refers to a row range
of the job's input file. The job hash is the checkpoint: input checksum,
model version, chunks and rows done, output folder and `checkpoint_ts`; the
`done` set holds the chunk indexes whose outputs are written. What changes a
job lives beside this module: queueing its chunks (`broker/jobs/fills.py`),
stopping it (`broker/jobs/stops.py`), its workers' progress
(`broker/jobs/progress.py`) and its output folder's claim (`broker/jobs/output_dirs.py`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.errors import JobNotFound
from broker.failures.retries import failure_record, is_failure_field
from broker.jobs.finish_prediction import sla_risk
from broker.jobs.job_record import JobRecord
from broker.jobs.views import JobOwnerView, JobTenantView
from broker.queueing.scoring import Factors, check_level, deadline_order_time, deadline_reach
from broker.setting_types import MAX_PRIORITY
from broker.state.store import Store, translate_redis_errors

ACTIVE_STATUSES = ("queued", "running")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")
_INT_FIELDS = (
    "rows_total",
    "rows_quarantined",
    "rows_done",
    "chunks_total",
    "chunks_done",
    "chunk_runs",
    "chunk_size",
    "batch_size",
    "priority",
)
_FLOAT_FIELDS = ("created_at", "started_at", "finished_at", "checkpoint_ts", "resumed_at", "deadline",
                 "predicted_finish", "order_at", "sla_risk_model", "sla_risk_at", "busy_seconds")
_JSON_FIELDS = ("output_names", "manifest", "input_options", "input_stat")
_BOOKKEEPING_FIELDS = ("counted", "fill_id", "fill_mode", "filled_to", "stop_id", "stop_done", "sla_snapshots",
                       "sla_snapshot_at", "sla_ahead", "slot_mix",
                       "slot_time_partial", "chunk_started_at", "priority_cap")
"""Job hash fields the scripts keep for themselves (the per-status job counts, the fill and the stop going on)."""


JOB_ID_PATTERN = re.compile(r"j[0-9a-f]{12}")
"""Every job id `new_job_id` makes; clients may refuse anything else before asking (`sitsctl job ...`)."""


def new_job_id() -> str:
    """A short random id, safe in keys and file names (`JOB_ID_PATTERN`)."""
    return "j" + secrets.token_hex(6)


def chunk_item_prefix(job_id: str) -> str:
    """What every chunk item id of the job begins with (`chunk_item_id`; `split_chunk.lua` adds the index)."""
    return f"{job_id}:c"


def chunk_item_id(job_id: str, chunk_index: int) -> str:
    """Item id of a chunk; zero-padded so equal scores keep chunks in row order."""
    return f"{chunk_item_prefix(job_id)}{chunk_index:07d}"


def chunk_job_id(item_id: str) -> str | None:
    """The job whose chunk `item_id` is (`chunk_item_id`), None for any other item."""
    job, _, chunk = item_id.rpartition(":")
    return job if job and chunk.startswith("c") and chunk[1:].isdigit() else None


def is_chunk_item_id(item_id: str) -> bool:
    """Is `item_id` a job chunk's (`chunk_item_id`), as queue heads are read by id alone?"""
    return chunk_job_id(item_id) is not None


def finalize_item_id(job_id: str) -> str:
    """Item id of the job's last step: merging parts into its outputs."""
    return f"{job_id}:final"


def chunk_ranges(rows_total: int, chunk_size: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of each chunk, in order."""
    return [(start, min(start + chunk_size, rows_total)) for start in range(0, rows_total, chunk_size)]


@dataclass(frozen=True)
class JobSpec:
    """Everything a job needs to run, validated by the API before it reaches Redis."""

    job_id: str
    model_name: str
    model_version: str
    input_batch: str
    input_format: str
    input_checksum: str
    output_dir: str
    output_names: Sequence[str]
    rows_total: int
    chunk_size: int
    batch_size: int
    priority: int = 0
    owner: str = ""
    tenant: str = ""
    """The tenant it is billed to and shares the fleet as ('' for the owner's name)."""
    input_options: dict[str, Any] | None = None
    input_stat: dict[str, int] | None = None
    """The input file's size, modification time and inode at submit: workers check it before each chunk."""
    deadline_at: float | None = None
    """When the job must be done (unix seconds); None for a job without a deadline."""
    predicted_finish: float | None = None
    """When admission predicted it would finish (`broker/sla/admission.py`), for a job with a deadline."""
    at_risk: bool = False
    """Accepted under `sla.admission: flag` although its deadline was predicted to be missed."""
    max_priority: int = MAX_PRIORITY
    """Its tenant's `max_priority`: the highest level its deadline may lift its chunks to (`job_factors`)."""
    max_slots: int | None = None
    """The most of its chunks leased at once, so the most stream slots it holds (None: as many as free)."""
    output_format: str = "npy"
    """How its outputs are written: `npy` (one file per output) or `parquet` (`output_layout.TABLE_OUTPUT_NAME`)."""

    @property
    def model_ref(self) -> str:
        """The queue this job's items wait in: `name@version`."""
        return f"{self.model_name}@{self.model_version}"


def finalize_payload(job_id: str, model_ref: str, score: float, factors: dict[str, Any] | None,
                     tenant: str = "") -> dict[str, Any]:
    """Payload of the finalize item, queued by the ack of the job's last chunk (same priority, same tenant)."""
    return {"kind": "finalize", "job": job_id, "model_ref": model_ref, "score": score, "factors": factors,
            "tenant": tenant}


def job_factors(priority: int, enqueued_at: float, order_at: float | None = None,
                max_priority: int = MAX_PRIORITY) -> Factors:
    """What a job's items are scored from: its priority level, free tier, no latency bonus; a job with a
    deadline ages from `order_at` when that is earlier (`scoring.deadline_order_time`), never lifted past
    its tenant's `max_priority` (`scoring.deadline_reach`)."""
    return Factors(level=check_level(priority), enqueued_at=enqueued_at,
                   order_at=order_at if order_at is not None and order_at < enqueued_at else None,
                   max_level=max_priority)


def job_order_time(priority: int, max_priority: int, enqueued_at: float, deadline_at: float, *, horizon: float,
                   delta: float) -> float:
    """The `order_at` of a job's items queued at `enqueued_at`: its deadline's, within what its tenant's
    cap lets a deadline gain at the aging rate `delta` (`scoring.deadline_reach`)."""
    return deadline_order_time(enqueued_at, deadline_at, horizon, deadline_reach(priority, max_priority, delta))


def stored_priority_cap(value: str | None) -> int:
    """The tenant cap a job hash records (its `priority_cap`); 15 for a job stored before caps were kept."""
    return int(value or MAX_PRIORITY)


def order_time(job: JobRecord, enqueued_at: float, horizon: float, *, max_priority: int,
               delta: float) -> float | None:
    """The `order_at` of a job whose items are queued at `enqueued_at`; None without a deadline."""
    if job.deadline is None:
        return None
    return job_order_time(job.priority, max_priority, enqueued_at, float(job.deadline), horizon=horizon, delta=delta)


def decode_job(raw: dict[str, str]) -> dict[str, Any]:
    """A job hash as typed JSON-ready values, with progress, throughput and ETA derived."""
    job: dict[str, Any] = dict(raw)
    for name in _INT_FIELDS:
        job[name] = int(float(raw.get(name) or 0))
    for name in _FLOAT_FIELDS:
        job[name] = float(raw[name]) if raw.get(name) else None
    for name in _JSON_FIELDS:
        job[name] = json.loads(raw[name]) if raw.get(name) else None
    job["error"] = raw.get("error") or None
    job["at_risk"] = bool(raw.get("at_risk"))
    job["max_slots"] = int(raw["max_slots"]) if raw.get("max_slots") else None
    job["owner"] = raw.get("owner") or None  # the submitting key's name; None for jobs stored without one
    job["tenant"] = raw.get("tenant") or job["owner"]  # jobs stored before tenants: the owner was the tenant
    for name in _BOOKKEEPING_FIELDS:
        job.pop(name, None)
    # Failures by class (`broker/failures/retries.py`): attempts and last error of each, and the last few.
    for name in [name for name in job if is_failure_field(name)]:
        job.pop(name)
    job["retries"], job["failures"] = failure_record(raw)
    job["workers"] = {name[2:]: int(count) for name, count in raw.items() if name.startswith("w:")}
    for name in job["workers"]:
        job.pop("w:" + name)
    rows_total, rows_done = job["rows_total"], job["rows_done"]
    job["progress"] = rows_done / rows_total if rows_total else 0.0
    return job


def with_rates(job: dict[str, Any], *, now: float) -> dict[str, Any]:
    """Add `elapsed_seconds` since the job's first start, and `rows_per_second` and `eta_seconds` of its
    current run: since its last resume, if any, so that the time it stood stopped is not counted as work."""
    started, finished = job.get("started_at"), job.get("finished_at")
    elapsed = ((finished or now) - started) if started else 0.0
    run_started, run_rows = started, job["rows_done"]
    rows_at_resume = int(job.pop("rows_at_resume", None) or 0)
    if started and job.get("resumed_at") and job["resumed_at"] > started:
        run_started, run_rows = job["resumed_at"], job["rows_done"] - rows_at_resume
    run_elapsed = ((finished or now) - run_started) if run_started else 0.0
    rate = run_rows / run_elapsed if run_elapsed > 0 else 0.0
    remaining = job["rows_total"] - job["rows_done"]
    job["elapsed_seconds"] = round(elapsed, 3)
    job["rows_per_second"] = round(rate, 1)
    job["eta_seconds"] = round(remaining / rate, 1) if rate > 0 and job["status"] in ACTIVE_STATUSES else None
    return with_deadline(job, now=now)


MODEL_RISK_FRESH_SECONDS = 30.0
"""How long the violation predictor's risk of a job stands for its `sla_risk` (`broker/sla/watch.py`, which
scores each reaper pass); after that, or before the first pass, the plain rule's (`sla_risk`) is shown."""


def with_deadline(job: dict[str, Any], *, now: float) -> dict[str, Any]:
    """A job with a deadline: `predicted_finish` from its own rate once it runs (admission's until then),
    `sla_risk` (the violation predictor's when fresh, else from that), and once it
    ended `deadline_met` (None for a cancelled job, or one without a
    deadline). Without one, the three are None."""
    deadline = job.get("deadline")
    model_risk, risk_at = job.pop("sla_risk_model", None), job.pop("sla_risk_at", None)
    if deadline is None:
        job.update(predicted_finish=None, sla_risk=None, deadline_met=None)
        return job
    if job["status"] in ACTIVE_STATUSES:
        if job.get("eta_seconds") is not None:
            job["predicted_finish"] = round(now + job["eta_seconds"], 3)
        fresh = model_risk is not None and risk_at is not None and now - risk_at <= MODEL_RISK_FRESH_SECONDS
        job["sla_risk"] = model_risk if fresh else sla_risk(job.get("predicted_finish"), deadline, now=now)
        job["deadline_met"] = None
    else:
        finished = job.get("finished_at")
        met = job["status"] == "succeeded" and finished is not None and finished <= deadline
        job["deadline_met"] = None if job["status"] == "cancelled" else met
        job["sla_risk"] = 0.0 if met else 1.0 if job["deadline_met"] is False else None
    return job


def job_not_found(job_id: str) -> JobNotFound:
    """The error for an unknown job id; the API answers the same for another tenant's job, so that
    a caller cannot tell the two apart."""
    return JobNotFound(f"no job with id '{job_id}'; list jobs with GET /v1/jobs or `sitsctl job list`")


def job_record(raw: dict[str, str], *, now: float) -> JobRecord:
    """The typed record of a job hash's fields, with its progress, rates and deadline figures at `now`."""
    return JobRecord.of(with_rates(decode_job(raw), now=now))


def get_job(store: Store, job_id: str, *, now: float) -> JobRecord:
    """The job's record; JobNotFound when there is none. (An id from a client is checked against
    `JOB_ID_PATTERN` first: `job:<id>:done` and the like are the job's other keys, of other types.)"""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.job(job_id))
    if not raw:
        raise job_not_found(job_id)
    return job_record(raw, now=now)


def job_owner(store: Store, job_id: str) -> JobOwnerView:
    """Who submitted `job_id`: its status, the submitting key's name and its tenant (all None for no
    such job, or an id that is no job's: `JOB_ID_PATTERN`)."""
    if not JOB_ID_PATTERN.fullmatch(job_id):
        return JobOwnerView(status=None, owner=None, tenant=None)
    with translate_redis_errors():
        return JobOwnerView.of(store.client.hmget(store.keys.job(job_id), JobOwnerView.names()))


def active_job_tenants(store: Store, *, most: int,
                       known: dict[str, tuple[str, str]]) -> dict[str, set[str]] | None:
    """Model ref -> the tenants with a job of it queued or running, from `keys.jobs_active` and the jobs
    still being queued (`keys.jobs_filling`), each one's status read again (the indexes drop ended jobs
    lazily); None when they hold more than `most` jobs (the read would cost Redis more than it saves). A
    tenant not named for a model has no chunk of it waiting, which fair share uses to keep such a tenant
    out of its scans (`sits_worker/tenancy/fair_share.py`). `known` (job id -> (model ref, tenant), which do not
    change) is the caller's cache across calls: only new jobs' are read, and it forgets jobs no longer
    listed."""
    with translate_redis_errors():
        pipe = store.client.pipeline(transaction=False)
        pipe.zrange(store.keys.jobs_active, 0, most)
        pipe.zrange(store.keys.jobs_filling, 0, most)
        active, filling = pipe.execute()
        job_ids = sorted(set(active) | set(filling))
        if len(job_ids) > most:
            return None
        pipe = store.client.pipeline(transaction=False)
        for job_id in job_ids:
            if job_id in known:  # (its model and tenant never change: only its status is read again)
                pipe.hget(store.keys.job(job_id), "status")
            else:
                pipe.hmget(store.keys.job(job_id), JobTenantView.names())
        replies = pipe.execute() if job_ids else []
    tenants: dict[str, set[str]] = {}
    for job_id, reply in zip(job_ids, replies, strict=True):
        status = reply
        if job_id not in known:
            job = JobTenantView.of(reply)
            status = job.status
            if job.model_ref:  # (a record not written yet is read again next time)
                known[job_id] = (job.model_ref, job.tenant or job.owner or "")  # (as its chunks' payloads name it)
        if job_id in known and status in ACTIVE_STATUSES:
            model_ref, tenant = known[job_id]
            tenants.setdefault(model_ref, set()).add(tenant)
    for job_id in set(known) - set(job_ids):
        del known[job_id]
    return tenants
