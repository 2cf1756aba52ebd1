"""Memory reservations in granularity units, fragmentation, and EASY backfilling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.memory.ledger import Claim, MemoryLedger, round_up
from broker.memory.reservation import (
    Admission,
    BatchCost,
    admit,
    admit_and_hold,
    batch_need_bytes,
    count_lease,
)
from broker.models.model_record import ModelRecord
from broker.online import requests
from broker.online.requests import RequestSpec
from broker.state.store import Store
from tests.broker.broker_helpers import NOW
from tests.leasing import lease_items

MIB = 2**20


def test_reservations_are_whole_granularity_units_and_fragmentation_is_the_unused_share() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    assert round_up(1, 128 * MIB) == 128 * MIB and round_up(129 * MIB, 128 * MIB) == 256 * MIB
    first = ledger.reserve(100 * MIB, now=0, expected_seconds=1)
    ledger.reserve(200 * MIB, now=0, expected_seconds=1)
    stats = ledger.stats()
    assert stats["reserved_bytes"] == 384 * MIB and stats["used_bytes"] == 300 * MIB
    assert stats["fragmentation"] == round(84 / 384, 4)
    ledger.release(first)
    assert ledger.free_bytes() == 768 * MIB


def test_a_token_batch_reserves_by_its_token_count() -> None:
    profile = {"sequence_axis": {"input": "ids", "axis": 1}, "activation_bytes_per_token": 1000,
               "activation_bytes_per_sample": 128_000}
    assert batch_need_bytes(profile, rows=4, tokens=50) == 50_000
    assert batch_need_bytes({"activation_bytes_per_sample": 10}, rows=4, tokens=None) == 40


def test_one_batch_larger_than_the_device_still_runs() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(5000 * MIB, now=0, expected_seconds=1)
    assert ledger.stats()["batches_running"] == 1


def test_mean_fragmentation_weighs_each_reservation_by_how_long_it_was_held() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    exact = ledger.reserve(128 * MIB, now=0.0, expected_seconds=1)  # no waste for 1 s
    ledger.release(exact, now=1.0)
    wasteful = ledger.reserve(64 * MIB, now=1.0, expected_seconds=1)  # half wasted for 1 s
    ledger.release(wasteful, now=2.0)
    assert ledger.stats()["fragmentation_mean"] == 0.25


# The graph-aware admission: batches cut by the profile to the memory and time that do not delay the head.

def cost(mib_per_row: float, seconds_per_row: float, max_rows: int = 64) -> BatchCost:
    return BatchCost(bytes_per_row=int(mib_per_row * MIB), seconds_per_row=seconds_per_row, max_rows=max_rows)


TOKEN_PROFILE = {"sequence_axis": {"input": "ids", "axis": 1}, "activation_bytes_per_token": MIB // 8,
                 "activation_bytes_per_sample": 16 * MIB, "reference_sequence_length": 128,
                 "flops_per_sample": 5e7}  # 1 ms per 128-token row by the static estimate


def test_a_backfill_batch_is_cut_to_the_free_memory_and_to_end_before_the_head_starts() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(768 * MIB, now=0, expected_seconds=2.0)  # 256 MiB free until t=2
    costs = {"head": cost(16, 0.01), "small": cost(10, 0.1), "slow": cost(1, 5.0)}  # head: the whole 1 GiB

    admitted = admit(["head", "small", "slow"], costs.__getitem__, ledger, now=0.0, backfill=True)

    # small: 25 rows fit in 256 MiB, 20 rows end by t=2; a whole batch (640 MiB) was refused before.
    assert Admission("small", 20, 0, cut=True) in admitted
    assert not any(a.model == "slow" for a in admitted)  # one row would run past t=2, nothing is free beside
    # The head model's own queue: 16 rows (256 MiB) end by t=2 and fit now, its full batch would not.
    assert Admission("head", 16, 0, cut=True) in admitted
    # First the head's waiting batch all or nothing (up to the 16 rows that fit); the slot counts the outcome.
    assert admitted[0] == Admission("head", 64, 0, cut=True, whole_within=(16, 0))
    assert ledger.stats()["backfills"] == 0


def test_a_backfill_batch_may_outlast_the_head_start_in_the_memory_the_head_leaves_beside_it() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(512 * MIB, now=0, expected_seconds=1.0)
    ledger.reserve(256 * MIB, now=0, expected_seconds=10.0)
    costs = {"head": cost(8, 0.001), "slow": cost(10, 1.0)}  # head: 512 MiB, can start at t=1

    start, beside = ledger.head_window(512 * MIB, now=0.0)
    admitted = admit(["head", "slow"], costs.__getitem__, ledger, now=0.0, backfill=True)

    assert (start, beside) == (1.0, 256 * MIB)
    assert Admission("slow", 25, 0, cut=True) in admitted  # runs ~25 s, in the 256 MiB the head never needs


def test_round_robin_admits_the_head_s_waiting_batch_only_whole_else_waits_and_counts_the_wait() -> None:
    """A full batch of the head (64 rows, 512 MiB) does not fit the 256 MiB free; the batch really
    waiting for it may: it is admitted all or nothing, up to 32 rows. Nothing else is."""
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    handle = ledger.reserve(768 * MIB, now=0, expected_seconds=2.0)
    costs = {"head": cost(8, 0.01), "small": cost(1, 0.001)}

    [whole] = admit(["head", "small"], costs.__getitem__, ledger, now=0.0, backfill=False)
    assert whole == Admission("head", 64, 0, cut=True, whole_within=(32, 0))
    assert whole.reserved_size() == (32, 0) and whole.budget_bytes == 256 * MIB
    assert ledger.stats()["memory_waits"] == 0  # the slot counts one if the whole batch does not fit

    ledger.release(handle)
    ledger.reserve(1024 * MIB, now=0, expected_seconds=2.0)  # not one row fits
    assert admit(["head", "small"], costs.__getitem__, ledger, now=0.0, backfill=False) == []
    assert ledger.stats()["memory_waits"] == 1


def test_the_hold_of_a_whole_admission_covers_the_rows_that_fit_not_a_full_batch() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(768 * MIB, now=0, expected_seconds=2.0)
    costs = {"head": cost(8, 0.01)}

    [_], hold = admit_and_hold(["head"], costs.__getitem__, ledger, now=0.0, backfill=False)

    assert hold is not None and ledger.free_bytes() == 0  # 32 rows: 256 MiB


def test_two_slots_deciding_one_after_the_other_never_admit_on_the_same_memory() -> None:
    """The first slot's decision holds its batch's memory until its lease is reserved for real, so
    the second slot, deciding meanwhile, waits instead of counting the same free bytes."""
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    costs = {"head": cost(8, 0.01)}  # a full batch of 64 rows: 512 MiB

    first, hold = admit_and_hold(["head"], costs.__getitem__, ledger, now=0.0, backfill=False)
    second, _ = admit_and_hold(["head"], costs.__getitem__, ledger, now=0.0, backfill=False)
    third, none = admit_and_hold(["head"], costs.__getitem__, ledger, now=0.0, backfill=False)

    assert first == second == [Admission("head", 64, 0)] and third == [] and none is None
    assert ledger.free_bytes() == 0
    assert hold is not None
    ledger.release(hold, now=0.1)
    assert admit_and_hold(["head"], costs.__getitem__, ledger, now=0.1, backfill=False)[0] == first


def test_when_the_head_fits_it_leases_a_full_batch_and_the_others_are_cut_to_the_free_memory() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(512 * MIB, now=0, expected_seconds=2.0)
    costs = {"head": cost(1, 0.01), "big": cost(16, 0.01), "none": cost(600, 0.01)}

    admitted = admit(["head", "big", "none"], costs.__getitem__, ledger, now=0.0, backfill=False)

    assert admitted == [Admission("head", 64, 0), Admission("big", 32, 0, cut=True)]  # 'none': not one row fits


def test_a_token_model_is_costed_per_token_within_max_batch_tokens() -> None:
    record = {"static_profile": TOKEN_PROFILE}
    token_cost = BatchCost.of(ModelRecord.of(record), max_rows=64, max_tokens=4096)

    assert token_cost.full_tokens == 4096 and token_cost.full_need() == 512 * MIB  # not 64 x 128 tokens
    assert token_cost.need_bytes(rows=2, tokens=1024) == 128 * MIB
    assert token_cost.seconds(rows=2, tokens=1024) == pytest.approx(0.008)  # 8 rows' worth of tokens
    assert token_cost.within("t", 64 * MIB, math.inf) == Admission("t", 64, 512, cut=True)
    assert token_cost.within("t", 64 * MIB, 0.002) == Admission("t", 64, 256, cut=True)  # 2 ms of tokens
    assert token_cost.within("t", 8 * MIB, math.inf) is None  # not one reference-length sequence
    assert batch_need_bytes(TOKEN_PROFILE, rows=2, tokens=None) == 32 * MIB  # rows at the reference length


def test_the_ledger_reports_mean_batches_running_and_memory_reserved() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    first = ledger.reserve(256 * MIB, now=0.0, expected_seconds=1)
    second = ledger.reserve(256 * MIB, now=0.0, expected_seconds=1)
    ledger.release(second, now=1.0)
    ledger.release(first, now=2.0)

    stats = ledger.stats()
    assert stats["batches_running_mean"] == 1.5  # two batches for 1 s, one for 1 s
    assert stats["reserved_share_mean"] == 0.375  # 512 then 256 MiB of 1024


def test_a_token_admission_cuts_the_lease_to_its_tokens(store: Store) -> None:
    """The lease script honours an admission's token limit (the head request always goes)."""
    model = "transformer@v1"
    for index in range(6):
        spec = RequestSpec(request_id=f"r{index}", model_name="transformer", model_version="v1",
                           inputs={"input_ids": np.zeros((1, 512), dtype=np.int64)}, rows=1, tokens=512,
                           bucket="input_ids:~512", factors={"enqueued_at": NOW})
        requests.submit_request(store, spec, score=float(index), now=NOW, max_age_seconds=60)
    ledger = MemoryLedger(capacity_bytes=512 * MIB, granularity=16 * MIB)
    ledger.reserve(256 * MIB + 1, now=NOW, expected_seconds=1.0)  # 17 units: 240 MiB free
    token_cost = BatchCost.of(ModelRecord.of({"static_profile": TOKEN_PROFILE}), max_rows=64, max_tokens=8192)

    [whole, admission] = admit(["transformer@v1"], lambda _: token_cost, ledger, now=NOW, backfill=True)
    # The head's waiting batch, all or nothing: 6 x 512 tokens formed under 8192, more than 1920 fit.
    assert whole.whole_within == (64, 1920) and (whole.max_rows, whole.max_tokens) == (64, 8192)
    assert lease_items(store, model, now=NOW, lease_seconds=30, max_items=64, max_rows=whole.max_rows,
                              max_tokens=whole.max_tokens, whole_within=whole.whole_within) == []
    leased = lease_items(store, model, now=NOW, lease_seconds=30, max_items=64,
                                max_rows=admission.max_rows, max_tokens=admission.max_tokens)

    assert admission.max_tokens == 1920  # 240 MiB at 1/8 MiB per token
    assert [item.item_id for item in leased] == ["r0", "r1", "r2"]  # 3 x 512 tokens; a 4th would not fit
    assert [item.attempts for item in leased] == [1, 1, 1]  # the whole lease that failed took no attempt


