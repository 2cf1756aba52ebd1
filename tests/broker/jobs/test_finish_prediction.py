"""Deadline admission's arithmetic (`broker/jobs/finish_prediction.py`) and a deadline's place in the queue
(`scoring.deadline_order_time`), the Lua re-score included.

Times are plain numbers from `NOW`: the functions take the clock as an argument.
"""

from __future__ import annotations

import json
import math

import pytest

from broker.jobs import fills as job_fills
from broker.jobs.finish_prediction import (
    CHUNK_OVERHEAD_SECONDS,
    EXACT_CHUNKS,
    Fleet,
    Verdict,
    Work,
    admit,
    finishes,
    recalibrated,
    sla_risk,
    work_seconds,
)
from broker.jobs.records import job_factors
from broker.queueing import policy
from broker.queueing.scoring import Factors, Weights, deadline_order_time, queue_key
from broker.sla.admission import blocking
from broker.state.store import Store
from tests.broker.broker_helpers import MODEL_REF, NOW, job_spec


def test_work_is_rows_at_the_models_speed_plus_a_fixed_cost_per_chunk() -> None:
    assert work_seconds(1000, seconds_per_row=0.001, chunks=4) == pytest.approx(1.0 + 4 * CHUNK_OVERHEAD_SECONDS)
    assert work_seconds(-5, seconds_per_row=0.001, chunks=0) == 0.0


def test_chunks_go_to_the_slot_that_frees_first_in_score_order() -> None:
    """Two slots, one held 1 s by a running chunk: a one-chunk job takes the free slot, the next one the
    other; a job of four 5 s chunks then takes whichever frees first, and ends with its last chunk."""
    ordered = [Work("a", 1.0, 10.0), Work("b", 2.0, 20.0), Work("c", 3.0, 20.0, chunks=4)]
    fleet = Fleet(slots=2, blocking_seconds=1.0)
    # c: three chunks on the slot a freed at +10 (to +25), the fourth on b's from +21 (to +26)
    assert finishes(ordered, fleet, now=NOW) == [NOW + 10.0, NOW + 21.0, NOW + 26.0]
    assert finishes(ordered, Fleet(slots=1), now=NOW) == [NOW + 10.0, NOW + 30.0, NOW + 50.0]  # one by one
    assert finishes(ordered, Fleet(slots=0), now=NOW) == [math.inf] * 3


def test_running_chunks_of_later_work_hold_every_slot_they_run_on_and_each_job_has_its_latency() -> None:
    ordered = [Work("a", 1.0, 10.0), Work("b", 2.0, 10.0)]

    both_held = Fleet(slots=2, blocking_seconds=1.0, blocked_slots=2, job_latency_seconds=0.5)
    assert finishes(ordered, both_held, now=NOW) == [NOW + 11.5, NOW + 11.5]
    assert finishes(ordered, Fleet(slots=2, blocking_seconds=1.0, blocked_slots=5), now=NOW) == [NOW + 11.0] * 2


def test_a_job_of_many_chunks_is_poured_over_the_slots_as_they_free() -> None:
    """Beyond `EXACT_CHUNKS`, a job fills the slots to one level: 30 s of work over slots free at +0 and
    +10 ends at +20 (20 s on the first, 10 s on the second)."""
    ordered = [Work("head", 1.0, 10.0), Work("many", 2.0, 30.0, chunks=EXACT_CHUNKS + 1)]
    assert finishes(ordered, Fleet(slots=2), now=NOW) == [NOW + 10.0, pytest.approx(NOW + 20.0)]


def test_a_job_is_admitted_when_its_finish_with_the_margin_is_within_its_deadline() -> None:
    ahead = [Work("old", 1.0, 60.0)]
    new = Work("new", 5.0, 40.0, deadline_at=NOW + 110.0)  # finishes at +100, needs +110 with a 0.1 margin

    assert admit(new, ahead, Fleet(1), now=NOW, margin=0.1).feasible
    refused = admit(new, ahead, Fleet(1), now=NOW, margin=0.2)
    assert not refused.feasible and refused.predicted_finish == NOW + 100.0
    assert refused.earliest_deadline == pytest.approx(NOW + 120.0)
    assert refused.reason == "its own work and the work ahead of it"


