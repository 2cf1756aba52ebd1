"""A job's slot cap (`max_slots`): at most that many of its chunks are leased at once, the work behind its
chunks is leased meanwhile, and a slot comes back when one of its chunks leaves flight (ack, reap)."""

from __future__ import annotations

import dataclasses

import pytest

from broker.jobs import fills as job_fills
from broker.jobs.finish_prediction import Fleet, Work, finishes
from broker.jobs.records import get_job
from broker.queueing import leases
from broker.queueing.leases import LeaseOptions
from broker.queueing.reaping import reap_expired_leases
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, job_spec

ONE_CHUNK = LeaseOptions(max_items=8, max_chunks=1)
"""What a worker's stream slot asks for: one chunk at a time."""


def lease(store: Store, *, now: float = NOW + 1, options: LeaseOptions = ONE_CHUNK,
          tenants: dict | None = None) -> list[leases.LeasedItem]:
    if tenants is not None:
        options = dataclasses.replace(options, tenants=tenants)
    return leases.lease_batch(store, MODEL_REF, options, now=now, lease_seconds=30).items


def create(store: Store, job_id: str, *, chunks: int, max_slots: int | None = None, priority: int = 0,
           at: float = NOW) -> None:
    spec = dataclasses.replace(job_spec(job_id, rows_total=chunks, chunk_size=1, priority=priority),
                               max_slots=max_slots, tenant="acme")
    job_fills.create_job(store, spec, now=at)


def job_of(item: leases.LeasedItem) -> str:
    return item.item_id.split(":c")[0]


@pytest.mark.parametrize("fair", [False, True], ids=["queue-order", "fair-share-order"])
def test_a_capped_job_holds_at_most_its_slots_and_the_work_behind_it_runs(store: Store, fair: bool) -> None:
    create(store, "jcapped", chunks=200, max_slots=2, priority=9)  # in front of everything else
    create(store, "jother", chunks=3, priority=1)
    tenants = {"order": ["acme"], "held": [], "window": 512} if fair else None

    taken = [lease(store, tenants=tenants) for _ in range(5)]

    assert [job_of(batch[0]) for batch in taken[:2]] == ["jcapped", "jcapped"]
    assert [job_of(batch[0]) for batch in taken[2:]] == ["jother"] * 3  # 198 capped chunks stepped over
    held = leases.lease_batch(store, MODEL_REF, dataclasses.replace(ONE_CHUNK, tenants=tenants), now=NOW + 1,
                              lease_seconds=30)
    assert held.items == [] and held.status is leases.LeaseStatus.AT_SLOT_CAP  # (the slot waits, no spin)
    assert get_job(store, "jcapped", now=NOW).max_slots == 2

    ack(store, taken[0][0], now=NOW + 2)
    again = lease(store, now=NOW + 3, tenants=tenants)
    assert [job_of(item) for item in again] == ["jcapped"]  # the ack gave its slot back


def test_a_batch_of_several_chunks_stays_within_the_cap(store: Store) -> None:
    create(store, "jcapped", chunks=10, max_slots=3)
    batch = lease(store, options=LeaseOptions(max_items=8, max_chunks=8))
    assert len(batch) == 3
    assert lease(store, options=LeaseOptions(max_items=8, max_chunks=8)) == []


def test_a_reaped_lease_gives_its_slot_back(store: Store) -> None:
    create(store, "jcapped", chunks=5, max_slots=1)
    first = lease(store)
    assert len(first) == 1 and lease(store) == []
    reap_expired_leases(store, now=NOW + 60, max_attempts=5)  # its holder died: the lease lapsed
    assert [item.item_id for item in lease(store, now=NOW + 61)] == [first[0].item_id]


def test_resumed_chunks_keep_the_cap(store: Store) -> None:
    create(store, "jcapped", chunks=6, max_slots=2)
    assert len(lease(store)) == 1 and len(lease(store)) == 1
    job_fills.resume_job(store, "jcapped", now=NOW + 5)  # its leases taken back, its chunks queued again
    assert len(lease(store, now=NOW + 6)) == 1 and len(lease(store, now=NOW + 6)) == 1
    assert lease(store, now=NOW + 6) == []


def test_an_uncapped_job_takes_every_slot(store: Store) -> None:
    create(store, "jfree", chunks=5)
    assert all(len(lease(store)) == 1 for _ in range(5))


def test_the_prediction_of_a_capped_job_runs_its_chunks_on_at_most_its_slots() -> None:
    fleet = Fleet(slots=4)
    free = Work("j1", 0.0, seconds=40.0, chunks=8)
    capped = dataclasses.replace(free, max_slots=2)
    many = dataclasses.replace(free, chunks=400)  # placed as a fluid
    assert finishes([free], fleet, now=0.0) == [pytest.approx(10.0)]
    assert finishes([capped], fleet, now=0.0) == [pytest.approx(20.0)]
    assert finishes([many], fleet, now=0.0) == [pytest.approx(10.0)]
    assert finishes([dataclasses.replace(many, max_slots=1)], fleet, now=0.0) == [pytest.approx(40.0)]
    # the slots a capped job leaves are the next job's
    assert finishes([capped, free], fleet, now=0.0) == [pytest.approx(20.0), pytest.approx(20.0)]
    assert finishes([free, free], fleet, now=0.0)[1] == pytest.approx(20.0)
