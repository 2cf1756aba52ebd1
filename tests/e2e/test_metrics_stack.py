"""GET /metrics against a real stack (gunicorn with two API processes, Celery worker, Redis): what a job
and online requests did shows in the counters, the histograms and the HTTP answers of both API processes,
the worker in its gauges, whichever API process answers; the drain tasks' Celery results (what Flower
shows) add up to the work done."""

from __future__ import annotations

import ast
import contextlib
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from sits_api.cli.client import ApiError
from sits_api.cli.stack import Stack
from tests.e2e.stack_helpers import register, start_stack, wait_job


@pytest.fixture(scope="module")
def mlp_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One CPU worker (two stream slots), the zoo's mlp, and two API processes (what each one answers is
    what this module checks)."""
    from sits_worker.model.zoo import build_zoo

    home = tmp_path_factory.mktemp("mlp-stack") / "home"
    running = start_stack(home, workers=1, streams=2, api_processes=2)
    register(running.client(), "mlp", build_zoo(home / "models")["mlp"])
    yield running
    running.stop()


def scrape(stack) -> str:
    request = urllib.request.Request(stack.api_url + "/metrics", headers={"Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@contextlib.contextmanager
def drain_results(stack) -> Iterator[list[dict[str, Any]]]:
    """The results of the drain tasks that end meanwhile, as the workers' task-succeeded events carry them
    to Flower (the tasks keep no result backend)."""
    app = Celery(broker=stack.settings.redis.url)
    results: list[dict[str, Any]] = []

    def keep(event: dict[str, Any]) -> None:
        result = ast.literal_eval(event.get("result") or "None")
        if isinstance(result, dict) and "batches" in result:  # (the profiling task's record is no drain's)
            results.append(result)

    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"task-succeeded": keep})
        listening = threading.Thread(target=lambda: receiver.capture(limit=None, wakeup=False), daemon=True)
        listening.start()
        try:
            yield results
        finally:
            receiver.should_stop = True
            listening.join(5)


def test_a_job_and_requests_show_in_the_metrics_of_every_api_process(mlp_stack):
    with drain_results(mlp_stack) as drained:
        _a_job_and_requests_show_in_the_metrics_of_every_api_process(mlp_stack, drained)


def _a_job_and_requests_show_in_the_metrics_of_every_api_process(mlp_stack, drained: list[dict[str, Any]]) -> None:
    client = mlp_stack.client()
    time.sleep(0.2)  # (the event receiver subscribes)
    np.save(mlp_stack.home / "metrics-in.npy", np.random.default_rng(3).standard_normal((1000, 64), dtype=np.float32))
    job = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(mlp_stack.home / "metrics-in.npy"),
                                   "output_dir": str(mlp_stack.home / "metrics-out"), "chunk_size": 250})
    with pytest.raises(ApiError) as refused:  # four chunks cannot run in a millisecond
        client.post("/v1/jobs", {"model": "mlp", "input_batch": str(mlp_stack.home / "metrics-in.npy"),
                                 "output_dir": str(mlp_stack.home / "metrics-refused"), "deadline_s": 0.001})
    assert refused.value.http_status == 422
    due = client.post("/v1/jobs", {"model": "mlp", "input_batch": str(mlp_stack.home / "metrics-in.npy"),
                                   "output_dir": str(mlp_stack.home / "metrics-due"), "chunk_size": 250,
                                   "deadline_s": 600, "priority": 12})
    for priority, deadline_ms in ((0, 60_000), (0, 0.001), (9, None)):  # met, missed (answered late), none
        answer = client.post("/v1/requests", {"model": "mlp", "inputs": {"features": [[0.25] * 64]}, "wait": True,
                                              "priority": priority, "deadline_ms": deadline_ms})
        ends = time.monotonic() + 30  # a wait lasts no longer than the deadline: the late one is read after
        while answer["status"] == "queued" and time.monotonic() < ends:
            time.sleep(0.05)
            answer = client.get(f"/v1/requests/{answer['id']}")
        assert answer["status"] == "succeeded", answer
    assert wait_job(client, job["id"])["status"] == "succeeded"
    assert wait_job(client, due["id"])["deadline_met"] is True

    version = job["model_version"]
    model = {("model", "mlp"), ("version", version)}
    submits = frozenset({("route", "/v1/jobs"), ("method", "POST"), ("status", "201")})
    refusal = submits - {("status", "201")} | {("status", "422")}
    deadline = time.monotonic() + 30
    while True:  # the jobs of each status show once a reaper pass has looked for jobs stored before the counts;
        # the runs' sizes once the worker's heartbeat added them; the other API process's answers within a second
        found = samples(scrape(mlp_stack))
        if (("sits_jobs", frozenset({("status", "succeeded")})) in found
                and found.get(("sits_batch_rows_sum", frozenset(model))) == 2003
                and found.get(("sits_http_requests_total", submits)) == 2
                and found.get(("sits_http_requests_total", refusal)) == 1) or time.monotonic() > deadline:
            break  # (each process adds its HTTP counts every second: the 422's may come from the other, later)
        time.sleep(0.5)
    texts = [scrape(mlp_stack) for _ in range(6)]  # two gunicorn processes: the same figures from each

    assert found[("sits_job_rows_done_total", frozenset({("model", "mlp"), ("version", version)}))] == 2000  # both jobs
    assert found[("sits_requests_completed_total", frozenset({("model", "mlp"), ("version", version),
                                                               ("status", "succeeded")}))] == 3
    assert found[("sits_jobs", frozenset({("status", "succeeded")}))] >= 1
    assert found[("sits_queue_waiting_items", frozenset({("model", "mlp"), ("version", version)}))] == 0
    histograms = (("sits_request_end_to_end_seconds", "low", 2), ("sits_request_queue_wait_seconds", "low", 2),
                  ("sits_request_end_to_end_seconds", "high", 1), ("sits_job_end_to_end_seconds", "low", 1),
                  ("sits_job_end_to_end_seconds", "express", 1), ("sits_request_run_seconds", "low", 2),
                  ("sits_request_run_seconds", "high", 1), ("sits_job_chunk_seconds", "low", 4),
                  ("sits_job_chunk_seconds", "express", 4))
    for name, klass, count in histograms:
        labels = frozenset({*model, ("priority_class", klass)})
        assert found[(f"{name}_count", labels)] == count, (name, klass)
        assert found[(f"{name}_bucket", labels | {("le", "+Inf")})] == count
    assert found[("sits_job_deadlines_total", frozenset({*model, ("outcome", "met")}))] == 1
    assert found[("sits_job_deadlines_total", frozenset({*model, ("outcome", "missed")}))] == 0
    assert found[("sits_jobs_rejected_total", frozenset(model))] == 1
    assert found[("sits_request_deadlines_total", frozenset({*model, ("outcome", "met")}))] == 1
    assert found[("sits_request_deadlines_total", frozenset({*model, ("outcome", "missed")}))] == 1
    # every run's rows (two jobs of 1,000 rows, three one-row requests), whichever runs they were merged into
    assert found[("sits_batch_rows_sum", frozenset(model))] == 2003
    assert found[("sits_batch_rows_count", frozenset(model))] == found[
        ("sits_batch_rows_bucket", frozenset({*model, ("le", "+Inf")}))] >= 8
    # the answers of both gunicorn processes: two jobs taken, one refused
    assert found[("sits_http_requests_total", submits)] == 2
    assert found[("sits_http_requests_total", refusal)] == 1
    assert found[("sits_http_request_duration_seconds_count", frozenset({("route", "/v1/jobs"),
                                                                          ("method", "POST")}))] == 3
    ends = time.monotonic() + 15  # (the drain task that ran the last batch ends once it lingered)
    while sum(result["rows"] for result in drained) < 2003 and time.monotonic() < ends:
        time.sleep(0.2)
    assert sum(result["rows"] for result in drained) == 2003
    assert sum(result["requests"] for result in drained) == 3 and sum(result["chunks"] for result in drained) == 8
    assert {ref for result in drained for ref in result["models"]} == {f"mlp@{version}"}
    assert {result["outcome"] for result in drained} <= {"released", "yield", "stale"}
    up = {dict(labels)["worker"]: value for (name, labels), value in found.items() if name == "sits_worker_up"}
    assert list(up.values()) == [1]
    [worker] = up
    assert found[("sits_worker_streams", frozenset({("worker", worker), ("device", "cpu")}))] == 2
    assert found[("sits_worker_memory_capacity_bytes", frozenset({("worker", worker), ("device", "cpu")}))] > 0
    counters = [{key: value for key, value in samples(text).items() if key[0].endswith("_total")
                 and not key[0].startswith(("sits_worker_", "sits_http_"))} for text in texts]  # (scrapes count)
    assert all(figures == counters[0] for figures in counters)
    assert all(mlp_stack.settings.redis.url not in text and job["id"] not in text for text in texts)
