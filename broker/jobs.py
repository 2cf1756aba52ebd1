"""Offline jobs: their Redis hash (fields and checkpoint), chunk items, cancel and resume.

A job is split into chunks, each one queue item that refers to a row range
of the job's input file. The job hash is the checkpoint: input checksum,
model version, chunks and rows done, output folder and `checkpoint_ts`; the
`done` set holds the chunk indexes whose outputs are written. Resume
re-queues exactly the chunks not in that set.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import WatchError

from broker.apikeys import owns
from broker.errors import Conflict, JobNotFound
from broker.queues import LeasedItem
from broker.scoring import Factors, Ordering, Weights, check_level, queue_key
from broker.store import Store, translate_redis_errors

ACTIVE_STATUSES = ("queued", "running")
FINAL_STATUSES = ("succeeded", "failed", "cancelled")
STOP_STATUSES = ("cancelled", "failed")
"""The statuses `stop_job` gives."""
_INT_FIELDS = (
    "rows_total",
    "rows_done",
    "chunks_total",
    "chunks_done",
    "chunk_runs",
    "chunk_size",
    "batch_size",
    "priority",
)
_FLOAT_FIELDS = ("created_at", "started_at", "finished_at", "checkpoint_ts", "resumed_at")
_JSON_FIELDS = ("output_names", "manifest", "input_options", "input_stat")
_BOOKKEEPING_FIELDS = ("counted", "fill_id", "fill_mode", "filled_to", "stop_id", "stop_done")
"""Job hash fields the scripts keep for themselves (the per-status job counts, the fill and the stop going on)."""


JOB_ID_PATTERN = re.compile(r"j[0-9a-f]{12}")
"""Every job id `new_job_id` makes; clients may refuse anything else before asking (`sitsctl job ...`)."""


def new_job_id() -> str:
    """A short random id, safe in keys and file names (`JOB_ID_PATTERN`)."""
    return "j" + secrets.token_hex(6)


def chunk_item_id(job_id: str, chunk_index: int) -> str:
    """Item id of a chunk; zero-padded so equal scores keep chunks in row order."""
    return f"{job_id}:c{chunk_index:07d}"


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
    input_options: dict[str, Any] | None = None
    input_stat: dict[str, int] | None = None
    """The input file's size, modification time and inode at submit: workers check it before each chunk."""

    @property
    def model_ref(self) -> str:
        """The queue this job's items wait in: `name@version`."""
        return f"{self.model_name}@{self.model_version}"


def _item_args(job_id: str, model_ref: str, ranges: Sequence[tuple[int, int]], indexes: Sequence[int],
               score: float, factors: dict[str, Any], batch_size: int) -> list[Any]:
    args: list[Any] = []
    for index in indexes:
        start, stop = ranges[index]
        payload = {"kind": "chunk", "job": job_id, "model_ref": model_ref, "chunk": index,
                   "start": start, "stop": stop, "batch_size": batch_size, "score": score, "factors": factors}
        args += [chunk_item_id(job_id, index), score, json.dumps(payload), str(index)]
    return args


def finalize_payload(job_id: str, model_ref: str, score: float, factors: dict[str, Any] | None) -> dict[str, Any]:
    """Payload of the finalize item, queued by the ack of the job's last chunk (same priority)."""
    return {"kind": "finalize", "job": job_id, "model_ref": model_ref, "score": score, "factors": factors}


def job_factors(priority: int, enqueued_at: float) -> Factors:
    """What a job's items are scored from: its priority level, free tier, no latency bonus."""
    return Factors(level=check_level(priority), enqueued_at=enqueued_at)


