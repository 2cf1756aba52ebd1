"""A v2 request's `timeout` is enforced as Triton enforces it: a request whose timeout passed between its
lease and its run is not run, and fails as timed out; its batch neighbours run (real Redis, a real
`WorkerContext` and ONNX Runtime session). A lease never takes one already past it
(`tests/broker/tenants/test_unrun_presence.py`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from broker.errors import InferenceTimeout
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing.scoring import estimate_latency_ms
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.request_runs import run_requests
from tests.leasing import lease_items
from tests.worker.worker_helpers import mlp_worker_context


@pytest.fixture
def ctx(store: Store, zoo_dir: Path) -> WorkerContext:
    return mlp_worker_context(store, zoo_dir)


def submit(store: Store, request_id: str, *, expires_at: float | None, tenant: str = "") -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.ones((1, 64), dtype=np.float32)}, rows=1, tokens=None, bucket="",
                       factors={"level": 0}, expires_at=expires_at, tenant=tenant, owner=f"{tenant}-key")
    requests.submit_request(store, spec, score=0.0, now=time.time(), max_age_seconds=60)


def test_a_request_leased_after_its_timeout_is_not_run_and_fails_as_timed_out(ctx: WorkerContext,
                                                                               store: Store) -> None:
    now = time.time()
    submit(store, "late", expires_at=now - 0.25)
    submit(store, "in-time", expires_at=now + 60)
    submit(store, "no-timeout", expires_at=None)
    items = lease_items(store, "mlp@v1", now=now - 1, lease_seconds=30, max_items=3)  # (leased before it passed)
    assert len(items) == 3

    assert run_requests(ctx, items) == 2

    late = requests.get_request(store, "late")
    assert late.status == "failed" and late.error_code == InferenceTimeout.code
    assert "timeout passed" in late.error and "it was not run" in late.error
    assert late.batch_size == 3 and not late.outputs
    for request_id in ("in-time", "no-timeout"):
        record = requests.get_request(store, request_id)
        assert record.status == "succeeded" and record.outputs["logits"].shape == (1, 10)
    assert store.client.zcard(store.keys.inflight("mlp@v1")) == 0  # every lease dropped: nothing runs again


def test_a_batch_of_only_timed_out_requests_runs_nothing(ctx: WorkerContext, store: Store,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    submit(store, "late", expires_at=time.time() - 1)
    items = lease_items(store, "mlp@v1", now=time.time() - 2, lease_seconds=30, max_items=1)
    monkeypatch.setattr(WorkerContext, "run", lambda *args, **kwargs: pytest.fail("a timed-out request ran"))

    assert run_requests(ctx, items) == 0
    assert requests.get_request(store, "late").status == "failed"


def test_a_request_leased_and_not_run_costs_its_tenant_its_estimated_run_in_the_fair_order_not_on_its_bill(
        ctx: WorkerContext, store: Store) -> None:
    submit(store, "late", expires_at=time.time() - 1, tenant="acme")
    items = lease_items(store, "mlp@v1", now=time.time() - 2, lease_seconds=30, max_items=1)

    run_requests(ctx, items)
    ctx.usage.flush()

    estimated = estimate_latency_ms(ctx.model("mlp@v1"), rows=1, tokens=None) / 1000
    assert tenant_usage.read_usage(store)["acme"].value == pytest.approx(estimated)  # a lease held a slot for it
    day = tenant_usage.day_number(time.time())
    [bill] = tenant_usage.usage_report(store, ["acme"], first_day=day, last_day=day, by="tenant", prices={})
    assert bill["device_seconds"] == 0 and bill["failed"] == 1  # nothing ran: no device time on the bill