def test_a_job_that_would_push_an_accepted_one_past_its_deadline_is_refused_without_naming_it() -> None:
    """The accepted job may be another tenant's: its id answers 404 to this caller, so a refusal names none."""
    accepted = Work("due", 10.0, 50.0, deadline_at=NOW + 55.0)  # alone: done at +50, on time
    newcomer = Work("new", 1.0, 10.0, deadline_at=NOW + 30.0)  # ahead of it: done at +10, but "due" at +60

    verdict = admit(newcomer, [accepted], Fleet(1), now=NOW, margin=0.0)

    assert not verdict.feasible and verdict.predicted_finish == NOW + 10.0
    assert verdict.reason == "an accepted job would then miss its deadline" and "due" not in verdict.reason
    assert verdict.tipped_deadline == NOW + 55.0


def test_a_refusal_tells_the_deadline_of_the_job_it_would_tip_over_to_the_minute_only() -> None:
    """Its earliest deadline was that job's deadline plus one second: a tenant probing deadlines read another
    tenant's job's deadline off it. It is now the whole minute past it."""
    from broker.sla.admission import PAST_A_DEADLINE_SECONDS, _earliest_feasible
    tipped_at = 1_800_000_017.4  # (any second of a minute)

    def verdict_at(deadline: float) -> Verdict:  # behind the accepted job once past its deadline
        return Verdict(NOW, deadline > tipped_at, NOW + 1.0, "", None if deadline > tipped_at else tipped_at)

    earliest = _earliest_feasible(verdict_at(tipped_at - 100), verdict_at, tipped_at - 100)

    assert earliest % PAST_A_DEADLINE_SECONDS == 0 and tipped_at < earliest <= tipped_at + 1 + PAST_A_DEADLINE_SECONDS
    own = _earliest_feasible(Verdict(NOW, False, NOW + 75.2), lambda deadline: Verdict(NOW, True, deadline), NOW)
    assert own % PAST_A_DEADLINE_SECONDS == 0 and NOW + 75.2 <= own < NOW + 75.2 + PAST_A_DEADLINE_SECONDS


def test_a_refusal_reads_the_same_whether_its_own_work_or_another_job_s_deadline_refused_it() -> None:
    """"an accepted job would then miss its deadline" appeared only when the probe's deadline lay before the other
    job's: refused probes on either side of it found another tenant's deadline to the fraction of a second."""
    from broker.sla.admission import Prediction, refusal
    own = Verdict(NOW + 10.0, False, NOW + 120.0, "its own work and the work ahead of it")
    tipping = Verdict(NOW + 10.0, False, NOW + 120.0, "an accepted job would then miss its deadline", NOW + 55.0)

    said = [refusal(Prediction(verdict, "static", 1, 4.0, 6.0), deadline_at=NOW + 5.0, rows=100, now=NOW)
            for verdict in (own, tipping)]

    assert said[0] == said[1] and "miss" not in said[0]


def test_an_accepted_job_keeps_its_margin_when_a_newcomer_passes_it() -> None:
    accepted = Work("due", 10.0, 45.0, deadline_at=NOW + 52.0)  # 45 s, 49.5 s with a 10 % margin
    newcomer = Work("new", 1.0, 2.0, deadline_at=NOW + 20.0)  # passes it: 47 s, 51.7 s with the margin

    assert admit(newcomer, [accepted], Fleet(1), now=NOW, margin=0.1).feasible
    assert not admit(Work("new", 1.0, 4.0, deadline_at=NOW + 20.0), [accepted], Fleet(1), now=NOW,
                     margin=0.1).feasible  # 49 s, but 53.9 s with the margin: past 52 s


