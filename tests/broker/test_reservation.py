"""Memory reservations in granularity units, fragmentation, and EASY backfilling."""

from __future__ import annotations

from broker.reservation import MemoryLedger, admissible_models, batch_need_bytes, round_up

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


def test_backfill_runs_small_short_batches_only_when_they_do_not_delay_the_head() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    ledger.reserve(768 * MIB, now=0, expected_seconds=2.0)  # a running batch; 256 MiB free until t=2
    need = {"head": 512 * MIB, "small-fast": 128 * MIB, "small-slow": 128 * MIB, "big": 384 * MIB}
    seconds = {"head": 1.0, "small-fast": 0.5, "small-slow": 5.0, "big": 0.1}
    order = ["head", "small-fast", "small-slow", "big"]

    allowed = admissible_models(order, need.__getitem__, seconds.__getitem__, ledger, now=0.0, backfill=True)
    assert allowed == ["small-fast"]  # fits and ends before t=2; small-slow would delay the head, big does not fit
    assert admissible_models(order, need.__getitem__, seconds.__getitem__, ledger, now=0.0, backfill=False) == []


def test_the_head_goes_first_when_it_fits() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    order = ["head", "other"]
    assert admissible_models(order, lambda m: 128 * MIB, lambda m: 1.0, ledger, now=0, backfill=True) == order
    ledger.reserve(5000 * MIB, now=0, expected_seconds=1)  # one batch larger than the device still runs
    assert ledger.stats()["batches_running"] == 1


def test_mean_fragmentation_weighs_each_reservation_by_how_long_it_was_held() -> None:
    ledger = MemoryLedger(capacity_bytes=1024 * MIB, granularity=128 * MIB)
    exact = ledger.reserve(128 * MIB, now=0.0, expected_seconds=1)  # no waste for 1 s
    ledger.release(exact, now=1.0)
    wasteful = ledger.reserve(64 * MIB, now=1.0, expected_seconds=1)  # half wasted for 1 s
    ledger.release(wasteful, now=2.0)
    assert ledger.stats()["fragmentation_mean"] == 0.25
