"""The trace context an item carries through Redis: the `traceparent` of the span that queued it, in its
payload, read back as the parent of the spans a worker makes for it (real Redis, the SDK's in-memory
exporter), and nothing at all while tracing is off."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
from opentelemetry import trace

from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.store import Store
from broker.tracing import spans
from tests.broker.broker_helpers import MODEL_REF, job_spec
from tests.leasing import lease_items
from tests.traces import named, recorded_spans, traceparent_of

CLIENT_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _payload(store: Store, item_id: str) -> dict:
    return json.loads(store.client.hget(store.keys.items, item_id))


def _spec(request_id: str) -> RequestSpec:
    return RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None, bucket="features:64",
                       factors={"level": 0, "enqueued_at": time.time()}, owner="alice", tenant="team-a")


def test_the_payload_field_is_the_current_spans_traceparent_and_empty_outside_any_span() -> None:
    with recorded_spans():
        assert spans.traceparent_field() == {}
        tracer = spans.tracer()
        assert tracer is not None
        with tracer.start_as_current_span("api request") as current:
            field = spans.traceparent_field()
            with spans.detached():  # (what a drain ticket is re-sent in: a trace of its own)
                assert spans.traceparent_field() == {}
        assert field == {"traceparent": traceparent_of(current)}  # type: ignore[arg-type]


def test_a_payloads_traceparent_is_the_parent_of_the_spans_made_for_its_item() -> None:
    payload = {"kind": "request", "traceparent": CLIENT_TRACEPARENT}
    with recorded_spans() as exporter:
        tracer = spans.tracer()
        assert tracer is not None
        tracer.start_span("sits.queue_wait", context=spans.item_context(payload)).end()
        for broken in ({}, {"traceparent": "00-not-a-trace-01"}, {"traceparent": 7}):
            assert spans.item_context(broken) is None
    [wait] = named(exporter, "sits.queue_wait")
    assert wait.parent is not None and wait.parent.is_remote
    assert (f"{wait.context.trace_id:032x}", f"{wait.parent.span_id:016x}") == (
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


def test_a_submitted_request_carries_its_enqueue_spans_traceparent_in_redis(store: Store) -> None:
    with recorded_spans() as exporter:
        tracer = spans.tracer()
        assert tracer is not None
        with tracer.start_as_current_span("POST /v2/models/mlp/infer"):
            requests.submit_request(store, _spec("r1"), score=1.0, now=time.time(), max_age_seconds=60)
    [enqueue] = named(exporter, "sits.enqueue")
    assert enqueue.attributes == {"sits.request_id": "r1", "sits.model_ref": MODEL_REF, "sits.tenant": "team-a",
                                  "sits.rows": 1}
    assert _payload(store, "r1")["traceparent"] == traceparent_of(enqueue)
    [served] = lease_items(store, MODEL_REF, now=time.time(), lease_seconds=30, max_items=4)
    with recorded_spans() as exporter:
        requests.complete_requests(store, [requests.RequestResult(served, outputs={})], now=time.time(),
                                   keep_seconds=60, batch_size=1, worker="w1")
    [ack] = named(exporter, "sits.ack")
    assert ack.attributes == {"sits.model_ref": MODEL_REF, "sits.items": 1}


def test_every_chunk_of_a_job_and_its_finalize_step_carry_the_jobs_trace(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    with recorded_spans() as exporter:
        job_fills.create_job(store, spec, now=time.time())
    [enqueue] = named(exporter, "sits.enqueue")
    assert enqueue.attributes["sits.job_id"] == spec.job_id
    chunks = lease_items(store, MODEL_REF, now=time.time(), lease_seconds=30, max_items=4, max_chunks=4)
    assert [item.payload["traceparent"] for item in chunks] == [traceparent_of(enqueue)] * 2
    for chunk in chunks:  # (tracing off in this worker: the finalize step still inherits the job's trace)
        job_progress.ack_chunk(store, chunk, now=time.time(), worker="w1")
    [finalize] = lease_items(store, MODEL_REF, now=time.time(), lease_seconds=30, max_items=1)
    assert finalize.payload["kind"] == "finalize" and finalize.payload["traceparent"] == traceparent_of(enqueue)


def test_with_tracing_off_no_item_carries_a_traceparent(store: Store) -> None:
    requests.submit_request(store, _spec("r2"), score=1.0, now=time.time(), max_age_seconds=60)
    assert "traceparent" not in _payload(store, "r2")
    assert spans.item_context({"traceparent": CLIENT_TRACEPARENT}) is None


def test_a_function_bound_to_the_current_context_runs_in_it_on_another_thread() -> None:
    seen: list[trace.SpanContext] = []
    with recorded_spans():
        tracer = spans.tracer()
        assert tracer is not None
        with tracer.start_as_current_span("sits.batch") as batch:
            commit = spans.bind_current(lambda: seen.append(trace.get_current_span().get_span_context()))
        thread = threading.Thread(target=commit)  # (a chunk's commit thread, after the batch span ended)
        thread.start()
        thread.join()
    assert seen == [batch.get_span_context()]


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    """The API's hook and the helpers every traced path calls first, with no OTEL_* variable: nothing of
    OpenTelemetry gets imported. (Without redis-py, which imports the SDK's metrics package whenever it is
    installed, whatever SITS does.)"""
    script = (
        "import sys\n"
        "from flask import Flask\n"
        "from broker.tracing import sdk, spans\n"
        "from sits_api.http.tracing import instrument_app\n"
        "assert not instrument_app(Flask('t'), {}) and not sdk.start_tracing('w', {'OTEL_SDK_DISABLED': 'true'})\n"
        f"assert spans.traceparent_field() == {{}} and spans.item_context({{'traceparent': '{CLIENT_TRACEPARENT}'}}) "
        "is None\n"
        "loaded = [name for name in sys.modules if name.startswith('opentelemetry')]\n"
        "print(loaded)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
