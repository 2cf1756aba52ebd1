"""Slot caps cannot be used to hide the queue: however many of one tenant's capped jobs sit at the head
of a model's queue, each holding its cap, a free stream slot still reaches the work behind them."""

from __future__ import annotations

import dataclasses

import pytest

from broker.jobs import fills as job_fills
from broker.queueing import leases
from broker.queueing.leases import LeaseOptions
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec

ONE_CHUNK = LeaseOptions(max_items=8, max_chunks=1)
CAPPED_JOBS = 40
"""More than a lease call steps over at once (lease_batch.lua's MOST_CAPPED_RUNS), fewer than a
tenant's default `max_inflight` (64)."""


def create(store: Store, job_id: str, *, tenant: str, chunks: int, priority: int, max_slots: int | None) -> None:
    spec = dataclasses.replace(job_spec(job_id, rows_total=chunks, chunk_size=1, priority=priority),
                               max_slots=max_slots, tenant=tenant)
    job_fills.create_job(store, spec, now=NOW)


@pytest.mark.parametrize("fair", [False, True], ids=["queue-order", "fair-share-order"])
def test_many_capped_jobs_at_the_head_do_not_keep_free_slots_from_the_work_behind(store: Store,
                                                                                   fair: bool) -> None:
    for number in range(CAPPED_JOBS):
        create(store, f"jmallory{number:03d}", tenant="mallory", chunks=3, priority=9, max_slots=1)
    create(store, "jvictim", tenant="victim", chunks=2, priority=1, max_slots=None)
    options = ONE_CHUNK if not fair else dataclasses.replace(
        ONE_CHUNK, tenants={"order": ["mallory", "victim"], "held": [], "window": 512})

    taken = [leases.lease_batch(store, MODEL_REF, options, now=NOW + 1, lease_seconds=30)
             for _ in range(CAPPED_JOBS + 1)]

    jobs = [batch.items[0].item_id.split(":c")[0] for batch in taken if batch.items]
    assert "jvictim" in jobs, [batch.status for batch in taken[-3:]]
