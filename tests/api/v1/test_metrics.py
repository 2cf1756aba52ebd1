"""GET /metrics: the Prometheus exposition of what Redis holds (queues, leases, workers, memory, jobs by
status, requests and job rows served), behind a metrics or admin key, naming no ids, owners or the Redis URL.

The workers' side is played by the test with the broker's own calls (lease, complete, ack, reap,
heartbeat) on the real Redis; the scrape is parsed with prometheus_client's own parsers.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.parse
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import onnx
import pytest
import yaml
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from broker.config.settings import Settings
from broker.failures import retries
from broker.failures.breaker import BreakerBoard
from broker.failures.settings import BreakerSettings
from broker.jobs import fills as job_fills
from broker.jobs import lists as job_lists
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.jobs import stops as job_stops
from broker.memory.ledger import MemoryLedger
from broker.monitoring import batch_sizes
from broker.monitoring.sla_metrics import LATENCY_BUCKETS
from broker.online import requests
from broker.online.requests import RequestResult
from broker.queueing import leases, reaping, workers
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from sits_api import metric_versions
from sits_api.app import create_app
from sits_api.http import request_metrics
from tests.api.api_helpers import Api, make_settings, tenant_copy
from tests.leasing import lease_items

ONE_ROW = [[0.5] * 64]
MIB = 1024 * 1024
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: FlaskClient, key: str, accept: str = "") -> str:
    """The body of GET /metrics (asserting a 200 in the Prometheus text format)."""
    response = client.get("/metrics", headers={"Authorization": f"Bearer {key}", "Accept": accept})
    assert response.status_code == 200, response.data[:300]
    return response.get_data(as_text=True)


def samples(text: str) -> Samples:
    """(Sample name, labels) -> value of every sample in a text exposition."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


def names_of(found: Samples, name: str) -> list[dict[str, str]]:
    """The label sets of the samples called `name`."""
    return [dict(labels) for sample, labels in found if sample == name]


@pytest.fixture
def alice(client: FlaskClient, store: Store) -> Api:
    return Api(client, create_api_key(store, "alice-tenant", "user"))


@pytest.fixture
def scrape_key(store: Store) -> str:
    """A Prometheus scrape's key: the `metrics` role."""
    return create_api_key(store, "prometheus", "metrics")


def submit_job(api: Api, tmp_path: Path, mlp_input: Path, name: str, tenant: str = "alice-tenant") -> dict[str, Any]:
    """A job of `tenant`'s key `api` (its files in the tenant's folder, where its keys read and write)."""
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(tenant_copy(mlp_input, tmp_path, tenant)),
                                          "output_dir": str(tmp_path / tenant / name), "chunk_size": 4})
    assert response.status_code == 201, response.get_json()
    return response.get_json()


def a_memory_ledger_running_one_batch() -> MemoryLedger:
    """A worker's ledger with one batch of 200 MiB running in 128 MiB units: 256 MiB reserved."""
    ledger = MemoryLedger(capacity_bytes=16 * 1024 * MIB, granularity=128 * MIB)
    ledger.reserve(200 * MIB, now=time.time(), expected_seconds=1.0)
    ledger.count("memory_waits")
    ledger.count("memory_waits")
    ledger.count("backfills")
    return ledger


