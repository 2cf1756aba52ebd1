"""Device OOM's pure decisions: halve, then offload or fail; the learnt batch ceiling and its decay;
what the ledger learns of a row's need (`broker/memory/oom_ceiling.py`, `MemoryLedger.learn_oom`)."""

from __future__ import annotations

from broker.memory import oom_ceiling
from broker.memory.ledger import MemoryLedger
from broker.memory.oom_ceiling import Ceiling, Ceilings, after_oom, halves, lowered, pieces, rows_at_width

MiB = 2**20


def test_a_run_of_many_rows_is_halved_whatever_the_strategy() -> None:
    assert after_oom(64, "cpu-offload-on-oom") == "halve"
    assert after_oom(2, "fail") == "halve"


def test_one_row_that_does_not_fit_is_offloaded_or_failed_as_the_strategy_says() -> None:
    assert after_oom(1, "cpu-offload-on-oom") == "offload"
    assert after_oom(1, "fail") == "fail"


def test_halves_cover_the_rows_once_in_order() -> None:
    assert halves(0, 9) == [(0, 5), (5, 9)]
    assert halves(10, 12) == [(10, 11), (11, 12)]
    assert halves(3, 4) == [(3, 4)]


def test_halving_reaches_one_row_in_log2_levels() -> None:
    todo, levels = [(0, 64)], 0
    while any(stop - start > 1 for start, stop in todo):
        todo = [half for start, stop in todo for half in halves(start, stop)]
        levels += 1
    assert levels == 6 and todo == [(row, row + 1) for row in range(64)]


def test_a_batch_is_cut_into_runs_of_at_most_the_ceiling() -> None:
    assert pieces(10, None) == [(0, 10)]
    assert pieces(10, 16) == [(0, 10)]
    assert pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_the_ceiling_is_half_the_failed_rows_and_doubles_back_until_forgotten() -> None:
    ceiling = lowered(None, 64, now=100.0, decay_seconds=10.0)
    assert ceiling == Ceiling(rows=32, failed_rows=64, set_at=100.0)
    assert ceiling.rows_at(109.9, 10.0) == 32
    assert ceiling.rows_at(110.0, 10.0) is None  # 64 again: what failed, so it is forgotten


def test_a_smaller_failure_under_a_ceiling_lowers_it_further() -> None:
    first = lowered(None, 64, now=0.0, decay_seconds=60.0)
    second = lowered(first, 32, now=1.0, decay_seconds=60.0)
    assert (second.rows, second.failed_rows) == (16, 32)
    assert [second.rows_at(1.0 + 60 * step, 60.0) for step in range(3)] == [16, None, None]


def test_a_larger_failure_never_raises_the_ceiling_in_force() -> None:
    small = lowered(None, 8, now=0.0, decay_seconds=60.0)
    assert lowered(small, 64, now=1.0, decay_seconds=60.0).rows == 4


def test_one_row_that_failed_keeps_a_ceiling_of_one_row_for_a_decay() -> None:
    ceiling = lowered(None, 1, now=0.0, decay_seconds=5.0)
    assert (ceiling.rows_at(4.0, 5.0), ceiling.rows_at(5.0, 5.0)) == (1, None)


def test_no_decay_keeps_no_ceiling() -> None:
    assert lowered(None, 64, now=0.0, decay_seconds=0.0).rows_at(0.0, 0.0) is None


def test_a_worker_s_ceilings_are_per_model_and_forgotten_once_decayed() -> None:
    ceilings = Ceilings(decay_seconds=10.0)
    assert ceilings.lower("mlp@v1", 40, now=0.0) == 20
    assert ceilings.rows("mlp@v1", now=5.0) == 20 and ceilings.rows("bert@v1", now=5.0) is None
    assert ceilings.rows("mlp@v1", now=10.0) is None and ceilings.rows("mlp@v1", now=0.0) is None


def test_a_ceiling_learnt_at_a_width_bounds_rows_times_width() -> None:
    ceiling = lowered(None, 2, now=0.0, decay_seconds=60.0, tokens_per_row=1800)  # 2 rows of 1,800 ran out
    assert ceiling == Ceiling(rows=1, failed_rows=2, set_at=0.0, tokens_per_row=1800)
    at = {width: ceiling.rows_at(1.0, 60.0, width) for width in (512, 900, 1800, 1801, 6000)}
    assert at == {512: None, 900: None, 1800: 1, 1801: 1, 6000: 1}  # (narrower: not bounded; at least one row)
    assert ceiling.rows_at(1.0, 60.0) == 1  # (a run of no known width: cut as at the width learnt)


