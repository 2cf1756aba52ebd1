"""Circuit breakers at the edge: a model whose breaker is open on every live worker fails new online
requests fast (503 + Retry-After, v1 and v2), job submits are still queued, and `/v1/status`,
`sitsctl status` and `/metrics` show the breakers (real Redis; the breakers are written by the same
`BreakerBoard` a worker keeps, from counted run failures)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from broker.config.settings import Settings
from broker.failures.breaker import BreakerBoard
from broker.queueing import workers
from broker.state.store import Store
from tests.api.api_helpers import Api

ROW = [0.5] * 64
WORKERS = ("w1@host", "w2@host")


def _open_on(store: Store, settings: Settings, model_ref: str, *names: str) -> float:
    """Open `model_ref`'s breaker on each worker named, as its failed runs would; returns when."""
    now = time.time()
    for name in names:
        board = BreakerBoard(store, settings.breaker, lambda name=name: name)
        for _ in range(settings.breaker.min_runs):
            board.note_run(model_ref, failed=True, error="device_oom: device out of memory", now=now)
    return now


def _beat(store: Store) -> None:
    for name in WORKERS:
        workers.record_heartbeat(store, name, {"device": "cpu", "streams": 1, "pid": 1}, now=time.time())


def test_a_model_open_on_every_live_worker_fails_fast_with_503_and_retry_after(
        api: Api, store: Store, settings: Settings, mlp: dict[str, Any], mlp_input: Path, tmp_path: Path) -> None:
    _beat(store)
    _open_on(store, settings, mlp["ref"], WORKERS[0])
    accepted = api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [ROW]}})
    assert accepted.status_code == 202, accepted.get_json()  # w2 still takes it

    opened_at = _open_on(store, settings, mlp["ref"], WORKERS[1])
    time.sleep(1.1)  # the API reads the breakers again at most once a second
    refused = api.post("/v1/requests", json={"model": "mlp", "inputs": {"features": [ROW]}})
    v2 = api.post("/v2/models/mlp/infer",
                  json={"inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": ROW}]})
    job = api.post("/v1/jobs", json={"model": "mlp", "input_batch": str(mlp_input),
                                     "output_dir": str(tmp_path / "out")})

    cool_down = settings.breaker.cool_down
    for response in (refused, v2):
        body = response.get_json()
        assert response.status_code == 503 and body["code"] == "model_unavailable", body
        assert "circuit breakers are open" in body["error"]
        assert 1 <= int(response.headers["Retry-After"]) <= cool_down - (time.time() - opened_at) + 1
    assert job.status_code == 201, job.get_json()  # a job waits in its queue for a probe or a closed breaker


def test_status_metrics_and_sitsctl_status_show_the_breakers(
        api: Api, store: Store, settings: Settings, mlp: dict[str, Any], served_api: str, admin_key: str,
        monkeypatch: Any) -> None:
    _beat(store)
    BreakerBoard(store, settings.breaker, lambda: WORKERS[1]).note_run(mlp["ref"], failed=False)
    _open_on(store, settings, mlp["ref"], WORKERS[0])

    breakers = api.get("/v1/status").get_json()["breakers"]
    metrics = api.get("/metrics").get_data(as_text=True)
    from sits_api.cli.main import cli

    monkeypatch.setenv("SITS_API_URL", served_api)
    monkeypatch.setenv("SITS_API_KEY", admin_key)
    shown = CliRunner().invoke(cli, ["status"])

    states = {entry["worker"]: entry for entry in breakers}
    assert states[WORKERS[0]]["state"] == "open" and states[WORKERS[0]]["opened"] == 1
    assert states[WORKERS[0]]["last_error"] == "device_oom: device out of memory"
    assert states[WORKERS[1]]["state"] == "closed" and states[WORKERS[1]]["runs"] == 1
    name, version = mlp["ref"].split("@")
    assert f'sits_breaker_state{{model="{name}",version="{version}",worker="{WORKERS[0]}"}} 2.0' in metrics
    assert f'sits_breaker_state{{model="{name}",version="{version}",worker="{WORKERS[1]}"}} 0.0' in metrics
    assert shown.exit_code == 0, shown.output
    assert WORKERS[0] in shown.output and "open" in shown.output and "device out of memory" in shown.output
