"""Running leased items: a chunk of an offline job, or a job's finalize step.

Plain functions over a `WorkerContext`, no Celery here (STYLE.md, "Thin
framework glue"). A chunk's outputs are written atomically as a part file
before its ack, so a chunk re-run after a lost ack rewrites identical bytes
and is counted once. The writing and the ack happen on the worker's commit
thread (`sits_worker.chunk_commits`), so the stream slot computes its next batch
while the disk works.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from broker import job_progress, job_stops, jobs, queues, retries
from broker.errors import BadInput, SitsError
from broker.queues import LeasedItem
from broker.retry_policy import classify, describe, retry_delays
from sits_worker.context import WorkerContext
from sits_worker.model.source import check_unchanged
from sits_worker.outputs import finalize_outputs, remove_parts, write_part
from sits_worker.request_runs import give_back, rows_to_fill, run_requests, run_with_riders

log = logging.getLogger(__name__)


class MiniBatchHook(Protocol):
    """What a running item calls as it goes (`sits_worker.between_minibatches.BetweenBatches`)."""

    def __call__(self, feed: Mapping[str, np.ndarray]) -> Sequence[LeasedItem]:
        """Called with each mini-batch's feed before it runs: keeps the chunk's lease alive, may run
        urgent work first, and returns the online requests that ride in the mini-batch."""
        ...

    def keep_alive(self) -> None:
        """Extend the item's lease when due, cheap otherwise (a finalize merge calls it as it goes)."""
        ...

    def running(self) -> AbstractContextManager[object]:
        """Held while a mini-batch runs: one `session.run` may outlast the lease, and between mini-batches
        is the only place `__call__` extends it."""
        ...


def process_item(ctx: WorkerContext, item: LeasedItem, between: MiniBatchHook) -> str:
    """Run one leased item; returns what happened ('committing': a chunk computed, its outputs handed
    to the commit thread, which writes them and acks it; 'finalized', 'dropped', 'failed', 'retry').

    A failure is settled by its class (`settle_failure`; a chunk's commit settles its own): retried
    after its backoff while the class has attempts left, else its job fails with the error's message.
    """
    job_id = item.payload["job"]
    now = time.time()
    if job_progress.start_item(ctx.store, job_id, now=now) != "running":
        queues.finish_item(ctx.store, item, job_id, now=now)
        return "dropped"
    try:
        job = jobs.get_job(ctx.store, job_id, now=now)
        if item.payload["kind"] == "finalize":
            manifest = finalize_job(job, keep_alive=_tolerant(between.keep_alive),
                                    may_publish=partial(_may_publish, ctx, job))
            if manifest is None:  # stopped while it merged: its parts stay, a resume merges again
                queues.finish_item(ctx.store, item, job_id, now=time.time())
                return "dropped"
            # A stop that landed since `_may_publish` looked does not keep this status away: the folder
            # holds the job's results now (finish_item.lua).
            queues.finish_item(ctx.store, item, job_id, now=time.time(), job_status="succeeded",
                               job_fields={"manifest": json.dumps(manifest)})
            # after the job is done: its outputs need not wait for this; only its own parts (a cancelled
            # job's in the same folder are that job's resumable work)
            remove_parts(Path(job["output_dir"]), job_id=job_id)
            return "finalized"
        started = time.monotonic()
        results = run_chunk(ctx, job, item, between)
        ctx.commits.submit(partial(commit_chunk, ctx, job, item, results, time.monotonic() - started))
        return "committing"
    except Exception as err:
        return settle_failure(ctx, item, err)


def _may_publish(ctx: WorkerContext, job: dict[str, Any]) -> bool:
    """Whether a finished merge may publish the job's outputs and manifest: not if the job was stopped
    (cancelled) while it merged, so a cancelled job's folder holds its parts, not results, and a
    resume merges again. Its input must still be the one submitted (else BadInput fails the job):
    the manifest names that file's checksum. A stat and one Redis call, as late as can be."""
    check_unchanged(Path(job["input_batch"]), job.get("input_stat"))
    return job_progress.start_item(ctx.store, job["id"], now=time.time()) == "running"


