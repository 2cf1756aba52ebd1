"""The SLA figures the scripts keep for /metrics: latency buckets and priority classes as
`broker.monitoring.sla_metrics` says, each job's end counted once where its final status is set, and
the risk of the active jobs with a deadline read from the index they are kept in. Real Redis, a fixed `now`."""

from __future__ import annotations

import bisect
import dataclasses
import json

import numpy as np
import pytest

from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.jobs.finish_prediction import Fleet, Work
from broker.monitoring import sla_metrics
from broker.monitoring.sla_metrics import LATENCY_BUCKETS, Histogram, decode_histograms, priority_class, read_job_risks
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases
from broker.queueing.leases import LeasedItem
from broker.sla import watch as sla_watch
from broker.state.scripts import script_text
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec
from tests.leasing import lease_items


def test_the_scripts_bucket_and_class_as_sla_metrics_says(store: Store) -> None:
    levels = list(range(16))
    edges = [value for bound in LATENCY_BUCKETS for value in (bound, bound * 1.001)] + [0.0, -1.0, 1e6]
    lua = script_text("lib") + """
local classes, buckets = {}, {}
for i = 1, #ARGV - 1 do classes[i] = priority_class(ARGV[i]) end
local edges = cjson.decode(ARGV[#ARGV])
for i = 1, #edges do
  local tally = {}
  observe_latency(tally, 's', edges[i])
  for field, _ in pairs(tally) do
    if field ~= 's|ns' then buckets[i] = tonumber(string.sub(field, 3)) end
  end
end
return {classes, buckets}
"""

    classes, buckets = store.client.eval(lua, 0, *levels, json.dumps(edges))

    assert classes == [priority_class(level) for level in levels]
    assert [priority_class(level) for level in (0, 3, 4, 7, 8, 11, 12, 15)] == [
        "low", "low", "normal", "normal", "high", "high", "express", "express"]
    assert buckets == [bisect.bisect_left(LATENCY_BUCKETS, max(value, 0.0)) + 1 for value in edges]


def test_decoded_buckets_are_cumulative_with_their_sum_and_count() -> None:
    raw = {"mlp@v1|queue|low|2": "3", "mlp@v1|queue|low|5": "1", "mlp@v1|queue|low|19": "2",
           "mlp@v1|queue|low|ns": "2500000000"}

    [(series, histogram)] = decode_histograms(raw).items()

    assert series == ("mlp@v1", "queue", "low")
    assert histogram == Histogram([0, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 6], 2.5)
    assert len(histogram.cumulative) == len(LATENCY_BUCKETS) + 1
    assert histogram.count == 6


def _deadline_job(store: Store, *, deadline_in: float, priority: int = 0, rows: int = 10) -> str:
    spec = dataclasses.replace(job_spec(priority=priority, rows_total=rows), deadline_at=NOW + deadline_in)
    job_fills.create_job(store, spec, now=NOW)
    return spec.job_id


def _finalize(store: Store, job_id: str, *, now: float) -> None:
    """What a finalize step does once the job's outputs are published."""
    item = LeasedItem(jobs.finalize_item_id(job_id), MODEL_REF, {}, 1)
    leases.finish_item(store, item, job_id, now=now, job_status="succeeded")


def _counters(store: Store) -> dict[str, str]:
    return store.client.hgetall(store.keys.counters)