def test_a_job_already_late_does_not_make_a_newcomer_infeasible() -> None:
    late = Work("late", 10.0, 100.0, deadline_at=NOW + 50.0)
    assert admit(Work("new", 1.0, 5.0, deadline_at=NOW + 20.0), [late], Fleet(1), now=NOW, margin=0.0).feasible


def test_a_job_within_its_margin_is_still_kept_from_being_pushed_later() -> None:
    """Accepted with room, it ran slower: 48 s left for a deadline 50 s away is on time, but not with a
    10 % margin (52.8 s). A newcomer that passes it would push it further and is refused; one behind it
    is not."""
    slowed = Work("slowed", 10.0, 48.0, deadline_at=NOW + 50.0)
    ahead = admit(Work("new", 1.0, 1.0, deadline_at=NOW + 20.0), [slowed], Fleet(1), now=NOW, margin=0.1)
    assert not ahead.feasible and ahead.tipped_deadline == NOW + 50.0
    assert admit(Work("new", 20.0, 1.0, deadline_at=NOW + 60.0), [slowed], Fleet(1), now=NOW, margin=0.1).feasible


def test_without_a_live_worker_nothing_is_feasible() -> None:
    verdict = admit(Work("new", 1.0, 5.0, deadline_at=NOW + 1e6), [], Fleet(0), now=NOW, margin=0.0)
    assert not verdict.feasible and verdict.reason == "no live worker can run it"
    assert math.isinf(verdict.earliest_deadline)


def test_sla_risk_is_one_half_on_time_and_grows_as_the_prediction_passes_the_deadline() -> None:
    assert sla_risk(NOW + 100, NOW + 100, now=NOW) == 0.5
    assert sla_risk(NOW + 50, NOW + 100, now=NOW) < 0.01
    assert sla_risk(NOW + 130, NOW + 100, now=NOW) > 0.95
    assert sla_risk(math.inf, NOW + 100, now=NOW) == 1.0
    assert sla_risk(None, NOW + 100, now=NOW) is None and sla_risk(NOW, None, now=NOW) is None
    # the same lateness is surer on a short prediction than on a long one
    assert sla_risk(NOW + 66, NOW + 60, now=NOW) == sla_risk(NOW + 3960, NOW + 3600, now=NOW)
    assert sla_risk(NOW + 66, NOW + 60, now=NOW) > 0.8 > 0.6 > sla_risk(NOW + 3606, NOW + 3600, now=NOW)


def test_deadlines_within_the_horizon_order_earliest_first_and_ahead_of_earlier_arrivals() -> None:
    weights = Weights()
    plain = queue_key(job_factors(0, NOW), weights)
    soon = queue_key(job_factors(0, NOW + 10, deadline_order_time(NOW + 10, NOW + 70, 300)), weights)
    sooner = queue_key(job_factors(0, NOW + 20, deadline_order_time(NOW + 20, NOW + 40, 300)), weights)
    far = queue_key(job_factors(0, NOW + 5, deadline_order_time(NOW + 5, NOW + 3600, 300)), weights)

    assert sooner < soon < plain < far  # EDF within the horizon; beyond it, arrival order
    assert far == queue_key(job_factors(0, NOW + 5), weights)
    # a deadline counts as waiting: due in 4.5 minutes is 30 s of it (3 points), in 1 minute 240 s (24)
    level_9, express = queue_key(job_factors(9, NOW), weights), queue_key(job_factors(12, NOW), weights)
    later = queue_key(job_factors(0, NOW, deadline_order_time(NOW, NOW + 270, 300)), weights)
    assert level_9 < later and soon < level_9 and express < sooner
    assert queue_key(job_factors(0, NOW + 10, NOW - 230), weights, "fifo") == NOW + 10 - 1_704_067_200.0


