"""Presence on a model is had only by work that runs (real Redis, time passed in).

A tenant ranked first and present on a model holds the others' requests back (`broker/tenants/batch_shares.py`).
Requests that never run must not make it present: a lease neither takes nor counts a request past its
`reject` timeout, and an answer without a run takes the lease's mark back without marking the tenant served.
Before, a trickle of requests sent with a 1 ms timeout held another tenant's flood back indefinitely, at no
device time at all.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from broker.errors import InferenceTimeout
from broker.online import requests
from broker.online.requests import RequestResult, RequestSpec
from broker.queueing import leases
from broker.queueing.leases import LeasedItem, LeaseNotes, LeaseOptions
from broker.state.store import Store
from broker.tenants.batch_shares import BatchShares
from tests.broker.broker_helpers import MODEL_REF, NOW
from tests.leasing import lease_items

BUCKET = "features:64"
PRESENT_FOR = 0.05
ORDER = {"order": ["a", "b"], "held": [], "window": 4096}
SHARES = BatchShares((("a", 0.7), ("b", 0.3)), PRESENT_FOR, in_flight_for=0.5)
"""As a worker passes them: a leased request keeps its tenant present up to half a second unanswered."""


def submit(store: Store, request_id: str, tenant: str, *, score: float, now: float = NOW,
           expires_at: float | None = None) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None, bucket=BUCKET,
                       factors={"level": 0, "enqueued_at": now}, owner=f"{tenant}-key", tenant=tenant,
                       expires_at=expires_at)
    requests.submit_request(store, spec, score=score, now=now, max_age_seconds=600)


def flood_b(store: Store, count: int = 20) -> None:
    for index in range(count):
        submit(store, f"b-{index}", "b", score=1000 + index)


def lease(store: Store, *, now: float, notes: LeaseNotes | None = None) -> list[LeasedItem]:
    return lease_items(store, MODEL_REF, now=now, lease_seconds=30, max_items=64, tenants=ORDER, shares=SHARES,
                       notes=notes)


def tenants_of(items: list[LeasedItem]) -> Counter[str]:
    return Counter(item.payload["tenant"] for item in items)


def complete(store: Store, items: list[LeasedItem], *, now: float, ran: bool) -> None:
    results = [RequestResult(item, outputs={"y": np.zeros((1, 2), np.float32)}) if ran else
               RequestResult(item, error="its timeout passed", code=InferenceTimeout.code, ran=False)
               for item in items]
    requests.complete_requests(store, results, now=now, keep_seconds=60, batch_size=len(items), worker="w1",
                               run_started=now, run_rows=len(items) if ran else 0)


def test_a_request_past_its_timeout_is_neither_leased_nor_counted_as_its_tenant_s_work(store: Store) -> None:
    submit(store, "a-late", "a", score=0, expires_at=NOW + 0.001)
    flood_b(store)

    result = leases.lease_batch(store, MODEL_REF, LeaseOptions(max_items=64, tenants=ORDER, shares=SHARES),
                                now=NOW + 0.002, lease_seconds=30)

    assert tenants_of(result.items) == {"b": 20}  # a has no live work: no split, no hold, b's whole batch
    assert result.expired == 1 and store.client.zscore(store.keys.ready(MODEL_REF), "a-late") is not None
    assert not store.client.hexists(store.keys.tenants_served(MODEL_REF), "a|leased")


def test_a_request_past_its_timeout_does_not_ride_nor_hold_the_riders(store: Store) -> None:
    submit(store, "a-late", "a", score=0, expires_at=NOW + 0.001)
    flood_b(store, 8)

    ridden = leases.lease_riders(store, MODEL_REF, BUCKET, now=NOW + 0.002, lease_seconds=30, max_items=16,
                                 max_rows=16, tenants={"order": ["a", "b"], "held": []}, shares=SHARES)

    assert tenants_of(ridden) == {"b": 8}


def test_an_answer_without_a_run_ends_the_presence_its_lease_gave(store: Store) -> None:
    submit(store, "a-0", "a", score=0, expires_at=NOW + 0.003)  # leased in time, past it when the worker loads it
    leased = lease(store, now=NOW + 0.002)
    assert tenants_of(leased) == {"a": 1}
    flood_b(store)
    held = LeaseNotes()
    assert lease(store, now=NOW + 0.0025, notes=held) == [] and held.held_for_share  # a's batch "runs"

    complete(store, leased, now=NOW + 0.004, ran=False)

    assert tenants_of(lease(store, now=NOW + 0.005)) == {"b": 20}  # not held for a: nothing of it ran


def test_an_unrun_answer_leaves_the_presence_of_the_tenant_s_last_run_standing(store: Store) -> None:
    submit(store, "a-0", "a", score=0)
    complete(store, lease(store, now=NOW), now=NOW + 0.01, ran=True)  # a's clients call again within 50 ms
    submit(store, "a-1", "a", score=1, now=NOW + 0.02, expires_at=NOW + 0.025)
    late = lease(store, now=NOW + 0.021)
    complete(store, late, now=NOW + 0.03, ran=False)
    flood_b(store)

    notes = LeaseNotes()
    assert lease(store, now=NOW + 0.05, notes=notes) == [] and notes.held_for_share  # a's run at +0.01 counts
    assert tenants_of(lease(store, now=NOW + 0.01 + PRESENT_FOR + 0.001)) == {"b": 20}


def test_a_trickle_of_expiring_requests_no_longer_holds_another_tenant_back(store: Store) -> None:
    """The reviewer's attack: a sends one request with a 1 ms timeout every 40 ms; a worker leases every 10 ms,
    2 ms after a's submit. Before, every lease was held for a or took a's request alone: b got none."""
    flood_b(store, 50)
    served: Counter[str] = Counter()
    now, sent = NOW, 0
    while now < NOW + 2:
        if round((now - NOW) * 100) % 4 == 0:
            submit(store, f"a-{sent}", "a", score=sent, now=now, expires_at=now + 0.001)
            sent, now = sent + 1, now + 0.002
        leased = lease(store, now=now)
        if leased:
            complete(store, leased, now=now, ran=True)
            served.update(tenants_of(leased))
        now += 0.01
    assert served == {"b": 50} and sent >= 40
