"""Running online requests: as a merged batch of their own, or riding in a job chunk's mini-batch.

Requests in one batch share a shape bucket (the lease guarantees it), so
their tensors concatenate (token requests padded to the longest, when the
model declares a mask) and every request's rows come out exactly as if it
ran alone. A job's mini-batch is just one more entry of such a batch: its
rows first, the riders' after, one `session.run` for all. A merged run that
fails permanently is bisected (`broker.failures.quarantine.isolate_bad_rows`): only
the bad requests fail, with their own error, in about log2(n) runs each.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from broker.errors import BadInput, InferenceTimeout, PermanentError, SitsError
from broker.failures import quarantine, retries
from broker.failures.retry_policy import classify, describe, retry_delays
from broker.monitoring.sla_metrics import priority_class
from broker.online import requests
from broker.online.requests import RequestResult
from broker.queueing import leases
from broker.queueing.leases import LeasedItem
from broker.queueing.scoring import estimate_latency_ms
from broker.queueing.scoring import rows_to_fill as rows_to_fill_by_profile
from broker.tuning import windows
from sits_worker.model.padding import MaskSpec, pad_batch, unpad_outputs
from sits_worker.serving import batch_trace, drain_report
from sits_worker.serving.context import SIZE_ERRORS, WorkerContext
from sits_worker.tenancy.usage_meter import Work

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]


@batch_trace.traced_batch(lambda ctx, items, *_, **__: items)
def run_requests(ctx: WorkerContext, items: Sequence[LeasedItem], ticket: str = "") -> int:
    """Run leased requests of one model as one batch and complete them; returns how many ran
    without error (a request completed meanwhile by another run keeps its first result). Their
    leases (and the drain task's `ticket`) are kept alive however long the run takes."""
    model_ref = items[0].model_ref
    results, live = _load(ctx, items)
    _charge_unrun(ctx, model_ref, results)
    run_started = time.time()
    if live:
        drain_report.note_requests(len(live))
        failure: Exception | None = None
        with ctx.usage.billing(model_ref, _work(live, run_started)), ctx.lease_keeper.holding(items, ticket):
            try:
                results += _run_merged(ctx, model_ref, live)
            except Exception as err:
                if isinstance(err, SitsError) and _isolates(err, len(live)):
                    # One bad request must not fail its neighbours: bisect the batch, fail only the bad ones.
                    log.info("merged batch of %d on %s failed (%s); splitting it to find the bad requests",
                             len(live), model_ref, describe(err))
                    try:
                        results += _run_isolating(ctx, model_ref, live, err)
                    except Exception as single:
                        failure = single
                else:
                    failure = err
        if failure is not None:  # (once the keeper no longer extends the leases a retry parks)
            results += _settle_failed_run(ctx, [item for item, _ in live], failure)
    if results:  # (none when every request waits for a retry)
        now = time.time()
        requests.complete_requests(ctx.store, results, now=now, keep_seconds=ctx.settings.online.result_ttl,
                                   batch_size=len(items), worker=ctx.name, run_started=run_started,
                                   run_rows=_rows(live))
        note_for_tuning(ctx, model_ref, results, batch_rows=_rows(live), now=now)
    return sum(1 for result in results if not result.error)


def _isolates(err: Exception, requests_in_run: int) -> bool:
    """Whether a merged run that failed with `err` is split to find the requests that fail on their own."""
    return isinstance(err, PermanentError) or (isinstance(err, SIZE_ERRORS) and requests_in_run > 1)


def note_for_tuning(ctx: WorkerContext, model_ref: str, results: Sequence[RequestResult], *, batch_rows: int,
                        now: float) -> None:
    """Note each completed request (its latency from submit to `now`, its priority class, its deadline's
    outcome) for the tuning loops: the batching controller, when it steers the model, and the weight learner,
    while it runs (`broker/tuning/windows.py`). A note Redis cannot take is dropped (a window with fewer
    answers moves nothing)."""
    if not (ctx.batching(model_ref).closed_loop or ctx.settings.tuning.weights.every > 0):
        return
    notes = [_note(result, now) for result in results if result.ran or result.error]
    try:
        windows.note_answers(ctx.store, model_ref, notes, batch_rows, now=now)
    except SitsError as err:
        log.warning("could not note %d answers of %s for the tuning loops: %s", len(notes), model_ref, err.message)


def _note(result: RequestResult, now: float) -> windows.Note:
    payload = result.item.payload
    factors = payload.get("factors") or {}
    deadline_at = payload.get("deadline_at")
    deadline = windows.NO_DEADLINE if not deadline_at else (
        windows.MET if not result.error and now <= float(deadline_at) else windows.MISSED)
    latency = None if result.error else now - float(factors.get("enqueued_at") or now)
    return windows.Note(latency, priority_class(int(factors.get("base_level", factors.get("level")) or 0)), deadline)


def _settle_failed_run(ctx: WorkerContext, items: Sequence[LeasedItem], err: Exception) -> list[RequestResult]:
    """Requests whose run failed, by the retry matrix (`broker/failures/retry_policy.py`), their failure recorded:
    those with retries left in the failure's class wait out its backoff in Redis; the results of the
    others, failed with the error. When Redis itself is away, `err` goes on up: the leases expire."""
    failure_class = classify(err)
    policy = ctx.settings.retry_policy(failure_class)
    message = describe(err)
    code = err.code if isinstance(err, SitsError) else SitsError.code
    failed = []
    try:
        for item in items:
            outcome = retries.retry_later(ctx.store, item, failure_class=failure_class, error=message,
                                          delays=retry_delays(policy, ctx.jitter.random), now=time.time())
            if not outcome.retried and not outcome.gone:
                failed.append(RequestResult(item, error=message, code=code))
    except SitsError:
        raise err from None
    log.log(logging.INFO if isinstance(err, PermanentError) else logging.WARNING,
            "a batch of %d requests of %s failed (%s): %d retried later, %d failed: %s", len(items),
            items[0].model_ref, failure_class, len(items) - len(failed), len(failed), message)
    return failed


@batch_trace.riding(lambda ctx, model_ref, feed, output_names, riders, *_, **__: riders)
def run_with_riders(ctx: WorkerContext, model_ref: str, feed: Tensors, output_names: list[str],
                    riders: Sequence[LeasedItem], session: Any = None,
                    payer: Work | None = None) -> list[np.ndarray] | None:
    """Run a job's mini-batch `feed` with online requests riding along in the same run; complete the
    riders and return the job rows' outputs (in `output_names` order). The run is billed to the job's
    tenant (`payer`, its rows) and the riders' by their rows.

    When the merged run fails permanently, the riders run apart (bisected, as in `run_requests`) and
    the mini-batch alone; None when that fails for its input too: the riders are answered, and the
    caller bisects the job rows (`execution.ChunkRows`). Any other error is raised: the caller gives
    the riders back (`give_back`) and the chunk retries.
    """
    results, live = _load(ctx, riders)
    _charge_unrun(ctx, model_ref, results)
    run_started = time.time()
    job_rows = len(next(iter(feed.values())))
    job_outputs: Tensors | None = None
    work = [*([replace(payer, rows=job_rows)] if payer else []), *_work(live, run_started)]
    # (the chunk's own lease is held around each mini-batch)
    with ctx.usage.billing(model_ref, work), ctx.lease_keeper.holding(riders):
        if live:
            drain_report.note_requests(len(live))
            try:
                job_outputs, rider_results = _run_with_job(ctx, model_ref, feed, live, session)
                results += rider_results
            except (PermanentError, *SIZE_ERRORS) as err:  # (a rider's size must not fail the job's rows)
                log.info("mini-batch with %d riders on %s failed (%s); running them apart",
                         len(live), model_ref, err.message)
                results += _run_apart(ctx, model_ref, live)
        if job_outputs is None:
            try:
                job_outputs = dict(zip(output_names, ctx.run(model_ref, feed, output_names, session), strict=True))
            except BadInput:  # (the riders are completed all the same; the caller bisects the job rows)
                pass
    now = time.time()
    requests.complete_requests(ctx.store, results, now=now, keep_seconds=ctx.settings.online.result_ttl,
                               batch_size=job_rows + len(riders), worker=ctx.name, job_rows=job_rows,
                               run_started=run_started, run_rows=job_rows + _rows(live))
    note_for_tuning(ctx, model_ref, results, batch_rows=job_rows + _rows(live), now=now)
    return None if job_outputs is None else [job_outputs[name] for name in output_names]


def give_back(ctx: WorkerContext, items: Sequence[LeasedItem], err: BaseException | None = None) -> None:
    """Return leased requests to their queue after a run that could not complete them. With the run's
    `err`, as the retry matrix says for its class (`_settle_failed_run`: a backoff in Redis, or failed
    once their attempts are used up); else, or when that cannot reach Redis, their leases expire now
    and the reaper re-queues them on its next pass, an attempt counted. A no-op for those completed."""
    if isinstance(err, Exception) and not isinstance(err, PermanentError):
        try:
            failed = _settle_failed_run(ctx, items, err)
            if failed:
                requests.complete_requests(ctx.store, failed, now=time.time(),
                                           keep_seconds=ctx.settings.online.result_ttl, batch_size=len(items),
                                           worker=ctx.name)
            return
        except Exception as settling:
            log.warning("could not settle %d requests by their failure's class: %s", len(items), settling)
    for item in items:
        leases.expire_lease_now(ctx.store, item)


def rows_to_fill(ctx: WorkerContext, model_ref: str, riders: Sequence[LeasedItem], available: int) -> int:
    """How many of `available` job rows may fill the riders' batch (`scoring.rows_to_fill`, within the
    model's `max_batch_size` and `scheduler.merge_latency_factor`)."""
    return rows_to_fill_by_profile(ctx.model(model_ref), own_rows=sum(int(item.payload.get("rows") or 1)
                                                                      for item in riders),
                                   available=available,
                                   max_rows=ctx.batching(model_ref).max_batch_size,
                                   factor=ctx.settings.scheduler.merge_latency_factor)


def _load(ctx: WorkerContext, items: Sequence[LeasedItem]) -> tuple[list[RequestResult],
                                                                      list[tuple[LeasedItem, Tensors]]]:
    """(Results of requests that expired before they ran, the live requests with their tensors).

    A request expired when its record is gone (`online.result_ttl`), or when its `expires_at` (a v2
    `timeout`, which Triton enforces the same way) passed before this worker leased it: running it
    then would only spend a slot on an answer its client no longer waits for."""
    now = time.time()
    timed_out = [item for item in items if float(item.payload.get("expires_at") or math.inf) < now]
    results = [RequestResult(item, error=f"the request's timeout passed {now - item.payload['expires_at']:.3f} s "
                                         "before a worker could take it; it was not run (give it a longer "
                                         "'timeout', or send it when the queue is shorter)",
                             code=InferenceTimeout.code, ran=False) for item in timed_out]
    items = [item for item in items if float(item.payload.get("expires_at") or math.inf) >= now]
    inputs = requests.load_inputs(ctx.store, items) if items else []
    results += [RequestResult(item, error="the request expired before it ran", code=InferenceTimeout.code,
                              ran=False) for item, tensors in zip(items, inputs, strict=True) if tensors is None]
    live = [(item, tensors) for item, tensors in zip(items, inputs, strict=True) if tensors is not None]
    return results, live


def _charge_unrun(ctx: WorkerContext, model_ref: str, unrun: Sequence[RequestResult]) -> None:
    """Charge requests leased and not run (`_load`) to their tenants' usage, which fair share ranks by: the
    model's profiled run of their rows (`UsageMeter.charge`; on no bill). A lease marks their tenants present
    and may hold the others' requests for them; were that free, a tenant could keep the first rank with
    requests that never run."""
    if not unrun:
        return
    work = [Work(str(result.item.payload.get("tenant") or ""), str(result.item.payload.get("owner") or ""),
                 int(result.item.payload.get("rows") or 1)) for result in unrun]
    tokens = [token for result in unrun if isinstance(token := result.item.payload.get("tokens"), int)]
    seconds = estimate_latency_ms(ctx.model(model_ref), rows=sum(part.rows for part in work),
                                  tokens=sum(tokens) if len(tokens) == len(unrun) else None) / 1000
    ctx.usage.charge(model_ref, work, seconds)


def _work(live: Sequence[tuple[LeasedItem, Tensors]], run_started: float) -> list[Work]:
    """What each live request brings to its run's bill: its tenant's rows, one request, its queue time."""
    work = []
    for item, tensors in live:
        enqueued = float((item.payload.get("factors") or {}).get("enqueued_at") or run_started)
        work.append(Work(str(item.payload.get("tenant") or ""), str(item.payload.get("owner") or ""),
                         len(next(iter(tensors.values()))), 1, max(0.0, run_started - enqueued)))
    return work


def _rows(live: Sequence[tuple[LeasedItem, Tensors]]) -> int:
    """Rows of the live requests' tensors (each request's first input's axis 0)."""
    return sum(next(iter(tensors.values())).shape[0] for _, tensors in live)


def _run_apart(ctx: WorkerContext, model_ref: str, live: Sequence[tuple[LeasedItem, Tensors]]) -> list[RequestResult]:
    """Run requests as one batch of their own, bisected if that fails permanently or for a size
    (`_run_isolating`); one request that fails for its size alone is settled by its failure's class."""
    try:
        return _run_merged(ctx, model_ref, live)
    except (PermanentError, *SIZE_ERRORS) as err:
        if not _isolates(err, len(live)):
            return _settle_failed_run(ctx, [item for item, _ in live], err)
        return _run_isolating(ctx, model_ref, live, err)


def _run_isolating(ctx: WorkerContext, model_ref: str, live: Sequence[tuple[LeasedItem, Tensors]],
                   error: SitsError) -> list[RequestResult]:
    """The results of requests whose merged run failed with `error` (permanent, or one of `SIZE_ERRORS`): the
    batch split in halves until each failing request ran alone (`quarantine.isolate_bad_rows`); those fail
    with their own error, recorded by class (bad input: never retried, by default; out of memory: retried
    as `retry.device_oom` says), the others get their outputs."""
    results: list[RequestResult] = []

    def attempt(lo: int, hi: int) -> SitsError | None:
        # (each run billed to the requests in it: the one that fails in every run pays for its search)
        with ctx.usage.billing(model_ref, _work(live[lo:hi], time.time()), rerun=True):
            try:
                results.extend(_run_merged(ctx, model_ref, live[lo:hi]))
            except (PermanentError, *SIZE_ERRORS) as err:
                return err
        return None

    found = quarantine.isolate_bad_rows(len(live), error, attempt)
    log.info("%d of %d merged requests of %s failed on their own (%d runs)", len(found.bad), len(live), model_ref,
             found.runs)
    for offset, own in found.bad:
        results += _settle_failed_run(ctx, [live[offset][0]], own)
    return results


def _run_merged(ctx: WorkerContext, model_ref: str,
                live: Sequence[tuple[LeasedItem, Tensors]]) -> list[RequestResult]:
    per_request = _run_entries(ctx, model_ref, [tensors for _, tensors in live])
    return [RequestResult(item, outputs=own) for (item, _), own in zip(live, per_request, strict=True)]


def _run_with_job(ctx: WorkerContext, model_ref: str, feed: Tensors, live: Sequence[tuple[LeasedItem, Tensors]],
                  session: Any) -> tuple[Tensors, list[RequestResult]]:
    job_outputs, *per_request = _run_entries(ctx, model_ref, [feed, *(tensors for _, tensors in live)], session)
    return job_outputs, [RequestResult(item, outputs=own) for (item, _), own in zip(live, per_request, strict=True)]


def _run_entries(ctx: WorkerContext, model_ref: str, entries: Sequence[Tensors], session: Any = None) -> list[Tensors]:
    """Run entries of rows (requests, or a job's mini-batch) as one batch; every entry's own outputs."""
    output_names = ctx.model(model_ref).output_names
    feed, split = _merge(entries, ctx.padding(model_ref))
    outputs = dict(zip(output_names, ctx.run(model_ref, feed, output_names, session), strict=True))
    return split(outputs)


def _merge(entries: Sequence[Tensors], spec: MaskSpec | None) -> tuple[Tensors, Callable[[Tensors], list[Tensors]]]:
    """One feed for entries of one shape bucket, and how to cut its outputs back per entry."""
    rows = [next(iter(tensors.values())).shape[0] for tensors in entries]
    if spec is not None:
        feed, lengths = pad_batch(entries, spec)
        return feed, lambda outputs: unpad_outputs(outputs, lengths, rows, spec)
    if len(entries) == 1:
        return dict(entries[0]), lambda outputs: [outputs]
    feed = {name: np.concatenate([tensors[name] for tensors in entries]) for name in entries[0]}
    starts = np.cumsum([0, *rows])

    def split(outputs: Tensors) -> list[Tensors]:
        return [{name: array[first:last] for name, array in outputs.items()}
                for first, last in zip(starts[:-1], starts[1:], strict=True)]

    return feed, split
