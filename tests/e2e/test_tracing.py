"""Traces end to end: the API and a real worker, in subprocesses, export their spans over OTLP/HTTP to a
receiver in the test, which decodes them with the exporter's own protobuf classes.

One trace per request and per job, from the API's handling through the queue to the batch that ran
it; a batch's span (its own, under the drain task's) links to every item in it; a client's
`traceparent` is continued.
"""

from __future__ import annotations

import gzip
import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, start_stack, wait_job

WAIT_SECONDS = 20.0
"""The longest a test waits for the spans it looks for (the processes export every 100 ms)."""


@dataclass(frozen=True)
class Span:
    """One span as the receiver decoded it: ids as hex, times in ns since the epoch."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]


class Receiver:
    """An OTLP/HTTP trace receiver (`POST /v1/traces`): every span exported to it, in arrival order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        decoded = []
        for resource_spans in request.resource_spans:
            service = next((attribute.value.string_value for attribute in resource_spans.resource.attributes
                            if attribute.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                decoded += [_span(service, span) for span in scope_spans.spans]
        with self._lock:
            self.spans += decoded

    def wait_for(self, found: Callable[[list[Span]], Any], what: str) -> Any:
        """What `found` returns for the spans received so far, once it is truthy."""
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            with self._lock:
                spans = list(self.spans)
            result = found(spans)
            if result:
                return result
            assert time.monotonic() < deadline, f"no {what} within {WAIT_SECONDS} s; spans: {_names(spans)}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _span(service: str, span: SpanProto) -> Span:
    return Span(service=service, name=span.name, kind=SpanProto.SpanKind.Name(span.kind), trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(), start=span.start_time_unix_nano,
                end=span.end_time_unix_nano,
                attributes={attribute.key: _value(attribute.value) for attribute in span.attributes},
                links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links))


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _names(spans: list[Span]) -> list[str]:
    return sorted({f"{span.service}:{span.name}" for span in spans})


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    """A stack of one CPU worker whose API and worker export their spans to a receiver, with the mlp."""
    from sits_worker.model.zoo import build_zoo

    receiver = Receiver()
    home = tmp_path_factory.mktemp("traced-stack") / "home"
    with pytest.MonkeyPatch.context() as patch:  # (the children's environment: the test process traces nothing)
        patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        patch.delenv("OTEL_SDK_DISABLED", raising=False)
        patch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        running = start_stack(home, workers=1, streams=1)
    try:
        register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
        yield running, receiver
    finally:
        running.stop()
        receiver.stop()


def _infer(stack: Stack, rows: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    features = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
    body = {"inputs": [{"name": "features", "shape": [rows, 64], "datatype": "FP32",
                        "data": features.ravel().tolist()}]}
    request = urllib.request.Request(stack.api_url + "/v2/models/mlp/infer", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {stack.api_key}", **(headers or {})})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def _one(spans: list[Span], name: str, **where: Any) -> Span | None:
    """The one span called `name` whose fields (or attributes, by their dotted names) are as `where` says."""
    found = [span for span in spans if span.name == name
             and all(getattr(span, key, span.attributes.get(key.replace("__", "."))) == value
                     for key, value in where.items())]
    assert len(found) <= 1, found
    return found[0] if found else None


def _linked_to(spans: list[Span], name: str, target: Span) -> list[Span]:
    """The spans called `name` that link to `target`."""
    return [span for span in spans if span.name == name and (target.trace_id, target.span_id) in span.links]


def _request_trace(receiver: Receiver, enqueue: Span) -> dict[str, Any]:
    """The spans of one online request's trace (API and worker), its batch and the lease that took it."""

    def complete(spans: list[Span]) -> dict[str, Any] | None:
        own = [span for span in spans if span.trace_id == enqueue.trace_id]
        found = {
            "server": next((span for span in own if span.kind == "SPAN_KIND_SERVER"), None),
            "await": _one(own, "sits.await_result"),
            "wait": _one(own, "sits.queue_wait"),
            "run": _one(own, "sits.item_run"),
            "lease": next(iter(_linked_to(spans, "sits.lease", enqueue)), None),
            "batch": next(iter(_linked_to(spans, "sits.batch", enqueue)), None),
        }
        if found["batch"] is not None:
            found["ack"] = _one(spans, "sits.ack", parent_id=found["batch"].span_id)
        return found if all(span is not None for span in found.values()) and "ack" in found else None

    return receiver.wait_for(complete, f"complete trace of the request of {enqueue}")


def test_a_v2_request_is_one_trace_from_the_api_through_its_batch_to_the_answer(traced):
    stack, receiver = traced
    seen = {span.span_id for span in receiver.spans}
    _infer(stack, rows=2)
    enqueue = receiver.wait_for(lambda spans: [span for span in spans if span.name == "sits.enqueue"
                                               and span.span_id not in seen], "enqueue span")[0]
    assert enqueue.service == "sits-api" and enqueue.attributes["sits.model_ref"].startswith("mlp@")
    trace = _request_trace(receiver, enqueue)
    server, wait, run, batch = trace["server"], trace["wait"], trace["run"], trace["batch"]

    # The API: its request span is the root (no client trace), the enqueue and the wait for the answer its children.
    assert server.service == "sits-api" and server.parent_id == "" and "/infer" in server.name
    assert enqueue.parent_id == trace["await"].parent_id == server.span_id
    # The worker continues the same trace from the item's payload: queue wait, then its part of the batch.
    assert wait.service == run.service == "sits-worker"
    assert wait.parent_id == run.parent_id == enqueue.span_id
    assert wait.attributes["sits.item_id"] == enqueue.attributes["sits.request_id"]
    # The batch is a trace of its own (under the drain task that ran it), linked to the request both ways.
    assert batch.trace_id != enqueue.trace_id and (batch.trace_id, batch.span_id) in run.links
    assert batch.attributes["sits.batch.kind"] == "request"
    assert trace["lease"].trace_id == batch.trace_id and trace["ack"].trace_id == batch.trace_id
    drain = receiver.wait_for(lambda spans: _one(spans, "run/sits.drain", span_id=batch.parent_id), "drain task span")
    assert drain.service == "sits-worker"
    # A drain trace is one time slice: a ticket sent on for its next slice (by a publish span) starts a new one.
    sent = receiver.wait_for(lambda spans: True if drain.parent_id == "" else _one(spans, "apply_async/sits.drain",
                                                                                   span_id=drain.parent_id),
                             "the drain task's publish span")
    assert sent is True or sent.parent_id == ""
    # In time: the wait counts from the request's acceptance (its `enqueued_at`, as the queue-time figures do),
    # through its enqueue, until the lease; then it ran, was acked, and the API's wait ended with the answer.
    assert server.start <= wait.start <= enqueue.end <= wait.end
    assert wait.end <= batch.start <= trace["ack"].start <= trace["await"].end <= server.end


def test_a_clients_traceparent_is_continued_through_the_worker(traced):
    stack, receiver = traced
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    _infer(stack, rows=3, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    server = receiver.wait_for(lambda spans: next((span for span in spans if span.trace_id == trace_id
                                                   and span.kind == "SPAN_KIND_SERVER"), None), "the client's trace")
    assert server.service == "sits-api" and server.parent_id == parent_id
    enqueue = receiver.wait_for(lambda spans: _one(spans, "sits.enqueue", trace_id=trace_id), "enqueue span")
    trace = _request_trace(receiver, enqueue)
    assert trace["wait"].trace_id == trace["run"].trace_id == trace_id


def test_a_job_is_one_trace_from_its_submit_to_its_chunks_and_finalize_step(traced):
    stack, receiver = traced
    np.save(stack.home / "traced.npy", np.random.default_rng(5).standard_normal((40, 64)).astype(np.float32))
    client = stack.client()
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(stack.home / "traced.npy"),
                                   "output_dir": str(stack.home / "out-traced"), "chunk_size": 20})
    assert wait_job(client, job["id"])["status"] == "succeeded"
    enqueue = receiver.wait_for(lambda spans: _one(spans, "sits.enqueue", sits__job_id=job["id"]), "job enqueue span")
    server = receiver.wait_for(lambda spans: next((span for span in spans if span.span_id == enqueue.parent_id), None),
                               "the job's request span")
    assert server.kind == "SPAN_KIND_SERVER" and server.trace_id == enqueue.trace_id and server.parent_id == ""

    def worker_spans(spans: list[Span]) -> dict[str, list[Span]] | None:
        own = [span for span in spans if span.trace_id == enqueue.trace_id and span.parent_id == enqueue.span_id]
        found = {name: [span for span in own if span.name == name] for name in ("sits.queue_wait", "sits.item_run")}
        return found if all(len(found[name]) == 3 for name in found) else None  # two chunks and the finalize step

    found = receiver.wait_for(worker_spans, "the job's worker spans")
    kinds = sorted(span.attributes["sits.item.kind"] for span in found["sits.item_run"])
    assert kinds == ["chunk", "chunk", "finalize"]
    chunk_ids = sorted(span.attributes["sits.item_id"] for span in found["sits.queue_wait"]
                       if span.attributes["sits.item.kind"] == "chunk")
    assert chunk_ids == [f"{job['id']}:c{index:07d}" for index in range(2)]
    # Each chunk ran in a batch linked to the job's trace (its own, or a run unit's with the job's other chunk);
    # each ack (on the commit thread) is a child of the batch it ran in.
    def runs_linked(spans: list[Span]) -> list[Span] | None:
        batches = _linked_to(spans, "sits.batch", enqueue)
        ran = all(any((batch.trace_id, batch.span_id) in run.links for batch in batches)
                  for run in found["sits.item_run"])
        return batches if ran else None

    batches = receiver.wait_for(runs_linked, "the job's batch spans")
    chunk_batches = [batch for batch in batches if batch.attributes["sits.batch.kind"] == "chunk"]
    assert sum(batch.attributes["sits.items"] for batch in chunk_batches) == 2
    for batch in chunk_batches:
        receiver.wait_for(lambda spans, batch=batch: len([span for span in spans if span.name == "sits.ack"
                                                          and span.parent_id == batch.span_id])
                          == batch.attributes["sits.items"], "chunk ack spans")
