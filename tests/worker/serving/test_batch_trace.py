"""The worker's spans on its real lease and run paths (real Redis, a real `WorkerContext`, ONNX Runtime on the
CPU, the SDK's in-memory exporter): each item's trace continues from its payload, and a batch's span,
the child of what runs it, links to every request in it, riders joining a chunk's batch included."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.store import Store
from broker.tracing import spans
from sits_worker.serving import batch_trace, leasing
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.request_runs import run_requests, run_with_riders
from tests.traces import named, recorded_spans
from tests.worker.worker_helpers import mlp_worker_context

MODEL_REF = "mlp@v1"


def _submit_traced(store: Store, count: int, enqueued_at: float) -> list[str]:
    """Submit `count` requests, each in a trace of its own (as the API's request spans make them); the
    ids of their `sits.enqueue` spans' traces, in order."""
    tracer = spans.tracer()
    assert tracer is not None
    traces = []
    for index in range(count):
        spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                           inputs={"features": np.full((1, 64), index, np.float32)}, rows=1, tokens=None,
                           bucket="features:64", factors={"level": 0, "enqueued_at": enqueued_at}, owner="alice")
        with tracer.start_as_current_span("POST /v2/models/mlp/infer") as api:
            requests.submit_request(store, spec, score=float(index), now=enqueued_at, max_age_seconds=60)
        traces.append(api.get_span_context().trace_id)
    return traces


def _links(span) -> set[tuple[int, int]]:
    return {(link.context.trace_id, link.context.span_id) for link in span.links}


def test_a_lease_and_a_batch_of_requests_link_to_each_request_and_continue_its_trace(store: Store,
                                                                                  zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    enqueued_at = time.time() - 0.5
    with recorded_spans() as exporter:
        traces = _submit_traced(store, 2, enqueued_at)
        items = leasing.lease(ctx, MODEL_REF, "")
        assert run_requests(ctx, items) == 2
    enqueues = {span.context.trace_id: span for span in named(exporter, "sits.enqueue")}
    request_spans = {(trace, enqueues[trace].context.span_id) for trace in traces}
    [lease], [batch], [ack] = named(exporter, "sits.lease"), named(exporter, "sits.batch"), named(exporter, "sits.ack")
    assert _links(lease) == _links(batch) == request_spans
    assert batch.attributes["sits.batch.kind"] == "request" and batch.attributes["sits.items"] == 2
    assert ack.parent is not None and ack.parent.span_id == batch.context.span_id
    for name in ("sits.queue_wait", "sits.item_run"):  # each request's own trace, the child of its enqueue span
        found = named(exporter, name)
        assert {(span.context.trace_id, span.parent.span_id) for span in found if span.parent} == request_spans
    for wait in named(exporter, "sits.queue_wait"):
        assert wait.start_time == spans.seconds_to_ns(enqueued_at) and wait.end_time == lease.end_time
    for run in named(exporter, "sits.item_run"):
        assert _links(run) == {(batch.context.trace_id, batch.context.span_id)}
        assert batch.start_time <= run.start_time <= run.end_time <= batch.end_time


def test_requests_riding_in_a_chunks_mini_batch_join_its_batch_until_they_are_answered(store: Store,
                                                                                    zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)

    @batch_trace.traced_batch(lambda ctx, riders: [])
    def chunk_run(ctx: WorkerContext, riders: list) -> list[np.ndarray] | None:  # (a chunk's batch, its rows alone)
        outputs = run_with_riders(ctx, MODEL_REF, {"features": np.zeros((3, 64), np.float32)}, ["logits"], riders)
        time.sleep(0.01)  # (the chunk's next mini-batches)
        return outputs

    with recorded_spans() as exporter:
        traces = _submit_traced(store, 2, time.time())
        riders = leasing.lease_riders(ctx, MODEL_REF, {"features": np.zeros((3, 64), np.float32)}, "")
        assert len(riders) == 2
        outputs = chunk_run(ctx, riders)
    assert outputs is not None and outputs[0].shape == (3, 10)
    [batch], [ack] = named(exporter, "sits.batch"), named(exporter, "sits.ack")
    assert {trace for trace, _ in _links(batch)} == set(traces)  # linked as they joined
    assert ack.parent is not None and ack.parent.span_id == batch.context.span_id
    runs = named(exporter, "sits.item_run")
    assert {run.context.trace_id for run in runs} == set(traces)
    assert all(ack.end_time <= run.end_time < batch.end_time for run in runs)  # answered, then the chunk goes on
    assert len(named(exporter, "sits.queue_wait")) == 2 and len(named(exporter, "sits.lease")) == 1


def test_untraced_items_and_tracing_off_leave_the_runs_as_they_are(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir)
    spec = RequestSpec(request_id="plain", model_name="mlp", model_version="v1",
                       inputs={"features": np.ones((2, 64), np.float32)}, rows=2, tokens=None, bucket="features:64",
                       factors={"level": 0, "enqueued_at": time.time()}, owner="alice")
    requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=60)  # (tracing off)
    with recorded_spans() as exporter:
        items = leasing.lease(ctx, MODEL_REF, "")
        assert run_requests(ctx, items) == 1
    [batch] = named(exporter, "sits.batch")
    assert batch.links == () and not named(exporter, "sits.queue_wait") and not named(exporter, "sits.item_run")
    assert requests.get_request(store, "plain").status == "succeeded"
