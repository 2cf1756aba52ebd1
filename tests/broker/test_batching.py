"""Batching settings: `auto` values from the measured profile, and Triton's preferred-size rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.batching import FALLBACK_MAX_BATCH_SIZE, MAX_AUTO_DELAY, Batching, resolve
from broker.config import ConfigError, ModelBatching, load_settings


def record(points: list[tuple[int, float]], source: str = "measured") -> dict:
    """A registry record whose profile measured (batch size, latency ms) points."""
    return {"profile": {"source": source, "points": [
        {"batch_size": size, "latency_ms": latency, "rows_per_second": size / latency * 1000}
        for size, latency in points]}}


CNN_LIKE = record([(1, 1.5), (2, 3.0), (4, 6.1), (8, 12.0), (16, 24.5), (32, 49.0), (64, 98.0)])
MLP_LIKE = record([(1, 0.02), (8, 0.03), (128, 0.15), (1024, 1.1)])


def test_auto_max_batch_size_is_the_largest_measured_batch_that_runs_within_the_latency_budget():
    assert resolve(ModelBatching(), CNN_LIKE).max_batch_size == 32  # 49 ms fits 50 ms, 98 ms does not
    assert resolve(ModelBatching(max_batch_latency="10ms"), CNN_LIKE).max_batch_size == 4
    assert resolve(ModelBatching(), MLP_LIKE).max_batch_size == 1024
    # even one row runs longer than the budget: batches of the smallest measured size
    assert resolve(ModelBatching(max_batch_latency="1ms"), CNN_LIKE).max_batch_size == 1


def test_auto_delay_is_one_row_s_run_time_when_that_is_worth_a_wait_and_capped():
    assert resolve(ModelBatching(), CNN_LIKE).max_queue_delay == pytest.approx(0.0015)
    assert resolve(ModelBatching(), MLP_LIKE).max_queue_delay == 0.0  # 20 µs: shorter than a round trip
    slow = record([(1, 80.0), (2, 150.0)])
    assert resolve(ModelBatching(), slow).max_queue_delay == MAX_AUTO_DELAY


def test_without_a_measured_profile_auto_means_the_static_defaults():
    for unmeasured in ({}, {"profile": {"source": "static"}}, record([(128, 1.0), (1024, 8.0)], source="observed")):
        batching = resolve(ModelBatching(), unmeasured)
        assert (batching.max_batch_size, batching.max_queue_delay, batching.source) == (
            FALLBACK_MAX_BATCH_SIZE, 0.0, "config")


def test_configured_values_win_over_the_profile():
    batching = resolve(ModelBatching(max_batch_size=8, max_queue_delay="3ms", preferred_batch_sizes=[4, 2]), CNN_LIKE)
    assert (batching.max_batch_size, batching.max_queue_delay, batching.preferred_batch_sizes, batching.source) == (
        8, 0.003, (2, 4), "config")
    assert resolve(ModelBatching(max_batch_size=8), CNN_LIKE).source == "profile"  # the delay came from it


def test_preferred_sizes_above_an_auto_max_batch_size_are_dropped():
    batching = resolve(ModelBatching(preferred_batch_sizes=[4, 16, 64]), CNN_LIKE)
    assert (batching.max_batch_size, batching.preferred_batch_sizes) == (32, (4, 16))


def batching(max_batch_size: int = 8, delay: float = 0.0, preferred: tuple[int, ...] = ()) -> Batching:
    return Batching(max_batch_size=max_batch_size, max_queue_delay=delay, preferred_batch_sizes=preferred,
                    max_batch_tokens=0, queue_capacity=1024, source="config")


def test_the_batch_takes_the_largest_preferred_size_the_queue_fills_else_a_full_batch():
    preferring = batching(16, preferred=(4, 8))
    assert [preferring.rows_to_take(waiting) for waiting in (1, 3, 4, 7, 8, 13, 40)] == [16, 16, 4, 4, 8, 8, 8]
    assert batching(16).rows_to_take(5) == 16


def test_the_head_waits_for_company_until_a_full_or_preferred_batch_or_the_delay():
    preferring = batching(16, delay=0.01, preferred=(4, 8))
    assert not preferring.wait_over(3, 0.005)
    assert preferring.wait_over(4, 0.0)  # a preferred batch runs at once
    assert preferring.wait_over(3, 0.01)  # the delay is up: what is there runs
    assert batching(16, delay=0.01).wait_over(16, 0.0)
    assert not batching(16, delay=0.01).wait_over(15, 0.0)
    assert batching(16).wait_over(1, 0.0)  # no delay: never waits


@given(st.integers(1, 64), st.lists(st.integers(1, 64), max_size=4), st.integers(0, 200))
def test_a_batch_never_exceeds_max_batch_size_nor_skips_a_preferred_size_it_can_fill(max_size, preferred, waiting):
    sizes = tuple(sorted({size for size in preferred if size <= max_size}))
    rows = batching(max_size, preferred=sizes).rows_to_take(waiting)
    assert 1 <= rows <= max_size
    fillable = [size for size in sizes if size <= waiting]
    assert rows == (max(fillable) if fillable else max_size)


@pytest.mark.parametrize("entry, message", [
    ("{max_batch_size: 0}", "neither a batch size"),
    ("{max_batch_size: big}", "neither a batch size"),
    ("{max_queue_delay: -5ms}", "not a duration"),
    ("{max_queue_delay: .nan}", "not a finite duration"),
    ("{preferred_batch_sizes: [0, 4]}", "not a list of batch sizes"),
    ("{preferred_batch_sizes: 4}", "not a list of batch sizes"),
    ("{max_batch_size: 8, preferred_batch_sizes: [4, 16]}", "go beyond max_batch_size 8"),
    ("{max_batch_latency: 0}", "greater than 0"),
])
def test_bad_batching_settings_are_refused_with_the_reason(tmp_path, entry, message):
    path = tmp_path / "sits.yaml"
    path.write_text(f"online:\n  models:\n    mlp: {entry}\n")
    with pytest.raises(ConfigError, match=message):
        load_settings(path)
