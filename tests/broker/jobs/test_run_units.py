"""Run units: how much job work one lease takes (`broker.jobs.granularity`), and the lease script's
`merge_rows`, which takes further chunks along only within a unit's rows."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from broker.jobs import fills as job_fills
from broker.jobs.granularity import ALONE, RunUnit, choose_unit
from broker.queueing import leases
from broker.queueing.leases import LeaseOptions
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, ack, job_spec


def test_a_unit_is_what_runs_in_its_seconds_at_the_rate() -> None:
    unit = choose_unit(batch_rows=16, rows_per_second=1_000.0, unit_seconds=0.1, most_chunks=8)
    assert unit == RunUnit(max_chunks=8, max_rows=100)


def test_a_unit_holds_one_batch_at_least_and_without_a_rate_a_chunk_runs_alone() -> None:
    assert choose_unit(batch_rows=64, rows_per_second=100.0, unit_seconds=0.1, most_chunks=8).max_rows == 64
    assert choose_unit(batch_rows=64, rows_per_second=None, unit_seconds=0.1, most_chunks=8) is ALONE


def test_a_unit_keeps_its_outputs_within_the_memory_cap() -> None:
    unit = choose_unit(batch_rows=128, rows_per_second=1e6, unit_seconds=0.1, most_chunks=16,
                       output_bytes_per_row=1_000, max_output_bytes=1_000_000)
    assert unit.max_rows == 1_000  # not the 100,000 rows the rate allows
    tight = choose_unit(batch_rows=128, rows_per_second=1e6, unit_seconds=0.1, most_chunks=16,
                        output_bytes_per_row=1_000, max_output_bytes=10)
    assert tight.max_rows == 128  # never below one mini-batch


def test_one_chunk_a_unit_or_one_row_batches_run_alone() -> None:
    assert choose_unit(batch_rows=64, rows_per_second=1e6, unit_seconds=0.1, most_chunks=1) is ALONE
    assert choose_unit(batch_rows=1, rows_per_second=1e6, unit_seconds=0.1, most_chunks=8) is ALONE


@given(batch=st.integers(2, 4096), rate=st.one_of(st.none(), st.floats(0.001, 1e7)),
       seconds=st.floats(0.001, 10.0), chunks=st.integers(2, 64), per_row=st.integers(0, 10_000),
       cap=st.integers(0, 1 << 30))
def test_a_unit_is_never_smaller_than_a_batch_nor_past_the_rate_or_memory(batch: int, rate: float | None,
                                                                           seconds: float, chunks: int,
                                                                           per_row: int, cap: int) -> None:
    unit = choose_unit(batch_rows=batch, rows_per_second=rate, unit_seconds=seconds, most_chunks=chunks,
                       output_bytes_per_row=per_row, max_output_bytes=cap)
    if rate is None:
        assert unit is ALONE
        return
    assert unit.max_chunks == chunks and unit.max_rows >= batch
    assert unit.max_rows <= max(batch, rate * seconds)
    if per_row and cap:
        assert unit.max_rows <= max(batch, cap // per_row)


def create(store: Store, job_id: str, *, rows: int, chunk: int, priority: int = 0,
           max_slots: int | None = None, tenant: str = "acme") -> None:
    spec = dataclasses.replace(job_spec(job_id, rows_total=rows, chunk_size=chunk, priority=priority),
                               max_slots=max_slots, tenant=tenant)
    job_fills.create_job(store, spec, now=NOW)


def lease(store: Store, *, max_chunks: int, merge_rows: int) -> list[str]:
    options = LeaseOptions(max_items=8, max_chunks=max_chunks, merge_rows=merge_rows)
    return [item.item_id for item in leases.lease_batch(store, MODEL_REF, options, now=NOW + 1,
                                                        lease_seconds=30).items]


def test_a_head_chunk_takes_small_jobs_along_within_the_units_rows(store: Store) -> None:
    for number in range(5):
        create(store, f"jsmall{number}", rows=30, chunk=30, priority=5 - number)  # in this order

    assert lease(store, max_chunks=8, merge_rows=100) == ["jsmall0:c0000000", "jsmall1:c0000000",
                                                         "jsmall2:c0000000"]  # a fourth: 120 rows
    assert lease(store, max_chunks=1, merge_rows=100) == ["jsmall3:c0000000"]  # one chunk a unit: alone


def test_a_unit_keeps_queue_order_and_a_chunk_too_large_for_it_ends_it(store: Store) -> None:
    create(store, "jfirst", rows=20, chunk=20, priority=9)
    create(store, "jlarge", rows=1_000, chunk=500, priority=8)
    create(store, "jlater", rows=20, chunk=20, priority=7)

    assert lease(store, max_chunks=8, merge_rows=100) == ["jfirst:c0000000"]  # jlater does not pass jlarge
    assert lease(store, max_chunks=8, merge_rows=100) == ["jlarge:c0000000"]  # past the unit, still the head


def test_a_unit_takes_no_finalize_step_and_a_finalize_step_goes_alone(store: Store) -> None:
    create(store, "jdone", rows=10, chunk=10, priority=9)
    [chunk] = leases.lease_batch(store, MODEL_REF, LeaseOptions(max_items=8, max_chunks=1), now=NOW + 1,
                                 lease_seconds=30).items
    ack(store, chunk, now=NOW + 2)  # queues jdone's finalize step, ranked as its chunk was
    create(store, "jbefore", rows=10, chunk=10, priority=9)  # (same score: before the step by its id)
    create(store, "jnext", rows=10, chunk=10, priority=1)

    assert lease(store, max_chunks=8, merge_rows=100) == ["jbefore:c0000000"]
    assert lease(store, max_chunks=8, merge_rows=100) == ["jdone:final"]
    assert lease(store, max_chunks=8, merge_rows=100) == ["jnext:c0000000"]


def test_without_merge_rows_the_chunks_are_counted_alone(store: Store) -> None:
    create(store, "jbig", rows=4_000, chunk=1_000)
    assert len(lease(store, max_chunks=3, merge_rows=0)) == 3  # (as before run units: max_chunks alone)


def test_a_unit_stays_within_a_jobs_slot_cap(store: Store) -> None:
    create(store, "jcapped", rows=10, chunk=1, max_slots=2, priority=9)
    create(store, "jother", rows=2, chunk=1, priority=1)
    taken = lease(store, max_chunks=8, merge_rows=100)
    assert [item.split(":c")[0] for item in taken] == ["jcapped", "jcapped", "jother", "jother"]


def test_a_unit_takes_only_its_head_tenants_chunks(store: Store) -> None:
    """A hostile tenant's rows that crash a run must not cost another tenant's chunks their attempts: a unit
    never mixes tenants, and the other tenant's chunk ends it (queue order holds)."""
    create(store, "jacme1", rows=10, chunk=10, priority=9)
    create(store, "jevil", rows=10, chunk=10, priority=8, tenant="evil")
    create(store, "jacme2", rows=10, chunk=10, priority=7)

    assert lease(store, max_chunks=8, merge_rows=100) == ["jacme1:c0000000"]
    assert lease(store, max_chunks=8, merge_rows=100) == ["jevil:c0000000"]
    assert lease(store, max_chunks=8, merge_rows=100) == ["jacme2:c0000000"]