def test_metrics_report_what_redis_holds_queues_leases_dead_items_workers_jobs_and_totals(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], mlp_input: Path, store: Store,
        tmp_path: Path) -> None:
    now = time.time()
    ledger_stats = a_memory_ledger_running_one_batch().stats()
    workers.record_heartbeat(store, "gpu-worker@host-a", {"device": "cuda:0", "streams": 3, "memory": ledger_stats,
                                                          "commits_pending": 2, "degrade": {
                                                              "step": 1, "jitter": 0.125, "steps_taken": 3},
                                                          "oom": {"halved": 4, "offloaded": 1}}, now=now)
    workers.record_heartbeat(store, "late-worker@host-b", {"device": "cpu", "streams": 1}, now=now - 60)
    first = submit_job(alice, tmp_path, mlp_input, "first")  # 10 rows: chunks of 4, 4 and 2 rows
    submit_job(alice, tmp_path, mlp_input, "second")
    for _ in range(2):
        assert alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).status_code == 202
    ref, version = mlp["ref"], mlp["version"]

    pending = samples(scrape(client, scrape_key))
    assert value(pending, "sits_queue_waiting_items", model="mlp", version=version) == 8  # 3 + 3 chunks, 2 requests
    assert names_of(pending, "sits_jobs") == []  # until a reaper pass has looked for jobs stored before the counts

    # a worker's work: two requests leased and completed (one failed), two chunks leased and one acked,
    # a chunk whose lease runs out at its last attempt (dead)
    leased_requests = lease_items(store, ref, now=now, lease_seconds=600, max_items=2, requests_only=True)
    assert len(leased_requests) == 2
    requests.complete_requests(store, [RequestResult(leased_requests[0], outputs={}),
                                       RequestResult(leased_requests[1], error="it failed", code="run_failed")],
                               now=now, keep_seconds=60, batch_size=2, worker="gpu-worker@host-a")
    chunks = lease_items(store, ref, now=now, lease_seconds=600, max_items=2)
    assert [chunk.payload["job"] for chunk in chunks] == [first["id"], first["id"]]
    assert job_progress.ack_chunk(store, chunks[0], now=now, worker="gpu-worker@host-a") == 1
    [dying] = lease_items(store, ref, now=now, lease_seconds=1, max_items=1)
    assert reaping.reap_expired_leases(store, now=now + 5, max_attempts=1).dead_items
    assert job_lists.count_old_jobs(store)  # a reaper pass: every job is counted
    assert retries.retry_later(store, chunks[1], failure_class="transient", error="Redis blinked", delays=[1.0],
                               now=now).retried  # (parked in flight for its backoff)

    found = samples(scrape(client, scrape_key))

    assert value(found, "sits_queue_waiting_items", model="mlp", version=version) == 3  # the second job's chunks
    assert value(found, "sits_queue_inflight_items", model="mlp", version=version) == 1
    assert value(found, "sits_dead_items") == 1
    assert value(found, "sits_batch_tickets") == store.client.zcard(store.keys.tickets)
    assert value(found, "sits_requests_completed_total", model="mlp", version=version, status="succeeded") == 1
    assert value(found, "sits_requests_completed_total", model="mlp", version=version, status="failed") == 1
    assert value(found, "sits_job_rows_done_total", model="mlp", version=version) == 4
    assert {status: value(found, "sits_jobs", status=status)
            for status in ("queued", "running", "succeeded", "failed", "cancelled")} == {
        "queued": 1, "running": 1, "succeeded": 0, "failed": 0, "cancelled": 0}
    gpu = {"worker": "gpu-worker@host-a", "device": "cuda:0"}
    late = {"worker": "late-worker@host-b", "device": "cpu"}
    assert value(found, "sits_worker_up", **gpu) == 1 and value(found, "sits_worker_up", **late) == 0
    assert value(found, "sits_worker_heartbeat_age_seconds", **late) == pytest.approx(60, abs=5)
    assert value(found, "sits_worker_streams", **gpu) == 3 and value(found, "sits_worker_streams", **late) == 1
    assert value(found, "sits_worker_memory_capacity_bytes", **gpu) == 16 * 1024 * MIB
    assert value(found, "sits_worker_memory_reserved_bytes", **gpu) == 256 * MIB
    assert value(found, "sits_worker_memory_used_bytes", **gpu) == 200 * MIB
    assert value(found, "sits_worker_memory_fragmentation_ratio", **gpu) == ledger_stats["fragmentation"] > 0
    assert value(found, "sits_worker_batches_running", **gpu) == 1
    assert value(found, "sits_worker_commits_pending", **gpu) == 2
    assert value(found, "sits_worker_memory_waits_total", **gpu) == 2
    assert value(found, "sits_worker_backfills_total", **gpu) == 1
    assert value(found, "sits_degrade_step", **gpu) == 1 and value(found, "sits_memory_jitter_ratio", **gpu) == 0.125
    assert value(found, "sits_degrade_changes_total", **gpu) == 3
    assert names_of(found, "sits_degrade_step") == [gpu]  # the late worker sent no degrade step
    assert value(found, "sits_worker_oom_halvings_total", **gpu) == 4
    assert value(found, "sits_worker_oom_offloads_total", **gpu) == 1
    assert value(found, "sits_failures_total", model="mlp", version=version, **{"class": "transient"},
                 outcome="retried") == 1
    assert names_of(found, "sits_worker_memory_reserved_bytes") == [gpu]  # the late worker sent no memory stats
    assert dying.payload["job"] == first["id"]


def test_a_request_whose_record_expired_before_it_ran_is_counted_as_expired(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], store: Store) -> None:
    request_id = alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).get_json()["id"]
    store.client.delete(store.keys.request(request_id))  # its result_ttl ran out while it waited
    [item] = lease_items(store, mlp["ref"], now=time.time(), lease_seconds=600, max_items=1)
    assert requests.load_inputs(store, [item]) == [None]  # what the worker finds: nothing to run
    requests.complete_requests(store, [RequestResult(item, error="the request expired before it ran", code="timeout")],
                               now=time.time(), keep_seconds=60, batch_size=1, worker="w")

    found = samples(scrape(client, scrape_key))

    completed = {dict(labels)["status"]: found[(name, labels)] for name, labels in found
                 if name == "sits_requests_completed_total"}
    assert completed == {"expired": 1}
    assert value(found, "sits_queue_inflight_items", model="mlp", version=mlp["version"]) == 0