def test_a_job_ending_counts_its_deadline_once_and_its_time_when_it_succeeded(store: Store) -> None:
    on_time = _deadline_job(store, deadline_in=60, priority=13)
    late = _deadline_job(store, deadline_in=60)
    failed = _deadline_job(store, deadline_in=60)
    cancelled = _deadline_job(store, deadline_in=60)
    without = job_spec(priority=5)
    job_fills.create_job(store, without, now=NOW)
    assert store.client.zcard(store.keys.jobs_due) == 4

    _finalize(store, on_time, now=NOW + 0.3)
    _finalize(store, late, now=NOW + 61)
    job_stops.stop_job(store, failed, status="failed", error="a chunk failed", now=NOW + 2)
    job_stops.stop_job(store, cancelled, status="cancelled", error="", now=NOW + 2)
    _finalize(store, without.job_id, now=NOW + 400)
    _finalize(store, failed, now=NOW + 3)  # a finalize step that published after the stop: counted once
    _finalize(store, on_time, now=NOW + 5)  # a late duplicate

    assert {field: int(value) for field, value in _counters(store).items()} == {
        f"job_deadline_met:{MODEL_REF}": 1, f"job_deadline_missed:{MODEL_REF}": 2}
    histograms = decode_histograms(store.client.hgetall(store.keys.latency_buckets))
    express = histograms[(MODEL_REF, "job", "express")]
    assert express.count == 1 and express.total == pytest.approx(0.3)
    assert express.cumulative[LATENCY_BUCKETS.index(0.25)] == 0 and express.cumulative[LATENCY_BUCKETS.index(0.5)] == 1
    low = histograms[(MODEL_REF, "job", "low")]
    assert low.count == 1 and low.total == pytest.approx(61)
    normal = histograms[(MODEL_REF, "job", "normal")]  # priority 5, no deadline: its time counts all the same
    assert normal.count == 1 and normal.cumulative[LATENCY_BUCKETS.index(300.0)] == 0
    assert store.client.zcard(store.keys.jobs_due) == 0


def test_a_resumed_job_is_watched_again_and_counts_again_when_it_ends_again(store: Store) -> None:
    job_id = _deadline_job(store, deadline_in=60)
    job_stops.stop_job(store, job_id, status="failed", error="a chunk failed", now=NOW + 1)
    assert store.client.zcard(store.keys.jobs_due) == 0

    job_fills.resume_job(store, job_id, now=NOW + 2)
    assert store.client.zscore(store.keys.jobs_due, job_id) == NOW + 60
    _finalize(store, job_id, now=NOW + 30)

    assert {field: int(value) for field, value in _counters(store).items()} == {
        f"job_deadline_met:{MODEL_REF}": 1, f"job_deadline_missed:{MODEL_REF}": 1}


def test_the_risk_of_active_jobs_comes_from_their_predicted_finish_then_their_own_rate(store: Store) -> None:
    ahead = dataclasses.replace(job_spec(rows_total=10), deadline_at=NOW + 60, predicted_finish=NOW + 20)
    behind = dataclasses.replace(job_spec(rows_total=10), deadline_at=NOW + 60, predicted_finish=NOW + 90,
                                 at_risk=True)
    other = dataclasses.replace(job_spec(model_name="cnn", rows_total=1000), deadline_at=NOW + 60)
    for spec in (ahead, behind, other):
        job_fills.create_job(store, spec, now=NOW)
    # the cnn job runs: 100 of its 1000 rows in its first 10 s, so 90 s more at that rate, past its deadline
    store.client.hset(store.keys.job(other.job_id), mapping={"status": "running", "started_at": NOW,
                                                             "rows_done": 100})

    risks = read_job_risks(store, now=NOW + 10)

    assert set(risks) == {MODEL_REF, "cnn@v1"}
    assert (risks[MODEL_REF].jobs, risks[MODEL_REF].at_risk) == (2, 1)
    assert risks[MODEL_REF].highest == pytest.approx(jobs.with_deadline(
        {"status": "queued", "deadline": NOW + 60, "predicted_finish": NOW + 90}, now=NOW + 10)["sla_risk"])
    assert (risks["cnn@v1"].jobs, risks["cnn@v1"].at_risk) == (1, 1) and risks["cnn@v1"].highest > 0.9
    job_stops.stop_job(store, behind.job_id, status="cancelled", error="", now=NOW + 11)
    assert read_job_risks(store, now=NOW + 12)[MODEL_REF].at_risk == 0