def _tolerant(keep_alive: Callable[[], None]) -> Callable[[], None]:
    """`keep_alive` for a merge: a Redis hiccup while extending the lease must not throw away a merge
    of GBs (at worst the lease runs out and another worker merges again, which is safe)."""
    def call() -> None:
        try:
            keep_alive()
        except Exception as err:
            log.warning("could not extend the finalize step's lease: %s", err)

    return call


def settle_failure(ctx: WorkerContext, item: LeasedItem, err: Exception) -> str:
    """What a failed job item leaves behind, by the retry matrix (`broker/retry_policy.py`): its
    failure is recorded by class on its job, and while the class has retries left the item waits out
    its backoff in Redis ('retry', `broker/retries.py`); else its job fails with the error, and its
    other items leave their queue ('failed').
    'dropped': the item was no longer this worker's (reaped, or its job stopped)."""
    job_id = item.payload["job"]
    failure_class = classify(err)
    delays = retry_delays(ctx.settings.retry_policy(failure_class), ctx.jitter.random)
    message = describe(err)
    outcome = retries.retry_later(ctx.store, item, failure_class=failure_class, error=message, delays=delays,
                                  now=time.time())
    if outcome.retried:
        log.warning("item %s of job %s failed (%s, %d so far), retried at %.3f: %s", item.item_id, job_id,
                    failure_class, outcome.failures, outcome.retry_at or 0.0, message,
                    exc_info=err if failure_class == "transient" and not isinstance(err, SitsError) else None)
        return "retry"
    if outcome.gone:
        return "dropped"
    error = message if outcome.failures <= 1 else (
        f"{item.item_id} failed {outcome.failures} times ({failure_class}); last error: {message}")
    log.warning("job %s failed on %s: %s", job_id, item.item_id, error)
    # As the reaper fails a job whose item went dead: its other items leave their queue too.
    job_stops.stop_job(ctx.store, job_id, status="failed", error=error, now=time.time())
    return "failed"


def commit_chunk(ctx: WorkerContext, job: dict[str, Any], item: LeasedItem, results: Mapping[str, np.ndarray],
                 run_seconds: float = 0.0) -> str:
    """Write a computed chunk's part files (durably), then ack it with the `run_seconds` its slot spent
    on it; on the commit thread (`sits_worker.chunk_commits`). Returns 'acked', or how the failure was
    settled."""
    try:
        queues.extend_lease(ctx.store, item, "", now=time.time(), lease_seconds=ctx.settings.scheduler.lease_timeout)
        if job_progress.start_item(ctx.store, job["id"], now=time.time()) != "running":
            # Cancelled, failed, or finished by another run of this chunk meanwhile: no part to
            # leave behind in a folder nobody merges any more.
            queues.finish_item(ctx.store, item, job["id"], now=time.time())
            return "dropped"
        write_part(Path(job["output_dir"]), item.payload["chunk"], results, job_id=job["id"])
        job_progress.ack_chunk(ctx.store, item, now=time.time(), worker=ctx.name, run_seconds=run_seconds)
        return "acked"
    except Exception as err:
        return settle_failure(ctx, item, err)