def test_request_times_by_phase_and_runs_come_from_the_v2_statistics_totals(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], store: Store) -> None:
    for _ in range(2):
        alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}})
    leased = lease_items(store, mlp["ref"], now=time.time(), lease_seconds=600, max_items=2)
    created = [float(store.client.hget(store.keys.request(item.payload["req"]), "created_at")) for item in leased]
    started = max(created) + 0.25
    requests.complete_requests(store, [RequestResult(item, outputs={}) for item in leased], now=started + 0.5,
                               keep_seconds=60, batch_size=2, worker="w", run_started=started, run_rows=2)

    found = samples(scrape(client, scrape_key))

    labels = {"model": "mlp", "version": mlp["version"]}
    assert value(found, "sits_request_seconds_count", **labels) == 2
    assert value(found, "sits_request_seconds_sum", **labels) == pytest.approx(
        sum(started + 0.5 - at for at in created), abs=1e-5)
    assert value(found, "sits_request_phase_seconds_sum", **labels, phase="queue") == pytest.approx(
        sum(started - at for at in created), abs=1e-5)
    assert value(found, "sits_request_phase_seconds_count", **labels, phase="compute") == 2
    assert value(found, "sits_request_phase_seconds_sum", **labels, phase="compute") == pytest.approx(1.0, abs=1e-5)
    assert value(found, "sits_request_runs_total", **labels) == 1


HISTOGRAM_BOUNDS = [*(str(float(bound)) if bound >= 1 else str(bound) for bound in LATENCY_BUCKETS), "+Inf"]
"""The `le` labels of a histogram's buckets, as Prometheus writes them (1.0, not 1)."""


def bucket_counts(found: Samples, name: str, **labels: str) -> dict[str, float]:
    """le -> cumulative count of one histogram series."""
    series = {(f"{name}_bucket", frozenset({**labels, "le": le}.items())): le for le in HISTOGRAM_BOUNDS}
    return {le: found[key] for key, le in series.items() if key in found}


def test_request_latency_histograms_count_each_request_in_its_bucket_by_priority_class(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], store: Store) -> None:
    for priority in (0, 9, 13, 14):
        response = alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW},
                                                    "priority": priority})
        assert response.status_code == 202
    leased = lease_items(store, mlp["ref"], now=time.time(), lease_seconds=600, max_items=4, requests_only=True)
    created = {item.payload["factors"]["level"]: float(store.client.hget(store.keys.request(item.payload["req"]),
                                                                         "created_at")) for item in leased}
    started = max(created.values()) + 0.3  # each waited 0.3 s and a little: in the bucket up to 0.5 s
    results = [RequestResult(item, outputs={}) if item.payload["factors"]["level"] != 14
               else RequestResult(item, error="it failed", code="run_failed") for item in leased]
    requests.complete_requests(store, results, now=started + 1.5, keep_seconds=60, batch_size=4, worker="w",
                               run_started=started, run_rows=4)

    found = samples(scrape(client, scrape_key))

    version = mlp["version"]
    queue_wait = bucket_counts(found, "sits_request_queue_wait_seconds", model="mlp", version=version,
                               priority_class="low")
    assert list(queue_wait) == HISTOGRAM_BOUNDS
    assert (queue_wait["0.25"], queue_wait["0.5"], queue_wait["+Inf"]) == (0, 1, 1)
    end_to_end = bucket_counts(found, "sits_request_end_to_end_seconds", model="mlp", version=version,
                               priority_class="express")  # priorities 13 and 14, the failed one too
    assert (end_to_end["1.0"], end_to_end["2.5"], end_to_end["+Inf"]) == (0, 2, 2)
    assert value(found, "sits_request_end_to_end_seconds_count", model="mlp", version=version,
                 priority_class="express") == 2
    assert value(found, "sits_request_end_to_end_seconds_sum", model="mlp", version=version,
                 priority_class="high") == pytest.approx(started + 1.5 - created[9], abs=1e-5)
    classes = {labels["priority_class"] for labels in names_of(found, "sits_request_queue_wait_seconds_count")}
    assert classes == {"low", "high", "express"}  # no request at a normal level (4-7): no series