def test_the_risk_read_is_bounded_to_the_soonest_deadlines(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sla_metrics, "RISK_JOBS", 2)
    for deadline_in in (300, 100, 200):
        _deadline_job(store, deadline_in=deadline_in)

    assert read_job_risks(store, now=NOW)[MODEL_REF].jobs == 2


def test_the_predictor_judges_a_queued_job_on_the_plan_of_the_work_now_ahead_of_it(store: Store) -> None:
    """Admission foresaw +20 s, but a flood now queued ahead holds the only slot for 80 s: the plan
    (+85 s, past the +60 s deadline) is what the predictor's lateness sees."""
    spec = dataclasses.replace(job_spec(rows_total=10), deadline_at=NOW + 60, predicted_finish=NOW + 20)
    job_fills.create_job(store, spec, now=NOW)
    alone = [Work(spec.job_id, 5.0, 5.0, deadline_at=NOW + 60)]
    flooded = [Work("flood", 1.0, 80.0), *alone]

    assert sla_watch.score_active(store, alone, workers=1, now=NOW + 1, fleet=Fleet(1)) == 1
    calm = float(store.client.hget(store.keys.job(spec.job_id), "sla_risk_model"))
    assert sla_watch.score_active(store, flooded, workers=1, now=NOW + 2, fleet=Fleet(1)) == 1
    alarmed = float(store.client.hget(store.keys.job(spec.job_id), "sla_risk_model"))

    assert calm < 0.1 < 0.9 < alarmed
    assert float(store.client.hget(store.keys.job(spec.job_id), "sla_ahead")) == 80.0


def _submit_request(store: Store, request_id: str, level: int, *, now: float) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.ones((1, 64), dtype=np.float32)}, rows=1, tokens=None, bucket="",
                       factors={"level": level})
    requests.submit_request(store, spec, score=float(-level), now=now, max_age_seconds=60)


def test_each_request_s_run_and_each_chunk_s_run_count_once_in_their_histograms(store: Store) -> None:
    _submit_request(store, "low", 0, now=NOW)
    _submit_request(store, "express", 13, now=NOW)
    leased = lease_items(store, MODEL_REF, now=NOW, lease_seconds=60, max_items=2, requests_only=True)
    results = [RequestResult(item, outputs={}) for item in leased]
    requests.complete_requests(store, results, now=NOW + 1.3, keep_seconds=60, batch_size=2, worker="w",
                               run_started=NOW + 1.0, run_rows=2)
    requests.complete_requests(store, results, now=NOW + 2.0, keep_seconds=60, batch_size=2, worker="w",
                               run_started=NOW + 1.9, run_rows=2)  # a late repeat from a lost lease: no count
    spec = job_spec(priority=9, rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    first, second = lease_items(store, MODEL_REF, now=NOW, lease_seconds=60, max_items=2)
    job_progress.ack_chunk(store, first, now=NOW + 1, worker="w1", run_seconds=0.004)
    job_progress.ack_chunk(store, first, now=NOW + 2, worker="w2", run_seconds=0.7)  # its run again: counted once
    job_progress.ack_chunk(store, second, now=NOW + 2, worker="w1")  # parts written before: no run to count

    histograms = decode_histograms(store.client.hgetall(store.keys.latency_buckets))

    for klass in ("low", "express"):
        run = histograms[(MODEL_REF, "run", klass)]
        assert run.count == 1 and run.total == pytest.approx(0.3)
        assert run.cumulative[LATENCY_BUCKETS.index(0.25)] == 0 and run.cumulative[LATENCY_BUCKETS.index(0.5)] == 1
    chunk = histograms[(MODEL_REF, "chunk", "high")]  # its job's priority 9
    assert chunk.count == 1 and chunk.total == pytest.approx(0.004)
    assert chunk.cumulative[LATENCY_BUCKETS.index(0.0025)] == 0 and chunk.cumulative[LATENCY_BUCKETS.index(0.005)] == 1
    assert {what for _, what, _ in histograms} == {"request", "queue", "run", "chunk"}
