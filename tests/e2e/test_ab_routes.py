"""A/B routes on a running stack: two versions of the MLP answer the users a split sends them, each with
its own weights (checked against a direct run of each), through /v1 and v2; a route changed while
requests flow takes effect within a second and fails none of them."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import pytest

from broker.models.routing import ROUTES_TTL_SECONDS
from sits_api.cli.stack import Stack
from sits_worker.model.zoo import build_model, mlp_reference
from tests.e2e.stack_helpers import start_stack

ROW = np.linspace(-1.0, 1.0, 64, dtype=np.float32)


@pytest.fixture(scope="module")
def routed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, int]]]:
    """One worker; 'mlp' registered twice, from seeds 0 and 1: version -> seed."""
    home = tmp_path_factory.mktemp("routes-stack") / "home"
    stack = start_stack(home, workers=1, streams=2)
    seeds = {}
    for seed in (0, 1):
        path = home / f"mlp-{seed}.onnx"
        onnx.save(build_model("mlp", seed=seed), str(path))
        seeds[stack.client().post("/v1/models", {"name": "mlp", "path": str(path)})["version"]] = seed
    yield stack, seeds
    stack.stop()


def _call(stack: Stack, method: str, path: str, body: Any, user: str = "") -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json",
               **({"X-SITS-User": user} if user else {})}
    request = urllib.request.Request(stack.api_url + path, data=json.dumps(body).encode(), method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def _ask(stack: Stack, user: str, *, v2: bool) -> tuple[str, np.ndarray]:
    """(version that answered, its logits) of one request of `user`."""
    if v2:
        status, body = _call(stack, "POST", "/v2/models/mlp/infer", {"inputs": [
            {"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW.tolist()}]}, user)
        assert status == 200, body
        return body["model_version"], np.asarray(body["outputs"][0]["data"], dtype=np.float32)
    status, body = _call(stack, "POST", "/v1/requests", {"model": "mlp", "inputs": {"features": [ROW.tolist()]},
                                                         "wait": True}, user)
    assert status == 200 and body["status"] == "succeeded", body
    return body["model_version"], np.asarray(body["outputs"]["logits"], dtype=np.float32).ravel()


def test_each_arm_answers_with_its_own_weights_and_a_route_change_fails_no_request(
        routed_stack: tuple[Stack, dict[str, int]]) -> None:
    stack, seeds = routed_stack
    first, second = sorted(seeds, key=seeds.get)  # type: ignore[arg-type]
    status, _ = _call(stack, "PUT", "/v1/routes", {"model": "mlp", "split": {first: 0.5, second: 0.5}})
    assert status == 200
    time.sleep(ROUTES_TTL_SECONDS + 0.1)

    answers = [(user, v2, *_ask(stack, f"user-{user}", v2=v2)) for user in range(12) for v2 in (False, True)]

    for user, _, version, logits in answers:
        np.testing.assert_allclose(logits, mlp_reference(ROW[None], seed=seeds[version]).ravel(), rtol=1e-4,
                                   atol=1e-5)
        assert version == next(v for u, _, v, _ in answers if u == user)  # one arm per user, v1 and v2 alike
    assert {version for *_, version, _ in answers} == {first, second}

    failures: list[BaseException] = []
    after_change: list[str] = []
    changed_at = [0.0]

    def flow() -> None:  # bounded: 2 s past the change, 30 s in all, 20,000 requests at most
        # (time, not a count, ends it: a fast machine could spend a small count before the change shows)
        gives_up = time.monotonic() + 30.0
        for n in range(20_000):
            if (changed_at[0] and time.monotonic() - changed_at[0] > 2.0) or time.monotonic() > gives_up:
                return
            try:
                version, _ = _ask(stack, f"flow-{n}", v2=n % 2 == 1)
                if changed_at[0] and time.monotonic() - changed_at[0] > 2 * ROUTES_TTL_SECONDS + 0.2:
                    after_change.append(version)
            except BaseException as err:  # noqa: BLE001 - any failure is what the test looks for
                failures.append(err)

    thread = threading.Thread(target=flow)
    thread.start()
    time.sleep(0.3)
    assert _call(stack, "PUT", "/v1/routes", {"model": "mlp", "split": {second: 1.0}})[0] == 200
    changed_at[0] = time.monotonic()
    thread.join(timeout=120)

    assert not failures and not thread.is_alive()
    assert after_change and set(after_change) == {second}
    assert _call(stack, "DELETE", "/v1/routes/mlp", {})[0] == 204