def test_only_a_name_s_newest_versions_keep_their_own_series_and_the_older_ones_add_up_under_other(
        api: Api, scrape_key: str, client: FlaskClient, store: Store, zoo_dir: Path, tmp_path: Path) -> None:
    """Versions are never deleted: a tenant registering many must not add some 280 series each to every
    scrape. Each version here answers one low and one express request in one run of two rows."""
    model = onnx.load(str(zoo_dir / "mlp.onnx"))
    versions = []
    for number in range(metric_versions.VERSIONS_SHOWN + 2):
        model.doc_string = f"variant {number}"  # (another content hash: another version)
        onnx.save(model, str(tmp_path / f"v{number}.onnx"))
        response = api.post("/v1/models", json={"name": "squat", "path": str(tmp_path / f"v{number}.onnx")})
        assert response.status_code == 201, response.get_json()
        versions.append(response.get_json()["version"])
    sizes = batch_sizes.new_tally()
    for version in versions:
        for priority in (0, 13):
            response = api.post("/v1/requests", json={"model": f"squat@{version}", "inputs": {"features": ONE_ROW},
                                                      "priority": priority})
            assert response.status_code == 202, response.get_json()
        leased = lease_items(store, f"squat@{version}", now=time.time(), lease_seconds=600, max_items=2,
                             requests_only=True)
        requests.complete_requests(store, [RequestResult(item, outputs={}) for item in leased], now=time.time(),
                                   keep_seconds=60, batch_size=2, worker="w", run_started=time.time(), run_rows=2)
        batch_sizes.observe_run(sizes, f"squat@{version}", 2, None)
    sizes.flush(store, store.keys.batch_sizes)

    found = samples(scrape(client, scrape_key))

    other = metric_versions.OTHER_VERSION
    shown = {*versions[-metric_versions.VERSIONS_SHOWN:], other}  # the newest registered, and the rest
    for name in ("sits_request_end_to_end_seconds_bucket", "sits_request_queue_wait_seconds_count",
                 "sits_request_run_seconds_sum", "sits_batch_rows_bucket", "sits_request_seconds_count",
                 "sits_request_phase_seconds_sum", "sits_request_runs_total"):
        assert {labels["version"] for labels in names_of(found, name) if labels["model"] == "squat"} == shown, name
    assert len(names_of(found, "sits_request_end_to_end_seconds_bucket")) == len(shown) * 2 * len(HISTOGRAM_BOUNDS)
    every = len(versions)
    for name, labels, each in (  # (what each version counted: a request of each class, in one run)
            ("sits_request_end_to_end_seconds_count", {"priority_class": "express"}, 1),
            ("sits_request_queue_wait_seconds_count", {"priority_class": "low"}, 1),
            ("sits_batch_rows_count", {}, 1), ("sits_request_runs_total", {}, 1),
            ("sits_request_seconds_count", {}, 2), ("sits_request_phase_seconds_count", {"phase": "compute"}, 2)):
        total = sum(value(found, name, model="squat", version=version, **labels) for version in shown)
        assert total == each * every, name
    older = every - metric_versions.VERSIONS_SHOWN
    assert bucket_counts(found, "sits_request_end_to_end_seconds", model="squat", version=other,
                         priority_class="low")["+Inf"] == older
    assert value(found, "sits_batch_rows_sum", model="squat", version=other) == 2 * older


def test_job_deadlines_met_missed_and_refused_and_the_risk_of_active_ones_show_per_model(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], mlp_input: Path, store: Store,
        settings: Any, tmp_path: Path) -> None:
    workers.record_heartbeat(store, "w@h", {"device": "cpu", "streams": 1}, now=time.time())

    own_input = tenant_copy(mlp_input, tmp_path, "alice-tenant")  # (in the folder its tenant's keys read)

    def submit(name: str, api: Api = alice, **fields: Any) -> Any:
        return api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(own_input),
                                          "output_dir": str(tmp_path / "alice-tenant" / name), "chunk_size": 4,
                                          **fields})

    assert submit("too-soon", deadline_s=0.001).status_code == 422  # three chunks cannot run in a millisecond
    an_hour_ago = datetime.fromtimestamp(time.time() - 3600, UTC).isoformat()
    assert submit("passed", deadline=an_hour_ago).status_code == 422  # (passed: refused by admission)
    met, missed, cancelled = (submit(name, deadline_s=3600, priority=12).get_json()["id"]
                              for name in ("met", "missed", "cancelled"))
    flagging = create_app(settings.with_overrides(sla={"models": {"mlp": {"admission": "flag"}}}), store=store)
    flagged = submit("flagged", Api(flagging.test_client(), alice.headers["Authorization"].split()[1]),
                     deadline_s=0.001).get_json()
    assert flagged["at_risk"] is True
    labels = {"model": "mlp", "version": mlp["version"]}

    watched = samples(scrape(client, scrape_key))
    item = leases.LeasedItem(jobs.finalize_item_id(met), mlp["ref"], {}, 1)
    leases.finish_item(store, item, met, now=time.time(), job_status="succeeded")  # its outputs are published
    job_stops.stop_job(store, missed, status="failed", error="a chunk failed", now=time.time())
    job_stops.stop_job(store, cancelled, status="cancelled", error="", now=time.time())
    ended = samples(scrape(client, scrape_key))

    assert value(watched, "sits_jobs_with_deadline", **labels) == 4
    assert value(watched, "sits_jobs_at_risk", **labels) == 1
    assert value(watched, "sits_sla_risk", **labels) >= 0.5  # predicted past its deadline
    assert value(ended, "sits_jobs_rejected_total", **labels) == 2
    assert value(ended, "sits_job_deadlines_total", **labels, outcome="met") == 1
    assert value(ended, "sits_job_deadlines_total", **labels, outcome="missed") == 1
    assert value(ended, "sits_job_end_to_end_seconds_count", **labels, priority_class="express") == 1
    assert (value(ended, "sits_jobs_with_deadline", **labels), value(ended, "sits_jobs_at_risk", **labels)) == (1, 1)
    assert value(ended, "sits_queue_waiting_requests", **labels) == 0