def test_a_whole_lease_takes_the_batch_formed_under_the_full_limits_or_nothing(store: Store) -> None:
    model = "mlp@v1"
    for index in range(4):
        spec = RequestSpec(request_id=f"r{index}", model_name="mlp", model_version="v1",
                           inputs={"features": np.zeros((1, 64), dtype=np.float32)}, rows=1, tokens=None,
                           bucket="features", factors={"enqueued_at": NOW})
        requests.submit_request(store, spec, score=float(index), now=NOW, max_age_seconds=60)

    def whole(within_rows: int) -> list[str]:
        leased = lease_items(store, model, now=NOW, lease_seconds=30, max_items=64, max_rows=64,
                                    whole_within=(within_rows, 0))
        return [item.item_id for item in leased]

    assert whole(3) == []  # four wait: not a cut batch of three
    assert whole(4) == ["r0", "r1", "r2", "r3"]


@settings(max_examples=200, deadline=None)
@given(capacity_mib=st.integers(900, 1100),
       running=st.lists(st.tuples(st.integers(1, 8), st.floats(0.0, 5.0)), max_size=4),
       models=st.lists(st.tuples(st.floats(0.5, 300.0), st.floats(0.001, 2.0)), min_size=2, max_size=4))
def test_no_backfill_batch_delays_the_head_or_overfills_the_device(
        capacity_mib: int, running: list[tuple[int, float]], models: list[tuple[float, float]]) -> None:
    ledger = MemoryLedger(capacity_bytes=capacity_mib * MIB, granularity=128 * MIB)
    for units, ends in running:
        ledger.reserve(units * 128 * MIB, now=0.0, expected_seconds=ends)
    costs = {f"m{i}": cost(mib, seconds, max_rows=16) for i, (mib, seconds) in enumerate(models)}
    names = list(costs)
    head_need = costs[names[0]].full_need()
    free = ledger.free_bytes()
    start, beside = ledger.head_window(head_need, now=0.0)

    for admission in admit(names, costs.__getitem__, ledger, now=0.0, backfill=True):
        batch = costs[admission.model]
        need = round_up(batch.need_bytes(rows=admission.reserved_size()[0]), 128 * MIB)
        if admission.whole_within is not None:  # the head itself, all or nothing: only if it fits now
            assert admission.model == names[0] and not ledger.fits(head_need) and need <= free
            continue
        if ledger.fits(head_need):
            assert admission.model == names[0] or need <= free
            continue
        assert need <= free  # fits now
        assert batch.seconds(rows=admission.max_rows) <= start or need <= beside  # never delays the head


