"""Running a merged batch of online requests: stack, run once, split, store, wake the waiters.

Requests in one batch share a shape bucket (the lease guarantees it), so
their tensors concatenate without padding and every request's rows come out
exactly as if it ran alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from broker import requests
from broker.errors import PermanentError
from broker.queues import LeasedItem
from broker.requests import RequestResult
from sits_worker.context import WorkerContext
from sits_worker.execution import run_with_fallback
from sits_worker.model.padding import pad_batch, unpad_outputs

log = logging.getLogger(__name__)


def run_requests(ctx: WorkerContext, items: Sequence[LeasedItem]) -> int:
    """Run leased requests of one model as one batch and complete them; returns how many succeeded."""
    model_ref = items[0].model_ref
    inputs = requests.load_inputs(ctx.store, items)
    results = [RequestResult(item, error="the request expired before it ran")
               for item, tensors in zip(items, inputs, strict=True) if tensors is None]
    live = [(item, tensors) for item, tensors in zip(items, inputs, strict=True) if tensors is not None]
    if live:
        try:
            results += _run_merged(ctx, model_ref, live)
        except PermanentError as err:
            # One bad request must not fail its neighbours: run each alone, fail only the bad ones.
            log.info("merged batch of %d on %s failed (%s); running its requests one by one",
                     len(live), model_ref, err.message)
            for entry in live:
                try:
                    results += _run_merged(ctx, model_ref, [entry])
                except PermanentError as single:
                    results.append(RequestResult(entry[0], error=single.message))
    requests.complete_requests(ctx.store, results, now=time.time(), keep_seconds=ctx.settings.online.result_ttl,
                               batch_size=len(items), worker=ctx.name)
    return sum(1 for result in results if not result.error)


def _run_merged(ctx: WorkerContext, model_ref: str,
                live: Sequence[tuple[LeasedItem, dict[str, np.ndarray]]]) -> list[RequestResult]:
    record = ctx.model(model_ref)
    output_names = [output["name"] for output in record["signature"]["outputs"]]
    spec = ctx.padding(model_ref)
    per_request = [tensors for _, tensors in live]
    rows = [next(iter(tensors.values())).shape[0] for tensors in per_request]
    if spec is not None:
        feed, lengths = pad_batch(per_request, spec)
    else:
        feed = {name: np.concatenate([tensors[name] for tensors in per_request]) for name in per_request[0]}
    outputs = dict(zip(output_names, run_with_fallback(ctx, ctx.session(model_ref), model_ref, feed, output_names),
                       strict=True))
    if spec is not None:
        split = unpad_outputs(outputs, lengths, rows, spec)
    else:
        starts = np.cumsum([0, *rows])
        split = [{name: array[first:last] for name, array in outputs.items()}
                 for first, last in zip(starts[:-1], starts[1:], strict=True)]
    return [RequestResult(item, outputs=own) for (item, _), own in zip(live, split, strict=True)]