def create_job(store: Store, spec: JobSpec, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic") -> None:
    """Write the job hash and queue all its chunks in one atomic call (scored with `weights`)."""
    ranges = chunk_ranges(spec.rows_total, spec.chunk_size)
    fields = {
        "id": spec.job_id,
        "model": spec.model_name,
        "model_version": spec.model_version,
        "model_ref": spec.model_ref,
        "input_batch": spec.input_batch,
        "input_format": spec.input_format,
        "input_checksum": spec.input_checksum,
        "input_options": json.dumps(spec.input_options or {}),
        "input_stat": json.dumps(spec.input_stat) if spec.input_stat else "",
        "output_dir": spec.output_dir,
        "output_names": json.dumps(list(spec.output_names)),
        "rows_total": spec.rows_total,
        "rows_done": 0,
        "chunks_total": len(ranges),
        "chunks_done": 0,
        "chunk_runs": 0,
        "chunk_size": spec.chunk_size,
        "batch_size": spec.batch_size,
        "priority": spec.priority,
        "owner": spec.owner,
        "status": "queued",
        "error": "",
        "created_at": now,
        "checkpoint_ts": now,
    }
    factors = job_factors(spec.priority, now)
    score = queue_key(factors, weights or Weights(), ordering)
    _enqueue(store, spec.job_id, spec.model_ref, fields, "create", now,
             _item_args(spec.job_id, spec.model_ref, ranges, range(len(ranges)), score, factors.to_dict(),
                        spec.batch_size), owner=spec.owner)


def claim_output_dir(store: Store, output_dir: str, job_id: str, *, caller: dict[str, Any]) -> None:
    """Make `job_id` the job that writes into `output_dir`; Conflict while another active job holds it,
    naming that job only if the `caller` API key may see it (`apikeys.owns`), and Conflict for a
    folder whose holder, in any status, is a job the caller may not see.

    Two jobs submitted into one folder at once would both pass a check made before either exists,
    run every row, and all but one fail at their merge. The claim is atomic (WATCH on the claims),
    but the job becomes active only after it (created, or resumed), and a claim held by a job that
    is not active (or not created yet) is free to take: so the caller claims, creates or resumes
    its job, then checks it still holds the folder (`holds_output_dir`) and stops its job if not.
    Of jobs racing for one folder, only the last to claim stays.

    A folder stays its holder's tenant's after the job stops: a cancelled or failed job's parts are
    its resumable work, and another tenant's job finishing there would leave a manifest that blocks
    that resume. So a key takes a stopped job's folder only if it owns that job (its tenant's keys,
    admins), or the job is gone from Redis.
    """
    key = store.keys.output_dirs
    with translate_redis_errors(), store.client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                holder = pipe.hget(key, output_dir)
                if holder and holder != job_id:
                    status, holder_owner = pipe.hmget(store.keys.job(holder), ["status", "owner"])
                    _refuse_a_held_folder(caller, output_dir, holder, status=status, holder_owner=holder_owner)
                pipe.multi()
                pipe.hset(key, output_dir, job_id)
                pipe.execute()
                return
            except WatchError:
                continue


def _refuse_a_held_folder(caller: dict[str, Any], output_dir: str, holder: str, *, status: str | None,
                         holder_owner: str | None) -> None:
    """Conflict unless `caller` may take `output_dir` from job `holder` (its `status`, None when the job
    is gone): no one while it is active, only keys that own it (`apikeys.owns`) while it exists. Only
    a key that owns the job is told which one it is."""
    visible = owns(caller, holder_owner)
    if status in ACTIVE_STATUSES:
        if visible:
            raise Conflict(f"output_dir {output_dir} is in use by job {holder} ({status}); "
                           f"choose another folder or cancel {holder} first")
        raise Conflict(f"output_dir {output_dir} is in use by another tenant's active job; choose another folder")
    if status is not None and not visible:
        raise Conflict(f"output_dir {output_dir} was last used by another tenant's job, whose parts or results "
                       "may still be there; choose another folder")


def job_owner(store: Store, job_id: str) -> str | None:
    """The name of the API key that submitted `job_id`; None for a job stored without one, or no such job."""
    with translate_redis_errors():
        return store.client.hget(store.keys.job(job_id), "owner") or None


def holds_output_dir(store: Store, output_dir: str, job_id: str) -> bool:
    """Whether `job_id` still holds its claim on `output_dir` (see `claim_output_dir`)."""
    with translate_redis_errors():
        return store.client.hget(store.keys.output_dirs, output_dir) == job_id


ENQUEUE_SLICE = 128
"""Items one enqueue or stop call handles at most: at most about 4 ms of Redis time (p99, measured on 2
cores with 100,000 items queued: benchmarks/job_slices.py), so that a job of 100,000 chunks never holds
Redis, and every online request, for seconds (one call took 4-7 s)."""
FILL_STALLED_SECONDS = 30.0
"""A job still filling (or stopping) whose last enqueue (or stop) call is this old lost its caller; a reaper
pass completes the fill (or the stop)."""


def _slice_call(number: int, count: int, *, continued: bool) -> str:
    """What call `number` of `count` of a sliced fill or stop says of itself to its script: '' (the only one),
    'first' (more follow), 'more' or 'last'; with `continued` (taken up by a reaper pass) none is the first."""
    taken_up, more_follow = number > 0 or continued, number < count - 1
    return ("more" if taken_up else "first") if more_follow else ("last" if taken_up else "")


def _enqueue(store: Store, job_id: str, model_ref: str, fields: dict[str, Any], mode: str, now: float,
             item_args: list[Any], owner: str = "", *, fill_id: str | None = None) -> int:
    """Queue a job's items in calls of `ENQUEUE_SLICE`, the job's `fields` set by the first.

    While more calls are to come the job is in `keys.jobs_filling` (a reaper pass completes the fill if
    this caller dies: `stalled_fills`, `refill_job`; the first call records the fill's id and mode in the
    job); a later call adds nothing to a job stopped meanwhile, nor does any call with `fill_id` (a fill
    taken up again under its recorded id), and a later call of a fill that another took over only adds.
    'create' adds later slices in 'add' mode.
    Returns the items added; Conflict if 'create' finds the job there.
    """
    keys = store.keys
    job_keys = [keys.ready(model_ref), keys.items, keys.queues, keys.job(job_id), keys.jobs, keys.job_done(job_id),
                keys.inflight(model_ref), keys.dead, keys.attempts, keys.jobs_filling, keys.job_counts,
                keys.queues_version, *([keys.owner_jobs(owner)] if owner else [])]
    step = 4 * ENQUEUE_SLICE  # four arguments an item
    slices = [item_args[start:start + step] for start in range(0, len(item_args), step)] or [[]]
    continued = fill_id is not None
    fill_id = secrets.token_hex(6) if fill_id is None else fill_id
    added = 0
    for number, group in enumerate(slices):
        fill = _slice_call(number, len(slices), continued=continued)
        with translate_redis_errors():
            reply = int(store.scripts.enqueue_items(
                keys=job_keys,
                args=[model_ref, job_id, json.dumps({k: str(v) for k, v in fields.items()}) if number == 0 else "{}",
                      mode if number == 0 or mode == "resume" else "add", now, fill, time.time(), fill_id, *group],
            ))
        if reply == -1:
            raise Conflict(f"job {job_id} already exists")
        if reply == -2:  # stopped meanwhile: what was queued is (being) taken out by the stop
            break
        added += reply
    return added


def stalled_fills(store: Store, *, now: float) -> list[str]:
    """Jobs whose fill stopped part-way: their last enqueue call is `FILL_STALLED_SECONDS` old (the API
    process queueing them died between two calls). `refill_job` completes each."""
    with translate_redis_errors():
        return list(store.client.zrangebyscore(store.keys.jobs_filling, "-inf", now - FILL_STALLED_SECONDS))


def refill_job(store: Store, job_id: str, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic") -> int:
    """Queue every chunk of a stalled fill that is not done, queued, leased or dead, as the fill its first
    call recorded (`fill_id`, `fill_mode`): a resume's also takes back at once the chunks of the earlier
    run that are leased or dead and that its calls had not reached yet (only those: the script keeps every
    call idempotent), any other adds ('add', also for a fill recorded before the mode was). Should another
    fill begin after this reads the job, these calls only add, leaving that fill's record to its caller or
    a later pass. A job stopped or gone meanwhile only leaves the filling index. Returns the items added."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.job(job_id))
    job = decode_job(raw) if raw else None
    if job is None or job["status"] not in ACTIVE_STATUSES:
        with translate_redis_errors():
            store.client.zrem(store.keys.jobs_filling, job_id)
        return 0
    mode = "resume" if raw.get("fill_mode") == "resume" else "add"
    done = done_chunks(store, job_id)
    ranges = chunk_ranges(job["rows_total"], job["chunk_size"])
    # a resume's first call scored its chunks as enqueued at the resume (`resume_job`)
    factors = job_factors(job["priority"], (mode == "resume" and job["resumed_at"]) or job["created_at"])
    item_args = _item_args(job_id, job["model_ref"], ranges, [i for i in range(len(ranges)) if i not in done],
                           queue_key(factors, weights or Weights(), ordering), factors.to_dict(),
                           int(job["batch_size"]))
    return _enqueue(store, job_id, job["model_ref"], {}, mode, now, item_args, fill_id=raw.get("fill_id") or "")


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
    job["owner"] = raw.get("owner") or None  # the submitting key's name; None for jobs stored without one
    for name in _BOOKKEEPING_FIELDS:
        job.pop(name, None)
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
    return job


def job_not_found(job_id: str) -> JobNotFound:
    """The error for an unknown job id; the API answers the same for another tenant's job, so that
    a caller cannot tell the two apart."""
    return JobNotFound(f"no job with id '{job_id}'; list jobs with GET /v1/jobs or `sitsctl job list`")


def get_job(store: Store, job_id: str, *, now: float) -> dict[str, Any]:
    """The job as JSON-ready values; JobNotFound when there is none."""
    with translate_redis_errors():
        raw = store.client.hgetall(store.keys.job(job_id))
    if not raw:
        raise job_not_found(job_id)
    return with_rates(decode_job(raw), now=now)


def _job_item_ids(job_id: str, chunks_total: int) -> list[str]:
    """Every item id a job may have queued: its chunks' and its finalize step's."""
    return [chunk_item_id(job_id, i) for i in range(chunks_total)] + [finalize_item_id(job_id)]


def stop_job(store: Store, job_id: str, *, status: str, error: str, now: float, dead_item: str = "") -> str:
    """Cancel or fail a job and take its waiting items out; returns the job's status afterwards.

    With `dead_item`, the stop happens only while that item is still in the dead set, so a
    resume that took it back in the meantime wins ('skipped'). A stop of a job that already has
    `status` takes the items out again, and any earlier stop still going on over (a second DELETE).
    While more calls are to come the job is in `keys.jobs_stopping` (a reaper pass completes the stop
    if this caller dies: `stalled_stops`, `finish_stop`).
    """
    with translate_redis_errors():
        raw = store.client.hmget(store.keys.job(job_id), ["model_ref", "chunks_total"])
    model_ref, chunks_total = raw
    if model_ref is None:
        raise job_not_found(job_id)
    return _take_items_out(store, job_id, model_ref, _job_item_ids(job_id, int(chunks_total)), status=status,
                           error=error, now=now, stop_id=secrets.token_hex(6), dead_item=dead_item)


def _take_items_out(store: Store, job_id: str, model_ref: str, item_ids: Sequence[str], *, status: str, error: str,
                    now: float, stop_id: str, dead_item: str = "", continued: bool = False) -> str:
    """The calls of one stop (`stop_id`), `ENQUEUE_SLICE` items each: the first stops the job, later ones (all,
    with `continued`: a stop taken up again) take items out while the job has `status` and `stop_id`.
    Returns the first call's reply."""
    keys = store.keys
    stop_keys = [keys.job(job_id), keys.ready(model_ref), keys.inflight(model_ref), keys.items, keys.attempts,
                 keys.dead, keys.job_counts, keys.jobs_stopping]
    slices = [item_ids[start:start + ENQUEUE_SLICE] for start in range(0, len(item_ids), ENQUEUE_SLICE)] or [[]]
    first = ""
    for number, group in enumerate(slices):
        with translate_redis_errors():
            result = str(store.scripts.stop_job(
                keys=stop_keys,
                args=[status, error, now, dead_item if number == 0 else "",
                      _slice_call(number, len(slices), continued=continued), stop_id, job_id, time.time(), *group],
            ))
        if result == "already":  # stopped with this status by a stop that finished: nothing left to take out
            return status
        first = first or result
        if result != status:  # finished, skipped or gone (first call); resumed or taken over since
            break
    return first


def stalled_stops(store: Store, *, now: float) -> list[str]:
    """Jobs whose stop ended part-way: its last call is `FILL_STALLED_SECONDS` old (the API process, or the
    reaper pass, stopping them died between two calls). `finish_stop` completes each."""
    with translate_redis_errors():
        return list(store.client.zrangebyscore(store.keys.jobs_stopping, "-inf", now - FILL_STALLED_SECONDS))


def finish_stop(store: Store, job_id: str, *, now: float) -> str:
    """Take out every item a stalled stop left in the queue, in slices as its caller would have, each call
    only while the job still has the stop's status and id (`stop_id`; a job stopped before it was recorded
    has none): a job resumed since keeps what the resume queued, a stop that took this one over is left to
    its own caller. Idempotent; the job leaves the stopping index. Returns the first call's reply (the stop's
    status, 'superseded', or the job's status when it is not stopped)."""
    with translate_redis_errors():
        model_ref, chunks_total, status, stop_id = store.client.hmget(
            store.keys.job(job_id), ["model_ref", "chunks_total", "status", "stop_id"])
    if model_ref is None:  # gone: nothing of it to take out
        with translate_redis_errors():
            store.client.zrem(store.keys.jobs_stopping, job_id)
        return ""
    # not stopped (resumed or finished since): one call with no status and no items only ends the entry
    stopped = status if status in STOP_STATUSES else ""
    item_ids = _job_item_ids(job_id, int(chunks_total or 0)) if stopped else []
    return _take_items_out(store, job_id, model_ref, item_ids, status=stopped, error="", now=now,
                           stop_id=stop_id or "", continued=True)


def done_chunks(store: Store, job_id: str) -> set[int]:
    """Indexes of the job's chunks whose parts are written and acknowledged."""
    with translate_redis_errors():
        return {int(index) for index in store.client.smembers(store.keys.job_done(job_id))}


def forget_chunks(store: Store, job_id: str, indexes: Sequence[int]) -> int:
    """Count chunks of a stopped job as not done (their parts were lost), so that a resume runs them
    again; a job not stopped is left alone. Returns how many were forgotten."""
    job = get_job(store, job_id, now=0.0)
    ranges = chunk_ranges(job["rows_total"], job["chunk_size"])
    forgotten = 0
    for start in range(0, len(indexes), ENQUEUE_SLICE):
        args = [value for index in indexes[start:start + ENQUEUE_SLICE]
                for value in (index, ranges[index][1] - ranges[index][0])]
        with translate_redis_errors():
            forgotten += int(store.scripts.forget_chunks(keys=[store.keys.job(job_id), store.keys.job_done(job_id)],
                                                         args=args))
    return forgotten


def resume_job(store: Store, job_id: str, *, now: float, weights: Weights | None = None,
               ordering: Ordering = "dynamic", input_stat: dict[str, int] | None = None) -> int:
    """Re-queue every chunk not yet done (and the finalize step if all are); returns items queued.
    `input_stat` replaces the input file's recorded identity (its checksum was found unchanged).

    Chunks still leased by a previous run are taken back: after a crash their
    holders are gone, and if one is not, its duplicate run rewrites the same
    bytes and its ack is counted once.
    """
    job = get_job(store, job_id, now=now)
    if job["status"] == "succeeded":
        raise Conflict(f"job {job_id} already succeeded; its outputs are in {job['output_dir']}")
    done = done_chunks(store, job_id)
    ranges = chunk_ranges(job["rows_total"], job["chunk_size"])
    missing = [index for index in range(len(ranges)) if index not in done]
    factors = job_factors(job["priority"], now)
    score = queue_key(factors, weights or Weights(), ordering)
    model_ref = job["model_ref"]
    item_args = _item_args(job_id, model_ref, ranges, missing, score, factors.to_dict(), int(job["batch_size"]))
    if not missing:
        finalize = finalize_payload(job_id, model_ref, score, factors.to_dict())
        item_args = [finalize_item_id(job_id), score, json.dumps(finalize), ""]
    fields: dict[str, Any] = {"status": "queued", "error": "", "finished_at": "", "resumed_at": now,
                              "rows_at_resume": job["rows_done"]}
    if input_stat:
        fields["input_stat"] = json.dumps(input_stat)
    return _enqueue(store, job_id, model_ref, fields, "resume", now, item_args)


def start_item(store: Store, job_id: str, *, now: float) -> str:
    """Mark the job running as a worker begins one of its items; returns its status after that.

    Anything but 'running' ('cancelled', 'failed', 'succeeded', or '' for a job that is gone)
    means the item must be dropped unrun.
    """
    with translate_redis_errors():
        return str(store.scripts.start_item(keys=[store.keys.job(job_id), store.keys.job_counts], args=[now]))


def ack_chunk(store: Store, item: LeasedItem, *, now: float, worker: str) -> int:
    """Record a chunk whose part files are written: drop its lease, checkpoint it, count `worker`.

    Returns 0 for a duplicate (or a job no longer active), 1 when recorded, 2 when it was the
    job's last chunk and the finalize item was queued (and the doorbell rung, so a lingering drain
    task leases it at once). Idempotent: a re-run is counted once.
    """
    payload = item.payload
    job_id = payload["job"]
    keys = store.keys
    finalize = json.dumps(finalize_payload(job_id, item.model_ref, payload["score"], payload.get("factors")))
    with translate_redis_errors():
        reply = store.scripts.ack_chunk(
            keys=[keys.inflight(item.model_ref), keys.ready(item.model_ref), keys.items, keys.attempts,
                  keys.job(job_id), keys.job_done(job_id), keys.doorbell, keys.job_counts, keys.counters,
                  keys.queues, keys.queues_version],
            args=[item.item_id, payload["chunk"], payload["stop"] - payload["start"], now,
                  finalize_item_id(job_id), payload["score"], finalize, worker, item.model_ref],
        )
    return int(reply)


def record_last_error(store: Store, job_id: str, error: str) -> None:
    """Remember why an attempt at one of the job's items failed (shown if its attempts run out)."""
    with translate_redis_errors():
        store.client.hset(store.keys.job(job_id), "last_error", error)


def last_error(store: Store, job_id: str) -> str | None:
    """The error of the job's latest failed attempt, if any."""
    with translate_redis_errors():
        return store.client.hget(store.keys.job(job_id), "last_error")