def test_factors_keep_their_order_time_through_the_payload() -> None:
    factors = job_factors(3, NOW, NOW - 100)
    assert Factors.from_dict(json.loads(json.dumps(factors.to_dict()))) == factors
    assert job_factors(3, NOW, NOW + 100).order_at is None  # never later than the arrival
    assert "order_at" not in job_factors(3, NOW).to_dict()


def test_the_lua_rescore_computes_the_same_key_for_a_job_with_a_deadline(store: Store) -> None:
    spec = job_spec("jdeadline", rows_total=4, chunk_size=1, priority=2)
    spec = type(spec)(**{**spec.__dict__, "deadline_at": NOW + 60})
    job_fills.create_job(store, spec, now=NOW, deadline_horizon=300)
    weights = Weights(alpha=1.0, delta=0.5)

    policy.rescore_all(store, weights, "dynamic")

    scored = store.client.zrange(store.keys.ready(MODEL_REF), 0, -1, withscores=True)
    assert len(scored) == 4
    for item_id, score in scored:
        factors = Factors.from_dict(json.loads(store.client.hget(store.keys.items, item_id))["factors"])
        assert factors.order_at == NOW - 240
        assert score == pytest.approx(queue_key(factors, weights), rel=1e-12)
        assert score < queue_key(job_factors(2, NOW), weights)


def test_a_models_calibration_follows_its_jobs_real_over_foreseen_run_times_within_bounds() -> None:
    assert recalibrated(1.0, real=20.0, predicted=10.0) == pytest.approx(1.3)  # 0.7 x 1 + 0.3 x 2
    assert recalibrated(2.0, real=20.0, predicted=10.0) == pytest.approx(2.0)  # as calibrated: no change
    factor = 1.0
    for _ in range(50):
        factor = recalibrated(factor, real=1000.0, predicted=1.0)  # 1000x slower than its profile
    assert factor == pytest.approx(10.0, rel=1e-3)
    assert recalibrated(1.5, real=0.0, predicted=10.0) == 1.5
    # a model's first jobs are averaged plainly: the first sets the factor, the second halves the way
    assert recalibrated(1.0, real=30.0, predicted=10.0, samples=1) == pytest.approx(3.0)
    assert recalibrated(3.0, real=10.0, predicted=10.0, samples=2) == pytest.approx(2.0)
    assert recalibrated(2.0, real=10.0, predicted=10.0, samples=9) == pytest.approx(1.7)


def test_a_reaper_pass_without_deadline_jobs_prunes_ended_jobs_from_the_active_index(store: Store) -> None:
    """No job with a deadline is active, so the pass reads only a page of the index and drops what ended."""
    from broker.config.settings import Settings
    from broker.sla import admission

    for job_id in ("jdone", "jlive"):
        job_fills.create_job(store, job_spec(job_id, rows_total=2, chunk_size=1), now=NOW)
    store.client.hset(store.keys.job("jdone"), "status", "succeeded")  # as its finalize step leaves it

    assert admission.reaper_pass(Settings(), store, now=NOW + 1) == 1
    assert store.client.zrange(store.keys.jobs_active, 0, -1) == ["jlive"]


def test_running_chunks_behind_a_job_block_it_for_a_whole_chunk_of_the_slowest_on_the_slots_they_fill() -> None:
    running = [Work("ahead", 1.0, 30.0, chunks=3), Work("slow", 5.0, 12.0, chunks=4), Work("one", 6.0, 5.0)]

    assert blocking(running, 2.0, slots=4, now=NOW) == (5.0, 4)  # 'one' is a 5 s chunk; 'slow' fills 4 slots
    assert blocking(running, 5.5, slots=4, now=NOW) == (5.0, 1)
    assert blocking(running, 9.0, slots=4, now=NOW) == (0.0, 0)  # everything running is ahead of it