def test_an_older_version_s_queue_shows_only_while_it_holds_items_and_the_newest_version_s_always(
        client: FlaskClient, mlp: dict[str, Any], scrape_key: str, store: Store) -> None:
    old_ref = "mlp@0ld"  # a version registered before the current one, whose queue stays known
    store.client.sadd(store.keys.queues, old_ref, mlp["ref"])

    idle = samples(scrape(client, scrape_key))
    store.client.zadd(store.keys.ready(old_ref), {"left-over": 1.0})
    busy = samples(scrape(client, scrape_key))

    assert names_of(idle, "sits_queue_waiting_items") == [{"model": "mlp", "version": mlp["version"]}]
    assert value(idle, "sits_queue_waiting_items", model="mlp", version=mlp["version"]) == 0
    assert value(busy, "sits_queue_waiting_items", model="mlp", version="0ld") == 1


def test_every_family_has_help_text_and_a_unit_or_count_in_its_name(api: Api, mlp: dict[str, Any],
                                                                      client: FlaskClient, admin_key: str) -> None:
    families = list(text_string_to_metric_families(scrape(client, admin_key)))

    assert families and all(family.name.startswith("sits_") and len(family.documentation) > 20
                            for family in families)
    assert {family.name for family in families if family.type == "counter"} == {
        "sits_requests_completed", "sits_job_rows_done", "sits_worker_memory_waits", "sits_worker_backfills",
        "sits_request_runs", "sits_requests_rejected", "sits_job_deadlines", "sits_jobs_rejected",
        "sits_request_deadlines", "sits_tenant_device_seconds", "sits_tenant_rows", "sits_degrade_changes",
        "sits_failures", "sits_worker_oom_halvings", "sits_worker_oom_offloads", "sits_http_requests",
        "sits_schedule_releases", "sits_schedule_refusals", "sits_schedule_late_releases", "sits_rescore_moved_items",
        "sits_batching_changes"}
    assert {family.name for family in families if family.type == "histogram"} == {
        "sits_request_end_to_end_seconds", "sits_request_queue_wait_seconds", "sits_job_end_to_end_seconds",
        "sits_request_run_seconds", "sits_job_chunk_seconds", "sits_batch_rows", "sits_batch_tokens",
        "sits_http_request_duration_seconds"}


def test_metrics_need_a_metrics_or_admin_key_and_a_metrics_key_reads_nothing_else(
        client: FlaskClient, store: Store, admin_key: str, scrape_key: str, mlp: dict[str, Any]) -> None:
    user_key = create_api_key(store, "bob", "user")

    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer sits_not-a-key"}).status_code == 401
    assert "sits_queue_waiting_items" in scrape(client, scrape_key)
    assert "sits_queue_waiting_items" in scrape(client, admin_key)
    as_user = client.get("/metrics", headers={"Authorization": f"Bearer {user_key}"})  # every tenant's counts
    assert as_user.status_code == 403 and "needs the 'metrics' role" in as_user.get_json()["error"]
    scraper = {"Authorization": f"Bearer {scrape_key}"}
    for method, path in (("GET", "/v1/status"), ("GET", "/v1/jobs"), ("GET", "/v1/models"), ("POST", "/v1/requests"),
                         ("POST", "/v2/models/mlp/infer"), ("GET", "/v2/models/mlp")):
        response = client.open(path, method=method, headers=scraper, json={})
        assert response.status_code == 403 and "may only read GET /metrics" in response.get_json()["error"], path
    for _ in range(2):  # and so it stays once the key is cached
        assert client.get("/v1/jobs", headers=scraper).status_code == 403


