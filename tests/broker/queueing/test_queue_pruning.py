"""Pruning older model versions' drained queues from the set of queues, which every drain loop reads
before each batch choice: the set must not grow with every version ever registered, and a process
that keeps the set must notice a ref pruned and another added even when the size stays the same."""

from __future__ import annotations

import pytest

from broker.jobs import fills as job_fills
from broker.jobs import progress as job_progress
from broker.jobs import records as jobs
from broker.queueing import leases, queues, reaping, tickets
from broker.state.store import Store
from tests.broker.broker_helpers import NOW, job_spec, ready_ids
from tests.leasing import lease_items

OLD, LATEST = "mlp@v1", "mlp@v2"


@pytest.fixture
def two_versions(store: Store) -> Store:
    """The model 'mlp' with v2 as its latest version; v1 older."""
    store.client.hset(store.keys.model_latest, "mlp", "v2")
    return store


def queue_set(store: Store) -> set[str]:
    return set(store.client.smembers(store.keys.queues))


def drain(store: Store, model_ref: str) -> None:
    """Lease everything waiting for `model_ref` and finish it, as workers do."""
    for item in lease_items(store, model_ref, now=NOW, lease_seconds=30, max_items=100):
        leases.finish_item(store, item, "", now=NOW)


def test_an_older_version_s_drained_queue_is_pruned_and_the_latest_s_stays(two_versions: Store) -> None:
    store = two_versions
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=2, chunk_size=1), now=NOW)
    job_fills.create_job(store, job_spec("jnew", model_version="v2", rows_total=2, chunk_size=1), now=NOW)
    assert queue_set(store) == {OLD, LATEST}

    assert queues.prune_old_queues(store) == []  # both have waiting items

    drain(store, OLD)
    drain(store, LATEST)
    assert queues.prune_old_queues(store) == [OLD]
    assert queue_set(store) == {LATEST}  # the latest version's queue stays, however empty
    assert queues.prune_old_queues(store) == []


def test_an_older_version_with_leased_items_is_kept(two_versions: Store) -> None:
    store = two_versions
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    [leased] = lease_items(store, OLD, now=NOW, lease_seconds=30, max_items=1)

    assert queues.prune_old_queues(store) == []

    # its lease expires: the item goes back to a queue that is still in the set
    reaping.reap_expired_leases(store, now=NOW + 31, max_attempts=3)
    assert ready_ids(store, OLD) == [leased.item_id]
    assert OLD in queue_set(store)
    assert OLD in queues.queue_heads(store)


def test_queueing_for_a_pruned_version_puts_its_queue_back(two_versions: Store) -> None:
    store = two_versions
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    drain(store, OLD)
    assert queues.prune_old_queues(store) == [OLD]

    job_fills.create_job(store, job_spec("jagain", model_version="v1", rows_total=1, chunk_size=1), now=NOW)

    assert OLD in queue_set(store)
    assert list(queues.queue_heads(store)) == [OLD]


def test_a_job_s_finalize_item_puts_its_queue_back(two_versions: Store) -> None:
    """The finalize item is queued by the last chunk's ack, not by an enqueue."""
    store = two_versions
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    [chunk] = lease_items(store, OLD, now=NOW, lease_seconds=30, max_items=1)
    store.client.srem(store.keys.queues, OLD)  # as if pruned in a moment nothing was queued or leased

    assert job_progress.ack_chunk(store, chunk, now=NOW + 1, worker="w1") == 2

    assert OLD in queue_set(store)
    assert ready_ids(store, OLD) == [jobs.finalize_item_id("jold")]


def test_a_watcher_sees_a_queue_that_replaced_a_pruned_one_in_a_set_of_the_same_size(two_versions: Store) -> None:
    store = two_versions
    watcher = queues.QueueWatcher(store)
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    assert list(watcher.snapshot().heads) == [OLD]
    drain(store, OLD)
    assert watcher.snapshot().heads == {}

    queues.prune_old_queues(store)
    job_fills.create_job(store, job_spec("jcnn", model_name="cnn", rows_total=1, chunk_size=1), now=NOW)
    assert queue_set(store) == {"cnn@v1"}  # one ref, as before

    assert list(watcher.snapshot().heads) == ["cnn@v1"]


def test_a_ticket_is_not_released_with_a_set_of_queues_read_before_it_changed(two_versions: Store) -> None:
    """release_ticket's check is atomic with the version read with the refs: a ref added since (even
    in place of a pruned one, the set's size unchanged) sends the caller back to read the set again."""
    store = two_versions
    job_fills.create_job(store, job_spec("jold", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    drain(store, OLD)
    [ticket] = tickets.top_up_tickets(store, now=NOW, target=1)
    refs, version = queues.queue_refs(store)
    assert refs == [OLD]

    queues.prune_old_queues(store)
    job_fills.create_job(store, job_spec("jcnn", model_name="cnn", rows_total=1, chunk_size=1), now=NOW)
    keys = store.keys
    stale = store.scripts.release_ticket(keys=[keys.tickets, keys.queues_version, *(keys.ready(r) for r in refs)],
                                         args=[ticket, version])

    assert stale == -1
    assert tickets.release_ticket(store, ticket) is False  # read again: cnn's item waits
    assert tickets.ticket_count(store) == 1


def test_a_version_of_a_model_with_no_latest_is_pruned_and_a_ref_without_a_version_is_left_alone(
        store: Store) -> None:
    """Any drained version but its model's latest goes (no latest recorded: none is the latest)."""
    job_fills.create_job(store, job_spec("jx", model_version="v1", rows_total=1, chunk_size=1), now=NOW)
    drain(store, "mlp@v1")
    store.client.sadd(store.keys.queues, "bare")

    assert queues.prune_old_queues(store) == ["mlp@v1"]
    assert queue_set(store) == {"bare"}
