"""Where SITS's Open Inference Protocol answers must read as Triton's do, without a worker: the
schedule-policy `priority` (1 the most urgent, 0 the default), a model's readiness (a live worker
to run it), the batch axis in model metadata, and NaN or infinite outputs in JSON answers."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
import rapidjson  # what tritonclient parses answers with
from flask import Flask

from broker.config.settings import Settings
from broker.queueing import workers
from broker.state.store import Store
from sits_api.app import create_app
from sits_api.v2.parsing import InferRequest, sits_level
from sits_api.v2.routes import _answer
from tests.api.api_helpers import Api, error_of
from tests.leasing import lease_items
from tests.onnx_models import fixed_batch_model

ROW = [0.5] * 64


@pytest.mark.parametrize(("triton", "level"), [(1, 15), (2, 14), (8, 8), (15, 1), (16, 0), (0, 0), (17, 0),
                                                (2**64 - 1, 0)])
def test_triton_priority_counts_down_from_1_the_most_urgent_and_0_or_past_the_levels_is_the_default(
        triton: int, level: int) -> None:
    assert sits_level(triton) == level


def queued_levels(store: Store, model_ref: str) -> list[int]:
    """The priority level of every request waiting for `model_ref`, in queue order."""
    ids = store.client.zrange(store.keys.ready(model_ref), 0, -1)
    return [json.loads(store.client.hget(store.keys.items, item_id))["factors"]["level"] for item_id in ids]


def test_a_v2_request_is_queued_at_the_sits_level_of_its_triton_priority(settings: Settings, store: Store,
                                                                         admin_key: str, mlp: dict[str, Any]) -> None:
    # No timeout (one would take it out of the queue), and no worker: a 504 once online.max_wait is up.
    short_wait = Api(create_app(settings.with_overrides(online={"max_wait": "50ms"}), store=store).test_client(),
                     admin_key)
    for priority in (1, 16, 0):
        body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}],
                "parameters": {"priority": priority}}
        assert short_wait.post("/v2/models/mlp/infer", json=body).status_code == 504

    assert sorted(queued_levels(store, f"mlp@{mlp['version']}")) == [0, 0, 15]


def test_a_negative_priority_is_a_400_that_names_the_parameter(api: Api, mlp: dict[str, Any]) -> None:
    body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}],
            "parameters": {"priority": -1}}

    response = api.post("/v2/models/mlp/infer", json=body)

    assert response.status_code == 400 and "'priority'" in error_of(response)


def test_a_model_is_ready_only_while_a_worker_is_alive_to_run_it(api: Api, store: Store, mlp: dict[str, Any]) -> None:
    not_ready = api.get("/v2/models/mlp/ready")
    assert not_ready.status_code == 400  # the protocol's "false" is any 4xx; tritonclient reads non-200 as False
    assert not_ready.get_json()["ready"] is False and "no worker is alive" in error_of(not_ready)
    assert api.get(f"/v2/models/mlp/versions/{mlp['version']}/ready").status_code == 400
    assert api.get("/v2/health/ready").status_code == 200  # the queue takes work meanwhile

    workers.record_heartbeat(store, "w1@host", {"streams": 1, "device": "cpu"}, now=time.time())

    assert api.get("/v2/models/mlp/ready").get_json() == {"name": "mlp", "ready": True}
    assert api.get(f"/v2/models/mlp/versions/{mlp['version']}/ready").status_code == 200
    assert api.get("/v2/models/nope/ready").status_code == 404


def test_metadata_shows_the_batch_axis_as_dynamic_even_where_the_graph_fixes_it(api: Api, settings: Any) -> None:
    path = fixed_batch_model(settings.paths.model_roots[0] / "fixed.onnx", rows_per_run=4)
    assert api.post("/v1/models", json={"name": "fixed", "path": str(path)}).status_code == 201

    metadata = api.get("/v2/models/fixed").get_json()
    config = api.get("/v2/models/fixed/config").get_json()

    assert [entry["shape"] for entry in metadata["inputs"] + metadata["outputs"]] == [[-1, 3]] * 4
    assert [entry["dims"] for entry in config["input"] + config["output"]] == [[3]] * 4  # batching: no batch axis


def answer_of(app: Flask, outputs: dict[str, np.ndarray], *, binary: frozenset[str] = frozenset()) -> tuple[bytes, int]:
    """`_answer`'s body for `outputs` (those named in `binary` asked for in binary), and its JSON header's length."""
    checked = InferRequest(model="m", inputs={}, priority=0, deadline_ms=None, user_tier="free",
                           outputs=list(outputs), binary_outputs=binary, binary_by_default=False, client_id=None)
    with app.test_request_context():
        response = _answer({"model_name": "m", "model_version": "1", "id": "r"}, outputs, checked)
    header_length = int(response.headers.get("Inference-Header-Content-Length", len(response.get_data())))
    return response.get_data(), header_length


def test_nan_and_infinite_outputs_come_back_as_triton_writes_them(app: Flask) -> None:
    logs = np.array([[-np.inf, np.nan, 0.0]], dtype=np.float32)  # a log of 0, -1 and 1
    finite = np.array([[1.5]], dtype=np.float64)

    body, _ = answer_of(app, {"log": logs, "plain": finite})

    assert b"-Infinity" in body and b"NaN" in body and b"null" not in body
    for parse in (rapidjson.loads, json.loads):
        outputs = {entry["name"]: entry["data"] for entry in parse(body)["outputs"]}
        assert outputs["log"][0] == -np.inf and np.isnan(outputs["log"][1]) and outputs["log"][2] == 0.0
        assert outputs["plain"] == [1.5]


def test_nan_in_a_json_output_beside_a_binary_one_keeps_the_framing_right(app: Flask) -> None:
    logs = np.array([[-np.inf, 0.5]], dtype=np.float32)
    raw = np.array([[np.inf, 7.0]], dtype=np.float32)

    body, header_length = answer_of(app, {"log": logs, "raw": raw}, binary=frozenset({"raw"}))

    header = rapidjson.loads(body[:header_length])
    assert header["outputs"][0]["data"][0] == -np.inf
    assert header["outputs"][1]["parameters"]["binary_data_size"] == raw.nbytes
    np.testing.assert_array_equal(np.frombuffer(body[header_length:], dtype="<f4"), raw.ravel())


def test_a_v2_timeout_is_enforced_and_a_v1_deadline_only_orders(api: Api, store: Store, mlp: dict[str, Any]) -> None:
    """Triton drops a request whose timeout passed before it ran; a v1 `deadline_ms` is a tolerable delay
    (the request still runs late). The v2 one fails at its timeout and leaves the queue; the v1 one waits."""
    v2_body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}],
               "parameters": {"timeout": 2000}}
    timed_out = api.post("/v2/models/mlp/infer", json=v2_body)
    assert timed_out.status_code == 504 and "its timeout (0.002 s) passed while it waited" in error_of(timed_out)
    assert api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [ROW]},
                                          "deadline_ms": 2}).status_code == 202

    ref = f"mlp@{mlp['version']}"
    payloads = [json.loads(store.client.hget(store.keys.items, item_id))
                for item_id in store.client.zrange(store.keys.ready(ref), 0, -1)]
    assert len(payloads) == 1 and "expires_at" not in payloads[0]
    assert store.client.hget(store.keys.counters, f"requests_failed:{ref}") == "1"


def test_a_request_a_worker_took_within_its_timeout_is_answered_when_its_run_ends(
        api: Api, store: Store, mlp: dict[str, Any]) -> None:
    """Triton's timeout drops what waits; what runs is answered. A stand-in worker leases the request
    at once and completes it 0.4 s later, past the request's 0.1 s timeout."""
    import threading

    from broker.online import requests

    ref = f"mlp@{mlp['version']}"
    done = threading.Event()

    def worker() -> None:
        while not (leased := lease_items(store, ref, now=time.time(), lease_seconds=30, max_items=1)):
            time.sleep(0.005)
        time.sleep(0.4)
        result = requests.RequestResult(leased[0], outputs={"logits": np.full((1, 10), 0.5, dtype=np.float32)})
        requests.complete_requests(store, [result], now=time.time(), keep_seconds=60, batch_size=1, worker="w")
        done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}],
            "parameters": {"timeout": 100_000}}
    response = api.post("/v2/models/mlp/infer", json=body)
    thread.join(timeout=10)

    assert done.is_set()
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["outputs"][0]["data"] == [0.5] * 10


def test_a_request_no_worker_took_within_its_timeout_is_a_504_saying_it_is_not_run(
        api: Api, mlp: dict[str, Any]) -> None:
    body = {"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}],
            "parameters": {"timeout": 1000}}

    response = api.post("/v2/models/mlp/infer", json=body)

    assert response.status_code == 504
    assert "not taken by a worker within its 'timeout'; it is not run" in error_of(response)