# Claims: a job chunk's real need, learnt when it was leased at the head of its queue and did not fit.

def test_a_claimed_chunk_makes_its_model_s_head_wait_for_the_chunk_s_memory() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(512 * MIB, now=0, expected_seconds=2.0)
    costs = {"jobmodel": cost(1, 0.001), "other": cost(1, 0.001)}  # online batches: 64 MiB
    ledger.claim("jobmodel", Claim("j1", 768 * MIB, 1.0))  # its chunk's mini-batches need 768 MiB

    assert admit(["jobmodel", "other"], costs.__getitem__, ledger, now=0.0, backfill=False,
                 head_items={"jobmodel": "j1:c0000000"}) == []
    # The job's next chunk heads the queue: it needs as much. Another item heads it now (a request
    # passed the chunk, or the job's chunks are done: its finalize step needs no device memory):
    # the claim does not count, and without head ids nothing is known of it.
    assert admit(["jobmodel", "other"], costs.__getitem__, ledger, now=0.0, backfill=False,
                 head_items={"jobmodel": "j1:c0000001"}) == []
    for head_items in ({"jobmodel": "r9"}, {"jobmodel": "j1:final"}, {"jobmodel": "j2:c0000000"}, None):
        admitted = admit(["jobmodel", "other"], costs.__getitem__, ledger, now=0.0, backfill=False,
                         head_items=head_items)
        assert [a.model for a in admitted] == ["jobmodel", "other"]


