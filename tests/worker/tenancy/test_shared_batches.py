"""A worker's merged batches split by the tenants' shares: the `shares` option its leases pass, and a slot
held back for a present tenant's next request waits on the doorbell for it, not longer than the presence
(real Redis, a real `WorkerContext`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.memory.reservation import Admission
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases
from broker.queueing.scoring import estimate_latency_ms
from broker.state.store import Store
from broker.tenants import usage as tenant_usage
from broker.tenants.batch_shares import BatchShares, in_flight_bound
from broker.tenants.usage import BillEntry
from sits_worker.serving import leasing
from sits_worker.serving.drain_loop import _lease_admitted, _Slice, _wait_after_nothing_ran
from tests.worker.worker_helpers import mlp_worker_context

SHARES = {"s1": {"guaranteed_share": 0.7, "limit": 1.2}, "s2": {"guaranteed_share": 0.3, "limit": 3.0}}
PRESENT_SECONDS = Settings().fair_share.present_for
FULL = Admission("mlp@v1", 64, 0)


def submit(store: Store, request_id: str, tenant: str) -> None:
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"features": np.zeros((1, 64), np.float32)}, rows=1, tokens=None, bucket="features:64",
                       factors={"level": 0, "enqueued_at": time.time()}, owner=f"{tenant}-key", tenant=tenant)
    requests.submit_request(store, spec, score=time.time(), now=time.time(), max_age_seconds=60)


def test_the_shares_option_follows_the_fair_order_and_leaves_held_tenants_out(store: Store, zoo_dir: Path) -> None:
    settings = Settings().with_overrides(tenants=SHARES, fair_share={"usage_half_life": "10s", "usage_refresh": "0s"})
    ctx = mlp_worker_context(store, zoo_dir, settings)
    assert ctx.fair_share.batch_shares() == BatchShares((("s1", 0.7), ("s2", 0.3)), PRESENT_SECONDS)

    capacity = 10 / np.log(2)  # (one stream slot over a 10 s half-life)
    tenant_usage.note_usage(store, [BillEntry("s1", "k1", "mlp@v1", "cpu", 0.5 * capacity, 1),
                                    BillEntry("s2", "k2", "mlp@v1", "cpu", 0.1 * capacity, 1)], now=time.time(),
                            half_life=10)
    assert ctx.fair_share.batch_shares() == BatchShares((("s2", 0.3), ("s1", 0.7)), PRESENT_SECONDS)
    tenant_usage.note_usage(store, [BillEntry("s1", "k1", "mlp@v1", "cpu", 0.4 * capacity, 1)], now=time.time(),
                            half_life=10)
    assert ctx.fair_share.batch_shares() == BatchShares((("s2", 0.3),), PRESENT_SECONDS)  # s1 past its limit: held

    off = mlp_worker_context(store, zoo_dir, settings.with_overrides(fair_share={"enabled": False}))
    assert off.fair_share.batch_shares() is None


def test_a_slot_held_for_a_present_tenant_waits_on_the_doorbell_at_most_its_presence(store: Store,
                                                                                   zoo_dir: Path) -> None:
    """(A presence of 0.5 s rather than the default 50 ms: the steps below must come within it on a busy
    machine, or s1 is no longer present by the second lease.)"""
    presence = 0.5
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES,
                                                                       fair_share={"present_for": presence}))
    for index in range(8):
        submit(store, f"s1-{index}", "s1")
        submit(store, f"s2-{index}", "s2")
    leased, _ = _lease_admitted(ctx, [FULL], "", notes=leases.LeaseNotes(),
                                waiting_requests=ctx.queue_watcher.snapshot().waiting_requests)
    assert sorted(item.payload["tenant"] for item in leased) == ["s1"] * 8 + ["s2"] * 3

    snapshot = ctx.queue_watcher.snapshot()  # (the loop's next look: it empties the doorbell)
    notes = leases.LeaseNotes()
    again, _ = _lease_admitted(ctx, [FULL], "", notes=notes, waiting_requests=snapshot.waiting_requests)
    assert again == [] and notes.held_for_share  # s1's clients are away: s2's five wait for them

    state = _Slice("", ends=time.monotonic() + 60)
    started = time.monotonic()
    _wait_after_nothing_ran(ctx, state, snapshot, None, room=True, notes=notes, allowed=[FULL])
    assert time.monotonic() - started >= 0.9 * presence  # nobody called: the whole presence

    submit(store, "s1-back", "s1")  # (its enqueue rings the doorbell)
    started = time.monotonic()
    _wait_after_nothing_ran(ctx, state, snapshot, None, room=True, notes=notes, allowed=[FULL])
    assert time.monotonic() - started < 0.9 * presence  # back at once for the tenant's call
    back, _ = _lease_admitted(ctx, [FULL], "", notes=leases.LeaseNotes(),
                              waiting_requests=ctx.queue_watcher.snapshot().waiting_requests)
    assert [item.item_id for item in back] == ["s1-back"]


def test_the_returning_tenants_batch_is_split_by_their_shares_too(store: Store, zoo_dir: Path) -> None:
    """Both tenants taken for absent a moment (each was away when a scan looked): the next lease takes their
    requests first, from the waiting requests alone (`FairShare.returning_option`), and splits them all the
    same; without the split it took every waiting request, for as long as they stayed out (up to 10 s)."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES))
    for index in range(8):
        submit(store, f"s1-{index}", "s1")
        submit(store, f"s2-{index}", "s2")
    ctx.fair_share.note_absent("mlp@v1", ["s1", "s2"])
    assert ctx.fair_share.returning_option("mlp@v1") == {"order": ["s1", "s2"], "held": [], "window": 4096,
                                                         "only": True}
    leased, _ = _lease_admitted(ctx, [FULL], "", notes=leases.LeaseNotes(),
                                waiting_requests=ctx.queue_watcher.snapshot().waiting_requests)
    assert sorted(item.payload["tenant"] for item in leased) == ["s1"] * 8 + ["s2"] * 3