def test_metrics_name_no_job_or_request_ids_owners_or_redis_url(
        alice: Api, client: FlaskClient, admin_key: str, mlp: dict[str, Any], mlp_input: Path, store: Store,
        settings: Any, tmp_path: Path) -> None:
    job = submit_job(alice, tmp_path, mlp_input, "out")
    queued = alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).get_json()
    [item] = lease_items(store, mlp["ref"], now=time.time(), lease_seconds=60, max_items=1, requests_only=True)
    requests.complete_requests(store, [RequestResult(item, outputs={})], now=time.time(), keep_seconds=60,
                               batch_size=1, worker="w")
    workers.record_heartbeat(store, "w", {"device": "cpu", "streams": 1}, now=time.time())
    job_lists.count_old_jobs(store)

    text = scrape(client, admin_key)

    assert "sits_requests_completed_total" in text and "sits_jobs{" in text
    redis_url = urllib.parse.urlsplit(settings.redis.url)
    redis_port, redis_password = str(redis_url.port), redis_url.password
    assert redis_password  # (the embedded Redis has one)
    for secret in (job["id"], queued["id"], "alice", settings.redis.url, redis_port, redis_password,
                   store.keys.prefix, "test"):
        assert secret not in text, secret


def test_metrics_answer_openmetrics_when_asked(client: FlaskClient, admin_key: str, mlp: dict[str, Any]) -> None:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {admin_key}",
                                               "Accept": "application/openmetrics-text; version=1.0.0"})

    assert response.status_code == 200 and response.content_type.startswith("application/openmetrics-text")
    names = {family.name for family in openmetrics_families(response.get_data(as_text=True))}
    assert {"sits_queue_waiting_items", "sits_requests_completed", "sits_worker_up"} <= names
    plain = client.get("/metrics", headers={"Authorization": f"Bearer {admin_key}"})
    assert plain.content_type.startswith("text/plain")


def test_a_scrape_costs_the_same_redis_commands_however_many_jobs_are_kept(
        tmp_path: Path, zoo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs are never deleted: a scrape must not read them one by one (as a walk of the jobs would)."""
    monkeypatch.setattr(request_metrics, "FLUSH_SECONDS", 3600.0)  # (each scrape adds the last one's answer alone)
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        store = Store.connect(server.url, "cost")
        app = create_app(make_settings(server, store, tmp_path, zoo_dir), store=store)
        client, key = app.test_client(), create_api_key(store, "ops", "metrics")

        def commands_of_a_scrape() -> int:
            before = int(store.client.info("stats")["total_commands_processed"])
            scrape(client, key)
            return int(store.client.info("stats")["total_commands_processed"]) - before

        def add_jobs(count: int) -> None:
            for _ in range(count):
                spec = jobs.JobSpec(job_id=jobs.new_job_id(), model_name="mlp", model_version="v1",
                                    input_batch="/in.npy", input_format="npy", input_checksum="sha256:0",
                                    output_dir="/out", output_names=["y"], rows_total=4, chunk_size=2, batch_size=2)
                job_fills.create_job(store, spec, now=time.time())
            job_lists.count_old_jobs(store)

        add_jobs(1)
        scrape(client, key)  # the key is checked once, then cached
        few = commands_of_a_scrape()
        add_jobs(40)
        many = commands_of_a_scrape()

        assert many == few
        # (of them, one MULTI of five adds the last scrape's HTTP answer: count, bucket, sum; four read the
        # schedules: their definitions, totals and held runs, and the beat's turn; one the live batching overrides)
        assert few <= 30, f"a scrape ran {few} Redis commands"
        store.client.close()



# --- the Grafana dashboard queries what /metrics exposes -------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[3] / "ops" / "grafana" / "dashboards" / "sits.json"
METRIC_NAME = re.compile(r"\b((?:sits|flower)_[a-z0-9_]+)\b")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows' nested panels too)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def label_names(found: Samples) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry."""
    names: dict[str, set[str]] = {}
    for sample, labels in found:
        names.setdefault(sample, set()).update(label for label, _ in labels)
    return names


def flower_label_names() -> dict[str, set[str]]:
    """Sample name -> label names of the metrics Flower exposes (its own definitions, flower.events)."""
    flower_events = pytest.importorskip("flower.events")
    from prometheus_client import REGISTRY

    flower_events.get_prometheus_metrics()  # registers Flower's metrics in the default registry
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - the only way to list collectors
        for family in getattr(collector, "describe", lambda: [])():
            if family.name.startswith("flower_"):
                labels = set(getattr(collector, "_labelnames", ()))
                for suffix in suffixes.get(family.type, [""]):
                    names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def a_scrape_with_every_metric(client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any],
                               mlp_input: Path, tmp_path: Path, settings: Settings) -> Samples:
    """A scrape after the system did a bit of everything: every family has samples (by an API whose mlp
    has a priority level with a queue limit of its own)."""
    now = time.time()
    workers.record_heartbeat(store, "w@h", {"device": "cpu", "streams": 2, "commits_pending": 0,
                                            "memory": a_memory_ledger_running_one_batch().stats(),
                                            "degrade": {"step": 2, "jitter": 0.25, "steps_taken": 2}}, now=now)
    workers.record_heartbeat(store, "gpu@h", {"device": "gpu:0", "streams": 1, "gpu": {
        "utilization": 0.5, "memory_used_bytes": 2**30, "memory_total_bytes": 16 * 2**30}}, now=now)
    submit_job(api, tmp_path, mlp_input, "all")
    assert api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).status_code == 202
    [request] = lease_items(store, mlp["ref"], now=now, lease_seconds=60, max_items=1, requests_only=True)
    requests.complete_requests(store, [RequestResult(request, outputs={})], now=now, keep_seconds=60, batch_size=1,
                               worker="w@h", run_started=now, run_rows=1)
    [chunk] = lease_items(store, mlp["ref"], now=now, lease_seconds=60, max_items=1)
    job_progress.ack_chunk(store, chunk, now=now, worker="w@h", run_seconds=0.02)
    sizes = batch_sizes.new_tally()  # what a token model's worker counted and its heartbeat added
    batch_sizes.observe_run(sizes, mlp["ref"], 4, 256)
    sizes.flush(store, store.keys.batch_sizes)
    due = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input), "deadline_s": 3600,
                                     "output_dir": str(tmp_path / "due"), "chunk_size": 4}).get_json()["id"]
    finished = submit_job(api, tmp_path, mlp_input, "finished")["id"]
    leases.finish_item(store, leases.LeasedItem(jobs.finalize_item_id(finished), mlp["ref"], {}, 1), finished,
                       now=time.time(), job_status="succeeded")
    assert api.get(f"/v1/jobs/{due}").get_json()["sla_risk"] is not None
    job_lists.count_old_jobs(store)
    BreakerBoard(store, BreakerSettings(), lambda: "w@h").note_run(mlp["ref"], failed=False, now=now)
    hourly = {"model": "mlp", "input_batch": str(mlp_input), "output_dir": str(tmp_path / "hourly" / "{slot}")}
    assert api.post("/v1/schedules", json={"name": "hourly", "every": "1h", "job": hourly}).status_code == 201
    assert api.post("/v1/schedules/hourly/run").get_json()["status"] == "released"  # (a release: its lateness)
    limited = create_app(settings.with_overrides(online={"models": {"mlp": {"priority_levels": {0: {
        "max_queue_size": 5}}}}}), store=store).test_client()
    scrape(client, api.headers["Authorization"].split()[1])  # (adds this app's HTTP answers to Redis)
    return samples(scrape(limited, api.headers["Authorization"].split()[1]))


