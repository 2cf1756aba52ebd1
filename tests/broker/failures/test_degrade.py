"""Degrading lower priority classes under memory jitter: the steps (pure, clock passed in) and the
leases a degraded worker makes (real Redis, the real lease scripts)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker.config.settings import Settings
from broker.errors import ConfigError
from broker.failures import degrade
from broker.failures.settings import DegradeSettings
from broker.jobs import fills as job_fills
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.queueing import leases
from broker.queueing.scoring import Factors, Weights, queue_key
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, job_spec
from tests.leasing import lease_items

MODEL = "mlp@v1"
SETTINGS = DegradeSettings(jitter_threshold=0.1, window=10, sample_interval=1, step_interval=5, calm_for=10)
GIB = 2**30


def readings(*used: float, start: float = NOW) -> list[degrade.Reading]:
    return [degrade.Reading(start + index, int(value * GIB)) for index, value in enumerate(used)]


# --- jitter and steps ---------------------------------------------------------------------------------


def test_jitter_is_how_far_the_window_s_readings_rose_and_fell_over_the_capacity() -> None:
    assert degrade.memory_jitter(readings(4, 6, 5), 16 * GIB) == pytest.approx(1 / 16)  # up 2, down 1
    assert degrade.memory_jitter(readings(4, 6, 2, 6), 16 * GIB) == pytest.approx(4 / 16)  # down 4, up 4
    assert degrade.memory_jitter(readings(2, 2, 9, 9, 10), 16 * GIB) == 0.0  # a model loading: one way only
    assert degrade.memory_jitter(readings(4), 16 * GIB) == 0.0  # one reading: no spread yet
    assert degrade.memory_jitter(readings(4, 6), 0) == 0.0
    kept = degrade.within_window(readings(1, 9, 5, 5), now=NOW + 3, window=1.5)
    assert [reading.used_bytes for reading in kept] == [5 * GIB, 5 * GIB]


def test_jitter_steps_down_once_per_step_interval_to_p2_paused_and_no_further() -> None:
    state = degrade.DegradeState()
    state = degrade.next_state(state, 0.2, now=NOW, settings=SETTINGS)
    assert (state.step, state.name) == (1, "p1-as-p2")
    assert degrade.next_state(state, 0.2, now=NOW + 4.9, settings=SETTINGS).step == 1  # within step_interval
    state = degrade.next_state(state, 0.2, now=NOW + 5, settings=SETTINGS)
    assert (state.step, state.name) == (2, "p2-paused")
    assert degrade.next_state(state, 0.9, now=NOW + 60, settings=SETTINGS).step == 2  # P0 is never paused
    assert degrade.next_state(degrade.DegradeState(), 0.1, now=NOW, settings=SETTINGS).step == 0  # at the threshold


def test_calm_steps_back_one_step_per_calm_for_and_jitter_restarts_the_calm() -> None:
    state = degrade.DegradeState(step=2, changed_at=NOW)
    state = degrade.next_state(state, 0.01, now=NOW + 1, settings=SETTINGS)  # calm from NOW + 1
    assert degrade.next_state(state, 0.01, now=NOW + 10.9, settings=SETTINGS).step == 2
    state = degrade.next_state(state, 0.01, now=NOW + 11, settings=SETTINGS)
    assert state.step == 1
    state = degrade.next_state(state, 0.3, now=NOW + 12, settings=SETTINGS)  # jitter again, within step_interval
    assert (state.step, state.calm_since) == (1, None)
    state = degrade.next_state(state, 0.0, now=NOW + 13, settings=SETTINGS)
    assert degrade.next_state(state, 0.0, now=NOW + 22.9, settings=SETTINGS).step == 1  # calm since NOW + 13
    state = degrade.next_state(state, 0.0, now=NOW + 23, settings=SETTINGS)
    assert state.step == 0
    assert degrade.next_state(state, 0.0, now=NOW + 99, settings=SETTINGS).step == 0


def test_classes_are_bands_of_levels_and_their_lease_option_follows_the_step() -> None:
    assert [degrade.priority_class(level, SETTINGS) for level in (0, 7, 8, 11, 12, 15)] == [2, 2, 1, 1, 0, 0]
    assert degrade.lease_classes(0, SETTINGS, "dynamic", 64) is None
    served = degrade.lease_classes(1, SETTINGS, "dynamic", 64)
    assert served is not None and served["window"] == 64
    assert served["ranks"] == [2] * 12 + [1] * 4
    assert served["demote"] == [0] * 8 + [1, 2, 3, 4] + [0] * 4  # level 8 served as 7, 11 as 7
    paused = degrade.lease_classes(2, SETTINGS, "fifo", 64)
    assert paused is not None and paused["ranks"] == [0] * 8 + [2] * 4 + [1] * 4
    assert paused["demote"] == [0] * 16  # fifo scores are arrival times: no level to take off
    assert [degrade.lowest_leased_level(step, SETTINGS) for step in (0, 1, 2)] == [0, 0, 8]


def test_degrade_settings_refuse_classes_out_of_order_and_a_window_shorter_than_a_sample() -> None:
    with pytest.raises(ConfigError, match=r"degrade.middle_level \(12\) must be below degrade.top_level \(12\)"):
        Settings().with_overrides(degrade={"middle_level": 12})
    with pytest.raises(ConfigError, match="the window would never hold two readings"):
        Settings().with_overrides(degrade={"window": "1s", "sample_interval": "2s"})


# --- leases of a degraded worker ------------------------------------------------------------------------


def submit(store: Store, request_id: str, level: int, *, enqueued_at: float = NOW, tenant: str = "acme") -> None:
    factors = Factors(level=level, enqueued_at=enqueued_at)
    spec = RequestSpec(request_id=request_id, model_name="mlp", model_version="v1",
                       inputs={"x": np.zeros((1, 4), np.float32)}, rows=1, tokens=None, bucket="x:4",
                       factors=factors.to_dict(), owner="key", tenant=tenant)
    requests.submit_request(store, spec, score=queue_key(factors, Weights()), now=NOW, max_age_seconds=600)


def lease(store: Store, step: int, *, max_items: int = 1, requests_only: bool = False,
          notes: leases.LeaseNotes | None = None, window: int = 512,
          tenants: dict[str, Any] | None = None) -> list[str]:
    leased = lease_items(store, MODEL, now=NOW, lease_seconds=30, max_items=max_items,
                                requests_only=requests_only, notes=notes, tenants=tenants,
                                classes=degrade.lease_classes(step, SETTINGS, "dynamic", window))
    return [item.item_id for item in leased]


def test_at_p1_as_p2_the_top_class_goes_first_and_p1_ranks_with_p2_by_its_served_level(store: Store) -> None:
    submit(store, "p2-old", 7, enqueued_at=NOW - 20)  # 2 points of aging: ahead of a P1 served as level 7
    submit(store, "p1", 11, enqueued_at=NOW)
    submit(store, "p2-new", 5, enqueued_at=NOW)
    submit(store, "p0", 12, enqueued_at=NOW + 1)

    assert lease(store, 0, max_items=4) == ["p0", "p1", "p2-old", "p2-new"]  # (the queue's own order)
    store.client.flushdb()
    for request_id, level, at in (("p2-old", 7, NOW - 20), ("p1", 11, NOW), ("p2-new", 5, NOW), ("p0", 12, NOW + 1)):
        submit(store, request_id, level, enqueued_at=at)
    assert lease(store, 1, max_items=4) == ["p0", "p2-old", "p1", "p2-new"]


def test_at_p2_paused_p2_work_stays_queued_and_the_lease_says_so(store: Store) -> None:
    submit(store, "p2", 3)
    notes = leases.LeaseNotes()

    assert lease(store, 2, notes=notes) == [] and notes.paused
    assert store.client.zscore(store.keys.ready(MODEL), "p2") is not None  # kept queued, not failed
    submit(store, "p1", 9)
    notes = leases.LeaseNotes()
    assert lease(store, 2, max_items=4, notes=notes) == ["p1"] and not notes.paused
    only_requests = leases.LeaseNotes()
    assert lease(store, 2, requests_only=True, notes=only_requests) == [] and only_requests.paused
    assert lease(store, 0) == ["p2"]  # back at step 0 it is served


def test_a_paused_job_s_chunks_wait_while_a_p0_request_behind_them_is_leased(store: Store) -> None:
    job_fills.create_job(store, job_spec("low", rows_total=400, chunk_size=1, priority=2), now=NOW)
    submit(store, "late-p1", 8, enqueued_at=NOW + 5000)  # far behind the chunks by aging
    notes = leases.LeaseNotes()

    assert lease(store, 2, notes=notes) == ["late-p1"]
    assert lease(store, 2, notes=notes) == [] and notes.paused
    assert lease(store, 0) == ["low:c0000000"]


def test_riders_of_a_paused_class_stay_queued(store: Store) -> None:
    submit(store, "p2", 3)
    submit(store, "p1", 9)

    riders = leases.lease_riders(store, MODEL, "x:4", now=NOW, lease_seconds=30, max_items=4, max_rows=4,
                                 lowest_level=degrade.lowest_leased_level(2, SETTINGS))
    assert [item.item_id for item in riders] == ["p1"]


def test_a_requests_only_lease_weighs_the_highest_levels_first_when_more_wait_than_its_window(store: Store) -> None:
    for index in range(10):
        submit(store, f"p2-{index}", 3, enqueued_at=NOW - 100)
    submit(store, "p1", 9)
    notes = leases.LeaseNotes()

    assert lease(store, 2, requests_only=True, window=4, notes=notes) == ["p1"]  # not 4 paused P2 requests
    assert lease(store, 2, requests_only=True, window=4, notes=notes) == [] and notes.paused


def test_a_window_full_of_paused_chunks_does_not_hide_a_request_behind_it(store: Store) -> None:
    job_fills.create_job(store, job_spec("low", rows_total=400, chunk_size=1, priority=2), now=NOW)
    submit(store, "late-p1", 8, enqueued_at=NOW + 5000)  # behind all 400 chunks by aging
    notes = leases.LeaseNotes()

    assert lease(store, 2, window=16, notes=notes) == ["late-p1"]
    assert lease(store, 2, window=16, notes=notes) == [] and notes.paused
    assert lease(store, 0, window=16) == ["low:c0000000"]


def test_paused_work_beside_a_held_tenant_s_is_not_reported_as_all_paused(store: Store) -> None:
    """A held tenant's wait ends within milliseconds (its usage decays): the slot must poll for it, not
    sleep on the doorbell as for paused work, so the lease says plain nothing ({0})."""
    submit(store, "p2", 3, tenant="acme")
    submit(store, "held-p1", 9, tenant="beta")
    notes = leases.LeaseNotes()

    assert lease(store, 2, notes=notes, tenants={"order": ["acme", "beta"], "held": ["beta"], "window": 64}) == []
    assert not notes.paused
    alone = leases.LeaseNotes()
    assert lease(store, 2, notes=alone, tenants={"order": ["acme", "beta"], "held": [], "window": 64}) == ["held-p1"]
    assert lease(store, 2, notes=alone, tenants={"order": ["acme", "beta"], "held": [], "window": 64}) == []
    assert alone.paused
