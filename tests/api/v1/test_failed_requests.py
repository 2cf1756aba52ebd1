"""A request that fails in its worker is answered with the kind of its error: v1 shows `error_code` (and
keeps 200, the request's own status being `failed`), v2 answers that error's HTTP status, so a Triton
client retries what may succeed later (503, 504) and not what its input caused (400, 422).

The worker's side is played by the test with the broker's own calls (lease, complete) on the real Redis.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from broker import errors
from broker.online import requests
from broker.online.requests import RequestResult
from broker.state.store import Store
from tests.api.api_helpers import Api
from tests.leasing import lease_items

ONE_ROW = [[0.5] * 64]


def fail_the_next_request(store: Store, model_ref: str, code: str) -> threading.Thread:
    """A thread that leases the next request of `model_ref` as a worker would and fails it with `code`."""

    def worker() -> None:
        for _ in range(500):
            leased = lease_items(store, model_ref, now=time.time(), lease_seconds=30, max_items=1)
            if leased:
                failed = RequestResult(leased[0], error=f"it failed ({code or 'no code'})", code=code)
                requests.complete_requests(store, [failed], now=time.time(), keep_seconds=60, batch_size=1,
                                           worker="test")
                return
            time.sleep(0.01)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(("code", "status"), [("bad_input", 400), ("invalid_model", 422), ("run_failed", 503),
                                              ("timeout", 504), ("", 500)])
def test_v2_answers_a_failed_request_with_its_error_s_status(
        api: Api, mlp: dict[str, Any], store: Store, code: str, status: int) -> None:
    thread = fail_the_next_request(store, mlp["ref"], code)
    response = api.post("/v2/models/mlp/infer", json={
        "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ONE_ROW}]})
    thread.join()

    assert response.status_code == status
    assert response.get_json() == {"error": f"it failed ({code or 'no code'})", "code": code or "internal_error"}


def test_v1_shows_a_failed_request_s_error_code_when_waited_for_and_read_later(
        api: Api, mlp: dict[str, Any], store: Store) -> None:
    thread = fail_the_next_request(store, mlp["ref"], errors.RunFailed.code)
    waited = api.post("/v1/requests?wait=true", json={"model": "mlp", "inputs": {"features": ONE_ROW}})
    thread.join()

    assert waited.status_code == 200
    body = waited.get_json()
    assert (body["status"], body["error"], body["error_code"]) == ("failed", "it failed (run_failed)", "run_failed")
    assert api.get(f"/v1/requests/{body['id']}").get_json()["error_code"] == "run_failed"


def test_an_error_code_names_its_error_class_and_an_unknown_one_is_an_internal_error() -> None:
    assert [(type(error), error.http_status) for error in (
        errors.error_for_code("bad_input", "m"), errors.error_for_code("model_not_found", "m"),
        errors.error_for_code("run_failed", "m"), errors.error_for_code("nonsense", "m"))] == [
        (errors.BadInput, 400), (errors.ModelNotFound, 404), (errors.RunFailed, 503), (errors.SitsError, 500)]
    assert errors.error_for_code("timeout", "it took too long").message == "it took too long"