def test_every_metric_and_label_the_dashboard_queries_is_one_sits_or_flower_exposes(
        client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        settings: Settings) -> None:
    sits_labels = label_names(a_scrape_with_every_metric(client, store, api, mlp, mlp_input, tmp_path, settings))
    queries = dashboard_queries()
    used = {name for query in queries for name in METRIC_NAME.findall(query)}

    assert len(queries) > 10 and {name for name in used if name.startswith("sits_")} >= {
        "sits_queue_waiting_items", "sits_queue_inflight_items", "sits_requests_completed_total",
        "sits_job_rows_done_total", "sits_worker_up", "sits_worker_streams", "sits_worker_memory_reserved_bytes",
        "sits_worker_memory_used_bytes", "sits_worker_memory_fragmentation_ratio", "sits_jobs"}
    unknown = sorted(name for name in used if name.startswith("sits_") and name not in sits_labels)
    assert not unknown, f"the dashboard queries metrics /metrics does not expose: {unknown}"
    for query in queries:
        in_query = {name for name in METRIC_NAME.findall(query) if name.startswith("sits_")}
        grouped = {label.strip() for labels in GROUPING.findall(query) for label in labels.split(",") if label.strip()}
        available = set().union(*(sits_labels[name] for name in in_query)) if in_query else set()
        assert not in_query or grouped <= available, f"{query}: no such labels {grouped - available}"


ALERTS = Path(__file__).resolve().parents[3] / "ops" / "prometheus" / "alerts.yml"
LABEL_MATCHER = re.compile(r"\b([a-z_]+)\s*=~?\s*\"")