def test_the_presence_setting_and_the_model_s_run_reach_the_worker_s_leases(store: Store, zoo_dir: Path) -> None:
    """`fair_share.present_for` is what the shares option carries and how long a held slot waits; a lease's
    leased requests keep their tenant present for the model's profiled run on this worker's slots."""
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES,
                                                                       fair_share={"present_for": "150ms"}))
    shares = leasing.share_option(ctx, "mlp@v1", rows=64)
    assert shares is not None and shares.present_for == pytest.approx(0.15)
    run = estimate_latency_ms(ctx.model("mlp@v1"), rows=64, tokens=None) / 1000
    assert shares.in_flight_for == pytest.approx(in_flight_bound(run, ctx.streams)) and shares.in_flight_for > 0

    for index in range(8):
        submit(store, f"s1-{index}", "s1")
        submit(store, f"s2-{index}", "s2")
    _lease_admitted(ctx, [FULL], "", notes=leases.LeaseNotes(),
                    waiting_requests=ctx.queue_watcher.snapshot().waiting_requests)
    snapshot = ctx.queue_watcher.snapshot()
    notes = leases.LeaseNotes()
    assert _lease_admitted(ctx, [FULL], "", notes=notes, waiting_requests=snapshot.waiting_requests)[0] == []
    started = time.monotonic()
    _wait_after_nothing_ran(ctx, _Slice("", ends=time.monotonic() + 60), snapshot, None, room=True, notes=notes,
                            allowed=[FULL])
    assert time.monotonic() - started >= 0.9 * 0.15  # the setting's presence, not 50 ms


def test_a_running_chunk_s_riders_are_split_by_the_shares(store: Store, zoo_dir: Path) -> None:
    ctx = mlp_worker_context(store, zoo_dir, Settings().with_overrides(tenants=SHARES))
    for index in range(8):
        submit(store, f"s2-{index}", "s2")
    for index in range(8):
        submit(store, f"s1-{index}", "s1")
    riders = leasing.lease_riders(ctx, "mlp@v1", {"features": np.zeros((4, 64), np.float32)}, "")
    assert sorted(item.payload["tenant"] for item in riders) == ["s1"] * 8 + ["s2"] * 3