def run_chunk(ctx: WorkerContext, job: dict[str, Any], item: LeasedItem,
              between: MiniBatchHook) -> dict[str, np.ndarray]:
    """Run rows [start, stop) of a job in mini-batches; returns every output's rows, for `commit_chunk`.

    Online requests that `between_minibatches` hands over ride in a mini-batch: the first rows of the
    mini-batch fill their batch's empty rows (as many as `request_runs.rows_to_fill` allows), one run for
    both, the rest of the mini-batch runs after; they are completed right after their run, long
    before the chunk's ack.
    """
    start, stop = item.payload["start"], item.payload["stop"]
    output_names: list[str] = job["output_names"]
    input_path, input_stat = Path(job["input_batch"]), job.get("input_stat")
    check_unchanged(input_path, input_stat)  # a stat: before its rows are read
    source = ctx.job_input(job)
    session = ctx.session(job["model_ref"])  # looked up once per chunk, not per mini-batch
    results: dict[str, np.ndarray] = {}
    model_ref = job["model_ref"]

    def store_rows(row_indices: np.ndarray, outputs: Sequence[np.ndarray]) -> None:
        for name, array in zip(output_names, outputs, strict=True):
            if name not in results:
                results[name] = np.empty((stop - start, *array.shape[1:]), dtype=array.dtype)
            elif results[name].shape[1:] != array.shape[1:]:
                raise BadInput(f"output '{name}' has rows of shape {list(results[name].shape[1:])} and "
                               f"{list(array.shape[1:])} within rows [{start}, {stop}); outputs whose rows vary in "
                               "shape cannot be stored in one .npy")
            first = int(row_indices[0]) - start
            if int(row_indices[-1]) - start - first + 1 == len(row_indices):  # contiguous: a cheap slice copy
                results[name][first : first + len(row_indices)] = array
            else:  # jsonl rows grouped by length
                results[name][row_indices - start] = array

    for row_indices, feed in source.iter_batches(start, stop, job["batch_size"]):
        riders = between(feed)
        with between.running():
            if riders:
                row_indices, feed = _run_riders(ctx, model_ref, riders, row_indices, feed, store_rows, session)
            if len(row_indices):
                if ctx.faults is not None:
                    ctx.faults.check_rows(row_indices)
                store_rows(row_indices, ctx.run(model_ref, feed, output_names, session))
    # And after: rows read while the file was rewritten in place (same size, same inode) must not count
    # as done under the checksum of the file as submitted.
    check_unchanged(input_path, input_stat)
    return results


def _run_riders(ctx: WorkerContext, model_ref: str, riders: Sequence[LeasedItem], row_indices: np.ndarray,
                feed: dict[str, np.ndarray], store_rows: Callable[[np.ndarray, Sequence[np.ndarray]], None],
                session: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Run online requests that ride in a mini-batch with the rows `request_runs.rows_to_fill` allows (none
    fit: as a batch of their own); returns the mini-batch's rows still to run. Riders are given
    back to their queue if this fails before their run completed them."""
    try:
        fill = rows_to_fill(ctx, model_ref, riders, len(row_indices))
        if not fill:
            run_requests(ctx, riders)
            return row_indices, feed
        output_names = [output["name"] for output in ctx.model(model_ref)["signature"]["outputs"]]
        if ctx.faults is not None:
            ctx.faults.check_rows(row_indices[:fill])
        outputs = run_with_riders(ctx, model_ref, _rows(feed, 0, fill), output_names, riders, session)
    except Exception as err:
        give_back(ctx, riders, err)  # a no-op for those already completed
        raise
    store_rows(row_indices[:fill], outputs)
    return row_indices[fill:], _rows(feed, fill, len(row_indices))


def _rows(feed: Mapping[str, np.ndarray], first: int, last: int) -> dict[str, np.ndarray]:
    """Rows [first, last) of a mini-batch (views)."""
    return {name: array[first:last] for name, array in feed.items()}


def finalize_job(job: dict[str, Any], *, keep_alive: Callable[[], None],
                 may_publish: Callable[[], bool]) -> dict[str, Any] | None:
    """Merge the job's part files into its outputs and manifest (idempotent), calling `keep_alive`
    as the merge goes: a merge of GBs may outlast the lease, and a reaped finalize item would be
    merged again by a second worker, at the cost of an attempt. None when `may_publish`, asked once
    the merge is done, stopped it (`outputs.finalize_outputs`)."""
    ranges = jobs.chunk_ranges(job["rows_total"], job["chunk_size"])
    extra = {
        "job": job["id"],
        "model": job["model"],
        "model_version": job["model_version"],
        "input_batch": job["input_batch"],
        "input_checksum": job["input_checksum"],
    }
    return finalize_outputs(Path(job["output_dir"]), ranges, job["output_names"], extra, job_id=job["id"],
                            keep_alive=keep_alive, may_publish=may_publish)
