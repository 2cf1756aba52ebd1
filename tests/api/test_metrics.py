"""GET /metrics: the Prometheus exposition of what Redis holds (queues, leases, workers, memory, jobs by
status, requests and job rows served), behind a metrics or admin key, naming no ids, owners or the Redis URL.

The workers' side is played by the test with the broker's own calls (lease, complete, ack, reap,
heartbeat) on the real Redis; the scrape is parsed with prometheus_client's own parsers.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from api_helpers import Api, make_settings
from flask.testing import FlaskClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from broker import job_fills, job_lists, job_progress, jobs, queues, requests, workers
from broker.apikeys import create_api_key
from broker.embedded import EmbeddedRedis
from broker.ledger import MemoryLedger
from broker.requests import RequestResult
from broker.store import Store
from sits_api.app import create_app

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


def submit_job(api: Api, tmp_path: Path, mlp_input: Path, name: str) -> dict[str, Any]:
    response = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                          "output_dir": str(tmp_path / name), "chunk_size": 4})
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
                                                          "commits_pending": 2}, now=now)
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
    leased_requests = queues.lease_batch(store, ref, now=now, lease_seconds=600, max_items=2, requests_only=True)
    assert len(leased_requests) == 2
    requests.complete_requests(store, [RequestResult(leased_requests[0], outputs={}),
                                       RequestResult(leased_requests[1], error="it failed", code="run_failed")],
                               now=now, keep_seconds=60, batch_size=2, worker="gpu-worker@host-a")
    chunks = queues.lease_batch(store, ref, now=now, lease_seconds=600, max_items=2)
    assert [chunk.payload["job"] for chunk in chunks] == [first["id"], first["id"]]
    assert job_progress.ack_chunk(store, chunks[0], now=now, worker="gpu-worker@host-a") == 1
    [dying] = queues.lease_batch(store, ref, now=now, lease_seconds=1, max_items=1)
    assert queues.reap_expired_leases(store, now=now + 5, max_attempts=1).dead_items
    assert job_lists.count_old_jobs(store)  # a reaper pass: every job is counted

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
    assert names_of(found, "sits_worker_memory_reserved_bytes") == [gpu]  # the late worker sent no memory stats
    assert dying.payload["job"] == first["id"]


def test_a_request_whose_record_expired_before_it_ran_is_counted_as_expired(
        alice: Api, scrape_key: str, client: FlaskClient, mlp: dict[str, Any], store: Store) -> None:
    request_id = alice.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).get_json()["id"]
    store.client.delete(store.keys.request(request_id))  # its result_ttl ran out while it waited
    [item] = queues.lease_batch(store, mlp["ref"], now=time.time(), lease_seconds=600, max_items=1)
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
    leased = queues.lease_batch(store, mlp["ref"], now=time.time(), lease_seconds=600, max_items=2)
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
        "sits_request_runs", "sits_requests_rejected"}


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
    [item] = queues.lease_batch(store, mlp["ref"], now=time.time(), lease_seconds=60, max_items=1, requests_only=True)
    requests.complete_requests(store, [RequestResult(item, outputs={})], now=time.time(), keep_seconds=60,
                               batch_size=1, worker="w")
    workers.record_heartbeat(store, "w", {"device": "cpu", "streams": 1}, now=time.time())
    job_lists.count_old_jobs(store)

    text = scrape(client, admin_key)

    assert "sits_requests_completed_total" in text and "sits_jobs{" in text
    redis_port = settings.redis.url.rsplit(":", 1)[1].split("/")[0]
    for secret in (job["id"], queued["id"], "alice", settings.redis.url, redis_port, store.keys.prefix, "test"):
        assert secret not in text, secret


def test_metrics_answer_openmetrics_when_asked(client: FlaskClient, admin_key: str, mlp: dict[str, Any]) -> None:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {admin_key}",
                                               "Accept": "application/openmetrics-text; version=1.0.0"})

    assert response.status_code == 200 and response.content_type.startswith("application/openmetrics-text")
    names = {family.name for family in openmetrics_families(response.get_data(as_text=True))}
    assert {"sits_queue_waiting_items", "sits_requests_completed", "sits_worker_up"} <= names
    plain = client.get("/metrics", headers={"Authorization": f"Bearer {admin_key}"})
    assert plain.content_type.startswith("text/plain")


def test_a_scrape_costs_the_same_redis_commands_however_many_jobs_are_kept(tmp_path: Path, zoo_dir: Path) -> None:
    """Jobs are never deleted: a scrape must not read them one by one (as a walk of the jobs would)."""
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
        assert few <= 16, f"a scrape ran {few} Redis commands"
        store.client.close()



# --- the Grafana dashboard queries what /metrics exposes -------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "dashboards" / "sits.json"
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
                               mlp_input: Path, tmp_path: Path) -> Samples:
    """A scrape after the system did a bit of everything: every family has samples."""
    now = time.time()
    workers.record_heartbeat(store, "w@h", {"device": "cpu", "streams": 2, "commits_pending": 0,
                                            "memory": a_memory_ledger_running_one_batch().stats()}, now=now)
    submit_job(api, tmp_path, mlp_input, "all")
    assert api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": ONE_ROW}}).status_code == 202
    [request] = queues.lease_batch(store, mlp["ref"], now=now, lease_seconds=60, max_items=1, requests_only=True)
    requests.complete_requests(store, [RequestResult(request, outputs={})], now=now, keep_seconds=60, batch_size=1,
                               worker="w@h")
    [chunk] = queues.lease_batch(store, mlp["ref"], now=now, lease_seconds=60, max_items=1)
    job_progress.ack_chunk(store, chunk, now=now, worker="w@h")
    job_lists.count_old_jobs(store)
    return samples(scrape(client, api.headers["Authorization"].split()[1]))


def test_every_metric_and_label_the_dashboard_queries_is_one_sits_or_flower_exposes(
        client: FlaskClient, store: Store, api: Api, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    sits_labels = label_names(a_scrape_with_every_metric(client, store, api, mlp, mlp_input, tmp_path))
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


def test_every_flower_metric_and_label_the_dashboard_queries_is_one_flower_defines() -> None:
    flower = flower_label_names()
    for query in dashboard_queries():
        in_query = {name for name in METRIC_NAME.findall(query) if name.startswith("flower_")}
        assert in_query <= flower.keys(), f"{query}: Flower has no {sorted(in_query - flower.keys())}"
        grouped = {label.strip() for labels in GROUPING.findall(query) for label in labels.split(",") if label.strip()}
        available = set().union(*(flower[name] for name in in_query)) if in_query else set()
        assert not in_query or grouped <= available, f"{query}: no such labels {grouped - available}"