def test_every_metric_and_label_the_alert_rules_query_is_one_sits_exposes(
        client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path,
        settings: Settings) -> None:
    sits_labels = label_names(a_scrape_with_every_metric(client, store, api, mlp, mlp_input, tmp_path, settings))
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]

    for rule in rules:
        query = rule["expr"]
        in_query = set(METRIC_NAME.findall(query))
        missing = in_query - sits_labels.keys()
        assert in_query and not missing, f"{rule['alert']}: /metrics has no {missing}"
        available = set().union(*(sits_labels[name] for name in in_query))
        used = {label.strip() for labels in GROUPING.findall(query) for label in labels.split(",") if label.strip()}
        used |= set(LABEL_MATCHER.findall(query))
        assert used <= available, f"{rule['alert']}: no such labels {used - available}"
        templated = set(re.findall(r"\$labels\.([a-z_]+)", str(rule["annotations"])))
        assert templated <= used, f"{rule['alert']}: its annotations name labels its expression drops"


def test_every_flower_metric_and_label_the_dashboard_queries_is_one_flower_defines() -> None:
    flower = flower_label_names()
    for query in dashboard_queries():
        in_query = {name for name in METRIC_NAME.findall(query) if name.startswith("flower_")}
        assert in_query <= flower.keys(), f"{query}: Flower has no {sorted(in_query - flower.keys())}"
        grouped = {label.strip() for labels in GROUPING.findall(query) for label in labels.split(",") if label.strip()}
        available = set().union(*(flower[name] for name in in_query)) if in_query else set()
        assert not in_query or grouped <= available, f"{query}: no such labels {grouped - available}"


def test_gpu_series_come_from_a_gpu_worker_s_heartbeat_and_are_absent_not_zero_without_one(
        client: FlaskClient, scrape_key: str, store: Store) -> None:
    now = time.time()
    workers.record_heartbeat(store, "gpu@host-a", {"device": "gpu:0", "streams": 2, "gpu": {
        "utilization": 0.75, "memory_used_bytes": 3 * 2**30, "memory_total_bytes": 80 * 2**30, "nvml_index": 3}},
                             now=now)
    workers.record_heartbeat(store, "cpu@host-b", {"device": "cpu", "streams": 2}, now=now)  # as a CPU worker beats

    found = samples(scrape(client, scrape_key))

    assert value(found, "sits_gpu_utilization_ratio", worker="gpu@host-a", device="gpu:0") == 0.75
    assert value(found, "sits_gpu_memory_total_bytes", worker="gpu@host-a", device="gpu:0") == 80 * 2**30
    for name in ("sits_gpu_utilization_ratio", "sits_gpu_memory_used_bytes", "sits_gpu_memory_total_bytes"):
        assert [labels["worker"] for labels in names_of(found, name)] == ["gpu@host-a"], name  # no cpu@host-b: 0


def test_http_answers_of_every_api_process_are_counted_by_route_template_never_by_what_a_client_sent(
        client: FlaskClient, api: Api, scrape_key: str, settings: Settings, store: Store, app: Flask) -> None:
    """Two apps over one Redis are two API processes: each counts its own answers, and a scrape of either
    shows both. A client sending random paths and methods adds no series: the route is the URL rule's
    template, one label for every path no rule matches, and an unusual method is 'other'."""
    other = Api(create_app(settings, store=store).test_client(), api.headers["Authorization"].split()[1])
    hostile = [f"/v1/{secrets.token_hex(8)}/{secrets.token_hex(8)}" for _ in range(5)]
    for caller in (api, other):
        assert caller.get("/v1/jobs/job-that-is-not-there").status_code == 404
        assert caller.get("/v1/models").status_code == 200
    for path in hostile:
        assert api.get(path).status_code == 404
    assert client.open("/v1/models", method="BREW", headers=api.headers).status_code == 405
    assert client.get("/v1/models").status_code == 401  # no key: refused by a hook before any view

    scrape(other.client, scrape_key)  # (the other process adds its answers; the next scrape's adds its own)
    found = samples(scrape(client, scrape_key))

    def answers(route: str, method: str, status: str) -> float:
        return value(found, "sits_http_requests_total", route=route, method=method, status=status)

    assert answers("/v1/jobs/<job_id>", "GET", "404") == 2  # one from each process
    assert answers("/v1/models", "GET", "200") == 2
    assert answers("/v1/models", "GET", "401") == 1
    assert answers("unmatched", "GET", "404") == len(hostile)
    assert answers("unmatched", "other", "405") == 1
    rules = {rule.rule for rule in app.url_map.iter_rules()} | {"unmatched"}
    series = [dict(labels) for name, labels in found if name.startswith("sits_http_")]
    assert {labels["route"] for labels in series} <= rules
    assert not any(path.split("/")[2] in str(labels) for path in hostile for labels in series)
    assert {labels["method"] for labels in series} == {"GET", "other"}
    timed = {"route": "/v1/jobs/<job_id>", "method": "GET"}
    assert value(found, "sits_http_request_duration_seconds_count", **timed) == 2
    assert value(found, "sits_http_request_duration_seconds_bucket", **timed, le="+Inf") == 2
    assert 0 < value(found, "sits_http_request_duration_seconds_sum", **timed) < 30
