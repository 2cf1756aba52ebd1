"""Triton's statistics extension (GET /v2/models[/{name}[/versions/{v}]]/stats): the running totals
`complete_requests.lua` keeps in the call that stores a batch's results, in Triton's shape."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flask.testing import FlaskClient

from broker.errors import InferenceTimeout
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.state.store import Store
from broker.tenants.apikeys import create_api_key
from tests.api.api_helpers import Api, error_of
from tests.leasing import lease_items

ZERO = {"count": 0, "ns": 0}


def counted(stat: dict[str, int], count: int, seconds: float) -> bool:
    """`stat` counts `count` for `seconds` in all (to a microsecond: times are unix seconds as doubles)."""
    return stat["count"] == count and abs(stat["ns"] - seconds * 1e9) < 1e3


def stats_of(api: Api, path: str = "/v2/models/stats") -> list[dict[str, Any]]:
    response = api.get(path)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["model_stats"]


def submit(store: Store, ref: str, request_id: str, rows: int, *, created: float) -> None:
    name, _, version = ref.partition("@")
    spec = RequestSpec(request_id=request_id, model_name=name, model_version=version,
                       inputs={"features": np.ones((rows, 64), dtype=np.float32)}, rows=rows, tokens=None,
                       bucket="", factors={"level": 0})
    requests.submit_request(store, spec, score=0.0, now=created, max_age_seconds=600)


def test_every_registered_version_is_listed_with_zeros_before_any_traffic(api: Api, mlp: dict[str, Any]) -> None:
    [entry] = stats_of(api)

    assert (entry["name"], entry["version"]) == ("mlp", mlp["version"])
    assert entry["inference_count"] == entry["execution_count"] == entry["last_inference"] == 0
    assert set(entry["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                             "compute_output", "cache_hit", "cache_miss"}
    assert all(stat == ZERO for stat in entry["inference_stats"].values())
    assert entry["batch_stats"] == [] and entry["memory_usage"] == []
    assert stats_of(api, "/v2/models/mlp/stats") == [entry]
    assert stats_of(api, f"/v2/models/mlp/versions/{mlp['version']}/stats") == [entry]


def test_a_batch_s_results_add_counts_and_times_where_triton_reports_them(api: Api, store: Store,
                                                                         mlp: dict[str, Any]) -> None:
    ref = f"mlp@{mlp['version']}"
    now = time.time()
    submit(store, ref, "a", 3, created=now - 0.5)
    submit(store, ref, "b", 1, created=now - 0.25)
    submit(store, ref, "late", 1, created=now - 1.0)
    leased = {item.item_id: item for _ in range(3)
              for item in lease_items(store, ref, now=now, lease_seconds=30, max_items=1)}
    outputs = {"logits": np.zeros((1, 10), dtype=np.float32)}
    results = [RequestResult(leased["a"], outputs=outputs), RequestResult(leased["b"], outputs=outputs),
               RequestResult(leased["late"], error="timed out", code=InferenceTimeout.code, ran=False)]

    assert requests.complete_requests(store, results, now=now + 0.125, keep_seconds=60, batch_size=3,
                                      worker="w", run_started=now + 0.0625, run_rows=4) == 3

    [entry] = stats_of(api)
    inference = entry["inference_stats"]
    assert counted(inference["success"], 2, 0.625 + 0.375)
    assert counted(inference["fail"], 1, 1.125)
    assert counted(inference["queue"], 2, 0.5625 + 0.3125)  # only those that ran
    assert counted(inference["compute_infer"], 2, 2 * 0.0625)
    assert inference["compute_input"] == inference["compute_output"] == {"count": 2, "ns": 0}
    assert entry["inference_count"] == 4  # rows of the requests that succeeded
    assert entry["execution_count"] == 1
    [batch] = entry["batch_stats"]
    assert batch["batch_size"] == 4 and counted(batch["compute_infer"], 1, 0.0625)  # rows run, as Triton counts
    assert batch["compute_input"] == batch["compute_output"] == {"count": 1, "ns": 0}
    assert abs(entry["last_inference"] - (now + 0.125) * 1000) <= 1  # ms since the epoch

    # a late or repeated completion of the same requests changes nothing
    requests.complete_requests(store, results, now=now + 1, keep_seconds=60, batch_size=3, worker="w2",
                               run_started=now + 0.5, run_rows=4)
    assert stats_of(api) == [entry]


def test_requests_the_reaper_fails_count_as_failures_without_a_run(api: Api, store: Store,
                                                                  mlp: dict[str, Any]) -> None:
    ref = f"mlp@{mlp['version']}"
    now = time.time()
    submit(store, ref, "dead", 1, created=now - 2)
    [item] = lease_items(store, ref, now=now, lease_seconds=30, max_items=1)

    requests.complete_requests(store, [RequestResult(item, error="died")], now=now, keep_seconds=60, batch_size=1,
                               worker="reaper")

    [entry] = stats_of(api)
    assert entry["inference_stats"]["fail"]["count"] == 1
    assert entry["inference_stats"]["queue"] == entry["inference_stats"]["compute_infer"] == ZERO
    assert entry["execution_count"] == 0 and entry["batch_stats"] == []
    assert entry["last_inference"] == 0  # nothing ran


def test_unknown_models_and_versions_are_a_404_and_only_metrics_and_admin_keys_read_them(
        client: FlaskClient, api: Api, store: Store, mlp: dict[str, Any]) -> None:
    for path in ("/v2/models/nope/stats", "/v2/models/mlp/versions/0000/stats"):
        response = api.get(path)
        assert response.status_code == 404 and "is not registered" in error_of(response), path
    as_user = client.get("/v2/models/stats", headers={"Authorization": f"Bearer {create_api_key(store, 'u', 'user')}"})
    assert as_user.status_code == 403 and "'metrics' role" in error_of(as_user)  # every tenant's requests
    as_scraper = client.get("/v2/models/stats",
                            headers={"Authorization": f"Bearer {create_api_key(store, 'prom', 'metrics')}"})
    assert as_scraper.status_code == 200 and as_scraper.get_json()["model_stats"][0]["name"] == "mlp"