def test_a_ceiling_at_a_width_doubles_back_and_is_forgotten_at_every_width_at_once() -> None:
    ceiling = Ceiling(rows=2, failed_rows=8, set_at=0.0, tokens_per_row=1000)
    assert [ceiling.rows_at(10.0 * step, 10.0, 2000) for step in range(3)] == [1, 2, None]
    assert [ceiling.rows_at(10.0 * step, 10.0, 1000) for step in range(3)] == [2, 4, None]
    assert [ceiling.rows_at(10.0 * step, 10.0, 500) for step in range(3)] == [None] * 3  # (narrower: not bounded)


def test_rows_at_width_keeps_rows_x_width_and_leaves_models_without_a_sequence_axis_alone() -> None:
    assert rows_at_width(4, 1024, 256) == 16 and rows_at_width(4, 1024, 1000) == 4
    assert rows_at_width(4, 1024, 4096) == 1 and rows_at_width(4, 1024, 10**6) == 1
    assert rows_at_width(4, None, 256) == 4 and rows_at_width(4, 1024, None) == 4


def test_a_model_without_a_sequence_axis_keeps_its_ceiling_in_rows() -> None:
    ceiling = lowered(None, 64, now=0.0, decay_seconds=60.0)
    assert ceiling == Ceiling(rows=32, failed_rows=64, set_at=0.0, tokens_per_row=None)
    assert ceiling.rows_at(1.0, 60.0) == ceiling.rows_at(1.0, 60.0, 512) == 32


def test_a_failure_at_another_width_is_weighed_against_the_ceiling_in_force_in_rows_x_width() -> None:
    narrow = lowered(None, 32, now=0.0, decay_seconds=60.0, tokens_per_row=512)  # 16 rows of 512
    wide = lowered(narrow, 4, now=1.0, decay_seconds=60.0, tokens_per_row=1800)  # 4 of 1,800: within 16 of 512
    assert (wide.rows, wide.failed_rows, wide.tokens_per_row) == (2, 4, 1800)
    assert wide.rows_at(1.0, 60.0, 512) is None  # (narrower than what ran out: not bounded by it)
    narrow_again = lowered(wide, 32, now=2.0, decay_seconds=60.0, tokens_per_row=512)  # learnt anew at 512
    assert (narrow_again.rows, narrow_again.failed_rows, narrow_again.tokens_per_row) == (16, 32, 512)


def test_a_worker_s_ceiling_is_read_at_the_run_s_width_and_shown_at_the_width_learnt() -> None:
    ceilings = Ceilings(decay_seconds=10.0)
    assert ceilings.lower("bert@v1", 2, now=0.0, tokens_per_row=1800) == 1
    assert ceilings.rows("bert@v1", now=1.0, tokens_per_row=512) is None  # (kept: it bounds the wide ones)
    assert ceilings.rows("bert@v1", now=1.0, tokens_per_row=1800) == 1
    assert ceilings.in_force(now=1.0) == {"bert@v1": 1}
    assert ceilings.in_force(now=10.0) == {} and ceilings.rows("bert@v1", now=1.0, tokens_per_row=512) is None


def test_the_ledger_learns_a_row_needs_more_than_its_estimate() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MiB, granularity=2 * MiB)
    assert ledger.row_bytes("mlp@v1", MiB, now=0.0, keep_seconds=60.0) == MiB
    assert ledger.learn_oom("mlp@v1", 64, 64 * MiB, now=0.0) == 2 * MiB  # twice the estimate
    assert ledger.row_bytes("mlp@v1", MiB, now=30.0, keep_seconds=60.0) == 2 * MiB
    assert ledger.row_bytes("bert@v1", MiB, now=30.0, keep_seconds=60.0) == MiB
    assert ledger.row_bytes("mlp@v1", MiB, now=61.0, keep_seconds=60.0) == MiB  # forgotten


def test_what_the_ledger_learns_is_at_most_the_room_the_run_had() -> None:
    ledger = MemoryLedger(capacity_bytes=100 * MiB, granularity=2 * MiB)
    others = ledger.reserve(60 * MiB, now=0.0, expected_seconds=1.0)
    own = ledger.reserve(32 * MiB, now=0.0, expected_seconds=1.0)
    # room: the 100 MiB less the others' 60 MiB, its own 32 MiB counted back in
    assert ledger.learn_oom("mlp@v1", 8, 32 * MiB, now=0.0) == 40 * MiB // 8
    ledger.release(own)
    ledger.release(others)


def test_a_later_oom_never_lowers_what_the_ledger_learnt() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MiB, granularity=2 * MiB)
    ledger.learn_oom("mlp@v1", 4, 64 * MiB, now=0.0)  # 32 MiB a row
    assert ledger.learn_oom("mlp@v1", 64, 64 * MiB, now=1.0) == 32 * MiB


def test_the_module_names_every_step() -> None:
    assert set(oom_ceiling.OomStep.__args__) == {"halve", "offload", "fail"}  # type: ignore[attr-defined]
