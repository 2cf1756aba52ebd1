"""Giving leased items back unrun: at once, their attempt not counted, the doorbell rung (real Redis)."""

from __future__ import annotations

from broker.jobs import fills as job_fills
from broker.queueing import leases
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, inflight_deadlines, job_spec, ready_ids
from tests.leasing import lease_items


def test_items_given_back_unrun_wait_again_at_once_with_their_attempt_uncounted(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    first, second = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2)
    store.client.delete(store.keys.doorbell)

    assert leases.return_unrun(store, [first]) == 1

    assert ready_ids(store) == [first.item_id]  # by its score, not behind anything
    assert inflight_deadlines(store) == {second.item_id: NOW + 30}
    assert store.client.hget(store.keys.attempts, first.item_id) is None
    assert store.client.llen(store.keys.doorbell) == 1
    [again] = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=1)
    assert (again.item_id, again.attempts) == (first.item_id, 1)


def test_giving_back_is_a_no_op_for_items_no_longer_in_flight(store: Store) -> None:
    spec = job_spec(rows_total=8, chunk_size=4)
    job_fills.create_job(store, spec, now=NOW)
    first, second = lease_items(store, MODEL_REF, now=NOW, lease_seconds=30, max_items=2)
    leases.return_unrun(store, [first])
    ack(store, second, now=NOW)  # done: it must not come back
    store.client.delete(store.keys.doorbell)

    assert leases.return_unrun(store, [first, second]) == 0

    assert ready_ids(store) == [first.item_id]
    assert store.client.llen(store.keys.doorbell) == 0
