"""The worker's spans: each lease, each batch it runs, and each item's wait and run in the item's own trace.

A batch serves many traces at once, so its span (`sits.batch`) is the child of what runs it (the
drain task's span when Celery is traced, the chunk's batch for an urgent batch between its
mini-batches) and links to every request and chunk in it. The item's own trace, which its payload's
`traceparent` continues (`broker.tracing.spans`), gets two spans from the worker: `sits.queue_wait`,
from its enqueue to its lease, and `sits.item_run`, its part of the batch run, linked back to the
batch span. docs/tracing.md lists every span and its attributes.

Decorators, so the leasing and running code is unchanged: while tracing is off each costs one call
and one read of a global.
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from broker.queueing.leases import LeasedItem
from broker.tracing import spans
from sits_worker.serving.context import WorkerContext

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, Tracer

P = ParamSpec("P")
R = TypeVar("R")

_batch: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("sits_batch", default=None)
"""The batch running on this thread: requests that ride in a job's mini-batch join it (`riding`)."""


def traced_lease(function: Callable[P, list[LeasedItem]]) -> Callable[P, list[LeasedItem]]:
    """Wrap a lease call: when it leased items, a `sits.lease` span over the call, linked to each item,
    and each item's `sits.queue_wait`, from its enqueue to this lease, in its own trace."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> list[LeasedItem]:
        tracer = spans.tracer()
        if tracer is None:
            return function(*args, **kwargs)
        began = time.time_ns()
        items = function(*args, **kwargs)
        if items:
            _record_lease(tracer, items, began, time.time_ns())
        return items

    return wrapper


def traced_batch(items_of: Callable[..., Sequence[LeasedItem]]) -> Callable[
        [Callable[Concatenate[WorkerContext, P], R]], Callable[Concatenate[WorkerContext, P], R]]:
    """Run the decorated function (its first argument the worker's context) as one batch: a `sits.batch`
    span, current while it runs, linked to the items `items_of` picks from its arguments, and each item's
    `sits.item_run`."""

    def decorate(function: Callable[Concatenate[WorkerContext, P], R]) -> Callable[Concatenate[WorkerContext, P], R]:
        @functools.wraps(function)
        def wrapper(ctx: WorkerContext, *args: P.args, **kwargs: P.kwargs) -> R:
            tracer = spans.tracer()
            if tracer is None:
                return function(ctx, *args, **kwargs)
            with _batch_span(tracer, items_of(ctx, *args, **kwargs), worker=ctx.name):
                return function(ctx, *args, **kwargs)

        return wrapper

    return decorate


def riding(riders_of: Callable[..., Sequence[LeasedItem]]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Requests that ride in a running job chunk's mini-batch join its batch while the decorated function
    runs them: the batch span links to each, and each gets its `sits.item_run`, ended when they are
    answered. (Outside a batch, a batch of their own.)"""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            tracer = spans.tracer()
            if tracer is None:
                return function(*args, **kwargs)
            batch, riders = _batch.get(), riders_of(*args, **kwargs)
            if batch is None:
                with _batch_span(tracer, riders, worker=""):
                    return function(*args, **kwargs)
            runs = batch.join(riders)
            try:
                return function(*args, **kwargs)
            finally:
                _end_all(runs)

        return wrapper

    return decorate


def _record_lease(tracer: Tracer, items: Sequence[LeasedItem], began: int, ended: int) -> None:
    """The `sits.lease` span of a lease call that took `items`, and each item's `sits.queue_wait`."""
    parents = [(item, spans.item_context(item.payload)) for item in items]
    links = [_link(parent) for _, parent in parents if parent is not None]
    lease = tracer.start_span("sits.lease", start_time=began, links=links,
                              attributes={"sits.model_ref": items[0].model_ref, "sits.items": len(items)})
    lease.end(end_time=ended)
    for item, parent in parents:
        if parent is None:
            continue
        enqueued = (item.payload.get("factors") or {}).get("enqueued_at")
        wait = tracer.start_span("sits.queue_wait", context=parent,
                                 start_time=spans.seconds_to_ns(float(enqueued)) if enqueued else began,
                                 attributes={**_item_attributes(item), "sits.attempt": item.attempts})
        wait.end(end_time=ended)


@contextmanager
def _batch_span(tracer: Tracer, items: Sequence[LeasedItem], *, worker: str) -> Iterator[_Batch]:
    """A `sits.batch` span over the block, current in it, and the `sits.item_run` span of each item."""
    kinds = {str(item.payload.get("kind")) for item in items}
    attributes: dict[str, Any] = {"sits.batch.kind": "chunk" if "chunk" in kinds else "/".join(sorted(kinds)),
                                  "sits.items": len(items), "sits.worker": worker}
    if items:
        attributes["sits.model_ref"] = items[0].model_ref
    with tracer.start_as_current_span("sits.batch", attributes=attributes) as span:  # (`join` links the items)
        batch = _Batch(tracer, span)
        runs = batch.join(items)
        token = _batch.set(batch)
        try:
            yield batch
        finally:
            _batch.reset(token)
            _end_all(runs)


class _Batch:
    """A running batch's span, which requests riding in it join."""

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self._tracer, self._span = tracer, span

    def join(self, items: Sequence[LeasedItem]) -> list[Span]:
        """Link the batch to `items` and start their `sits.item_run` spans (returned, for the caller to end)."""
        from opentelemetry import trace

        runs = []
        batch_link = trace.Link(self._span.get_span_context())
        for item in items:
            parent = spans.item_context(item.payload)
            if parent is None:
                continue
            self._span.add_link(_link(parent).context)
            runs.append(self._tracer.start_span("sits.item_run", context=parent, links=[batch_link],
                                                attributes=_item_attributes(item)))
        return runs


def _link(parent: Context) -> Link:
    """A link to the span an item's payload names (`spans.item_context`): the one that queued it."""
    from opentelemetry import trace

    return trace.Link(trace.get_current_span(parent).get_span_context())


def _end_all(runs: Sequence[Span]) -> None:
    for run in runs:
        run.end()


def _item_attributes(item: LeasedItem) -> dict[str, Any]:
    """What names an item on its spans: its id, kind, model version and tenant."""
    return {"sits.item_id": item.item_id, "sits.item.kind": str(item.payload.get("kind") or ""),
            "sits.model_ref": item.model_ref, "sits.tenant": str(item.payload.get("tenant") or "")}
