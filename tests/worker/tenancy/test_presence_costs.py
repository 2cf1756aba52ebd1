"""Presence is not free: a tenant ranked first cannot hold another tenant's requests back at no cost (real
Redis, a real `WorkerContext` running the zoo MLP with ONNX Runtime, its own leases and waits, in real time).

Requests sent with a 1 ms timeout are never leased, so they neither run nor make their tenant present. Requests
that do run keep their tenant present between its calls, and a slot held for it meanwhile charges it the wait in
the usage fair share ranks by: a trickle of one-row requests every 40 ms ranks its tenant second within a moment.
Before, either pattern held the other tenant's flood back for as long as it went on.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from broker.config.settings import Settings
from broker.memory.reservation import Admission
from broker.online import requests
from broker.online.requests import RequestSpec, encode_array
from broker.queueing import leases
from broker.state.embedded import EmbeddedRedis
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.apikeys import create_api_key
from broker.tenants.usage import BillEntry
from sits_api.app import create_app
from sits_worker.serving.context import WorkerContext
from sits_worker.serving.drain_loop import _lease_admitted, _Slice, _wait_after_nothing_ran
from sits_worker.serving.request_runs import run_requests
from tests.api.api_helpers import Api, make_settings
from tests.worker.worker_helpers import mlp_worker_context

SHARES = {"a": {"guaranteed_share": 0.7, "limit": 1.2}, "b": {"guaranteed_share": 0.3, "limit": 3.0}}
FULL = Admission("mlp@v1", 64, 0)
ONE_ROW = {"model": "mlp", "inputs": {"features": {"b64": encode_array(np.ones((1, 64), np.float32))}}}


def submit(store: Store, request_id: str, tenant: str) -> None:
    now = time.time()
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None, bucket="features:64",
                       factors={"level": 0, "enqueued_at": now}, owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=now, now=now, max_age_seconds=60)


def drain(ctx: WorkerContext, seconds: float, every: float, send: Callable[[], None],
          until: Callable[[Counter[str]], bool] = lambda served: False) -> Counter[str]:
    """A drain loop's slot for `seconds`, or until `until` the tenants served: `send` every `every` s, lease, run
    what it leased, else wait as the loop waits (on the doorbell while held for a tenant). The tenants of the
    requests it ran."""
    served: Counter[str] = Counter()
    state = _Slice("", ends=time.monotonic() + 60)
    end, next_send = time.time() + seconds, time.time()
    while time.time() < end and not until(served):
        if time.time() >= next_send:
            send()
            next_send += every
        snapshot = ctx.queue_watcher.snapshot()
        notes = leases.LeaseNotes()
        leased, _ = _lease_admitted(ctx, [FULL], "", notes=notes, waiting_requests=snapshot.waiting_requests)
        if leased:
            run_requests(ctx, leased)
            served.update(item.payload["tenant"] for item in leased)
        else:
            _wait_after_nothing_ran(ctx, state, snapshot, None, room=True, notes=notes, allowed=[FULL])
    return served


def test_requests_sent_to_time_out_at_once_hold_no_one_back(redis_server: EmbeddedRedis, store: Store,
                                                            tmp_path: Path, zoo_dir: Path) -> None:
    settings = make_settings(redis_server, store, tmp_path, zoo_dir).with_overrides(
        tenants=SHARES, fair_share={"usage_refresh": "0s"})
    ctx = mlp_worker_context(store, zoo_dir, settings)
    client = create_app(settings, store=store).test_client()
    mallory = Api(client, create_api_key(store, "mallory", "user", tenant="a"))
    bob = Api(client, create_api_key(store, "bob", "user", tenant="b"))
    tenant_usage.note_usage(store, [BillEntry("b", "bob", "mlp@v1", "cpu", 0.5, 64)], now=time.time(),
                            half_life=settings.fair_share.usage_half_life)  # b ran before; a ranks first
    for _ in range(30):
        assert bob.post("/v1/requests", json=ONE_ROW).status_code == 202

    def expiring() -> None:
        assert mallory.post("/v1/requests", json={**ONE_ROW, "timeout_ms": 1}).status_code == 202

    served = drain(ctx, 6.0, 0.25, expiring, until=lambda served: served["b"] >= 30)  # (a busy machine's time)

    assert served == {"b": 30}  # before: none of b's, a's leased alone and failed unrun, again and again
    assert store.client.zcard(store.keys.waiting_requests("mlp@v1")) == 0  # a's failed at once, not left waiting


def test_a_trickle_of_one_row_requests_pays_for_the_slot_held_for_it_and_ranks_second(store: Store,
                                                                                     zoo_dir: Path) -> None:
    settings = Settings().with_overrides(tenants=SHARES, fair_share={"usage_refresh": "0s"})
    ctx = mlp_worker_context(store, zoo_dir, settings)
    tenant_usage.note_usage(store, [BillEntry("b", "b-key", "mlp@v1", "cpu", 0.05, 64)], now=time.time(),
                            half_life=settings.fair_share.usage_half_life)  # b ran before; a ranks first
    for index in range(300):
        submit(store, f"b{index:015x}", "b")
    sent = iter(range(10**6))

    served = drain(ctx, 1.5, 0.04, lambda: submit(store, f"a{next(sent):015x}", "a"))

    assert served["b"] == 300, served  # before: none; every 40 ms a's answered request kept it present 50 ms
    ctx.usage.flush()
    day = tenant_usage.day_number(time.time())
    [bill] = tenant_usage.usage_report(store, ["a"], first_day=day, last_day=day, by="tenant", prices={})
    charged = tenant_usage.read_usage(store)["a"].value  # its runs, and the waits of the slot held for it
    assert charged > 0.05 / 0.3 * 0.7  # past b's usage over share (of b's share): a ranked second
    assert bill["device_seconds"] < charged / 2  # its bill holds its runs alone