def test_backfill_around_a_claimed_chunk_ends_before_it_can_start() -> None:
    """The chunk at the head keeps its claim like any head: other models' batches are cut to end
    before the running batch frees the chunk's memory, and its own model is not admitted at all."""
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(512 * MIB, now=0, expected_seconds=2.0)  # 512 MiB free until t=2
    costs = {"jobmodel": cost(1, 0.001), "other": cost(1, 0.1)}
    ledger.claim("jobmodel", Claim("j1", 1024 * MIB, 1.0))  # the whole device: nothing free beside it

    admitted = admit(["jobmodel", "other"], costs.__getitem__, ledger, now=0.0, backfill=True,
                     head_items={"jobmodel": "j1:c0000000"})

    assert admitted == [Admission("other", 20, 0, cut=True)]  # 20 rows of 0.1 s end by t=2
    assert admitted[0].budget_seconds == 2.0 and admitted[0].budget_bytes == 512 * MIB


def test_a_claimed_chunk_behind_the_head_is_admitted_only_where_it_fits() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(512 * MIB, now=0, expected_seconds=2.0)
    costs = {"head": cost(1, 0.001), "jobmodel": cost(1, 0.001)}
    heads = {"jobmodel": "j1:c0000000"}

    ledger.claim("jobmodel", Claim("j1", 768 * MIB, 1.0))
    assert [a.model for a in admit(["head", "jobmodel"], costs.__getitem__, ledger, now=0.0, backfill=False,
                                   head_items=heads)] == ["head"]
    ledger.claim("jobmodel", Claim("j1", 256 * MIB, 1.0))
    [_, fitting] = admit(["head", "jobmodel"], costs.__getitem__, ledger, now=0.0, backfill=False, head_items=heads)
    assert fitting.claim == Claim("j1", 256 * MIB, 1.0) and fitting.allows_chunk(256 * MIB, 1.0)
    assert not fitting.allows_chunk(640 * MIB, 1.0)


