"""GET /metrics against a real stack (gunicorn with two API processes, Celery worker, Redis): what a job
and online requests did shows in the counters, the worker in its gauges, whichever API process answers."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits_api.cli.client import ApiError
from tests.e2e.stack_helpers import wait_job


def scrape(stack) -> str:
    request = urllib.request.Request(stack.api_url + "/metrics", headers={"Authorization": f"Bearer {stack.api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_job_and_requests_show_in_the_metrics_of_every_api_process(mlp_stack):
    client = mlp_stack.client()
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

    deadline = time.monotonic() + 30
    while True:  # the jobs of each status show once a reaper pass has looked for jobs stored before the counts
        found = samples(scrape(mlp_stack))
        if ("sits_jobs", frozenset({("status", "succeeded")})) in found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    texts = [scrape(mlp_stack) for _ in range(6)]  # two gunicorn processes: the same figures from each

    assert found[("sits_job_rows_done_total", frozenset({("model", "mlp"), ("version", version)}))] == 2000  # both jobs
    assert found[("sits_requests_completed_total", frozenset({("model", "mlp"), ("version", version),
                                                               ("status", "succeeded")}))] == 3
    assert found[("sits_jobs", frozenset({("status", "succeeded")}))] >= 1
    assert found[("sits_queue_waiting_items", frozenset({("model", "mlp"), ("version", version)}))] == 0
    model = {("model", "mlp"), ("version", version)}
    histograms = (("sits_request_end_to_end_seconds", "low", 2), ("sits_request_queue_wait_seconds", "low", 2),
                  ("sits_request_end_to_end_seconds", "high", 1), ("sits_job_end_to_end_seconds", "low", 1),
                  ("sits_job_end_to_end_seconds", "express", 1))
    for name, klass, count in histograms:
        labels = frozenset({*model, ("priority_class", klass)})
        assert found[(f"{name}_count", labels)] == count, (name, klass)
        assert found[(f"{name}_bucket", labels | {("le", "+Inf")})] == count
    assert found[("sits_job_deadlines_total", frozenset({*model, ("outcome", "met")}))] == 1
    assert found[("sits_job_deadlines_total", frozenset({*model, ("outcome", "missed")}))] == 0
    assert found[("sits_jobs_rejected_total", frozenset(model))] == 1
    assert found[("sits_request_deadlines_total", frozenset({*model, ("outcome", "met")}))] == 1
    assert found[("sits_request_deadlines_total", frozenset({*model, ("outcome", "missed")}))] == 1
    up = {dict(labels)["worker"]: value for (name, labels), value in found.items() if name == "sits_worker_up"}
    assert list(up.values()) == [1]
    [worker] = up
    assert found[("sits_worker_streams", frozenset({("worker", worker), ("device", "cpu")}))] == 2
    assert found[("sits_worker_memory_capacity_bytes", frozenset({("worker", worker), ("device", "cpu")}))] > 0
    counters = [{key: value for key, value in samples(text).items() if key[0].endswith("_total")
                 and not key[0].startswith("sits_worker_")} for text in texts]
    assert all(figures == counters[0] for figures in counters)
    assert all(mlp_stack.settings.redis.url not in text and job["id"] not in text for text in texts)