def test_a_running_chunk_blocks_only_for_what_is_left_of_it_since_its_job_s_latest_chunk_began() -> None:
    """'slow' runs 3 s chunks, its latest begun 1 s ago; 'one' a 5 s chunk begun 4.5 s ago; a chunk that
    ran past its time holds nothing more, and one whose start is unknown holds a whole chunk."""
    running = [Work("slow", 5.0, 12.0, chunks=4, chunk_started_at=NOW - 1.0),
               Work("one", 6.0, 5.0, chunk_started_at=NOW - 4.5)]

    assert blocking(running, 2.0, slots=4, now=NOW) == (2.0, 4)
    assert blocking(running, 5.5, slots=4, now=NOW) == (0.5, 1)
    assert blocking(running, 5.5, slots=4, now=NOW + 9.0) == (0.0, 1)
    assert blocking([Work("slow", 5.0, 12.0, chunks=4)], 2.0, slots=4, now=NOW) == (3.0, 4)


def test_a_chunk_is_planned_at_the_speed_of_the_pair_it_starts_in_on_its_own_worker() -> None:
    """Two slots of one worker: b's first chunk starts beside a's (a convnet), at the pair's 1.5; its second,
    once a ended, beside its own first chunk, at its plain speed. On two workers of a slot each nothing
    runs beside anything."""
    contention = {("mlp", "convnet"): 1.5}
    ordered = [Work("a", 1.0, 5.0, model="convnet"), Work("b", 2.0, 8.0, chunks=2, model="mlp")]
    shared = Fleet(slots=2, slots_per_worker=2, contention=contention)
    # b: first chunk 4 s x 1.5 on the free slot (+0 to +6); second from +5, where a's slot frees, beside b's
    # first: 4 s (+9)
    assert finishes(ordered, shared, now=NOW) == [NOW + 5.0, NOW + 9.0]
    assert finishes(ordered, Fleet(slots=2, slots_per_worker=1, contention=contention), now=NOW) == [
        NOW + 5.0, NOW + 8.0]
    assert finishes(ordered, Fleet(slots=2, slots_per_worker=2), now=NOW) == [NOW + 5.0, NOW + 8.0]


def test_the_first_chunks_run_beside_what_runs_now_and_a_poured_job_beside_itself() -> None:
    contention = {("mlp", "convnet"): 2.0, ("mlp", "mlp"): 1.25}
    head = [Work("a", 1.0, 4.0, model="mlp")]
    # the other slot runs a convnet chunk now (and frees at this moment, as far as the plan knows)
    beside_cnn = Fleet(slots=2, slots_per_worker=2, contention=contention, running_models=["", "convnet"])
    assert finishes(head, beside_cnn, now=NOW) == [NOW + 8.0]
    many = [Work("many", 1.0, 20.0, chunks=EXACT_CHUNKS + 1, model="mlp")]
    assert finishes(many, Fleet(slots=2, slots_per_worker=2, contention=contention), now=NOW) == [NOW + 12.5]
    assert finishes(many, Fleet(slots=2, slots_per_worker=1, contention=contention), now=NOW) == [NOW + 10.0]


def test_a_short_job_keeps_at_least_the_margin_floor_in_hand() -> None:
    """0.6 s of work: 10 % of it is 0.06 s, but the floor keeps 0.25 s, so a deadline 0.8 s away is refused
    and one 0.9 s away accepted; on a job of 100 s the share (10 s) is what counts."""
    short = Work("short", 1.0, 0.6, deadline_at=NOW + 0.8)
    refused = admit(short, [], Fleet(1), now=NOW, margin=0.1, margin_floor=0.25)
    assert not refused.feasible and refused.earliest_deadline == pytest.approx(NOW + 0.85)
    assert admit(Work("short", 1.0, 0.6, deadline_at=NOW + 0.9), [], Fleet(1), now=NOW, margin=0.1,
                 margin_floor=0.25).feasible
    assert admit(short, [], Fleet(1), now=NOW, margin=0.1).feasible  # without the floor: 0.66 s
    assert admit(Work("long", 1.0, 100.0, deadline_at=NOW + 110.0), [], Fleet(1), now=NOW, margin=0.1,
                 margin_floor=0.25).feasible