def test_the_hold_of_an_admitted_claim_covers_the_chunk() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    costs = {"jobmodel": cost(1, 0.001)}
    ledger.claim("jobmodel", Claim("j1", 768 * MIB, 1.0))

    [admission], hold = admit_and_hold(["jobmodel"], costs.__getitem__, ledger, now=0.0, backfill=False,
                                       head_items={"jobmodel": "j1:c0000000"})

    assert admission.claim is not None and ledger.free_bytes() == 256 * MIB
    assert ledger.fits(768 * MIB, instead_of=hold)  # the chunk takes the hold's place
    assert not ledger.fits(768 * MIB)


def test_a_batch_run_in_place_of_another_may_use_its_reservation_and_the_free_memory() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    chunk = ledger.reserve(256 * MIB, now=0, expected_seconds=1.0)
    assert ledger.room_in_place_of(chunk) is None  # nothing else runs: no limit
    ledger.reserve(512 * MIB, now=0, expected_seconds=1.0)

    assert ledger.room_in_place_of(chunk) == 512 * MIB  # its 256 MiB and the 256 MiB free
    assert ledger.reserve_in_place_of(chunk, 640 * MIB, now=0, expected_seconds=0.1) is None
    extra = ledger.reserve_in_place_of(chunk, 500 * MIB, now=0, expected_seconds=0.1)
    assert extra is not None and ledger.free_bytes() == 0  # 256 MiB more than the chunk's own


def test_a_decision_s_hold_keeps_memory_from_other_slots_but_is_no_batch_in_the_stats() -> None:
    """Holds last a Redis round trip and claim a full batch: counted as batches, they made the mean
    fragmentation, memory reserved and batches running describe the holds, not the batches."""
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    costs = {"head": cost(8, 0.01)}  # a full batch: 512 MiB
    _, hold = admit_and_hold(["head"], costs.__getitem__, ledger, now=0.0, backfill=False)
    assert hold is not None and ledger.free_bytes() == 512 * MIB
    ledger.release(hold, now=1.0)
    batch = ledger.reserve(100 * MIB, now=1.0, expected_seconds=1.0)  # what the lease really runs
    ledger.release(batch, now=2.0)

    stats = ledger.stats()
    assert stats["fragmentation_mean"] == round(1 - 100 / 128, 4)  # the batch's unit, not the hold's 512 MiB
    assert stats["batches_running_mean"] == 0.5 and stats["reserved_share_mean"] == 0.0625


def test_after_a_whole_admission_the_slot_counts_what_it_got() -> None:
    """`admit` cannot know whether the head's waiting batch will fit: the slot counts after its lease,
    once per decision: nothing when the head ran, a backfill when a batch around it did, else a wait."""
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(768 * MIB, now=0, expected_seconds=2.0)
    costs = {"head": cost(8, 0.01), "small": cost(1, 0.001)}
    allowed = admit(["head", "small"], costs.__getitem__, ledger, now=0.0, backfill=True)
    assert allowed[0].whole_within is not None and len(allowed) > 1

    count_lease(ledger, allowed, allowed[0])
    assert (ledger.stats()["backfills"], ledger.stats()["memory_waits"]) == (0, 0)
    count_lease(ledger, allowed, allowed[1])
    count_lease(ledger, allowed, None)
    assert (ledger.stats()["backfills"], ledger.stats()["memory_waits"]) == (1, 1)
