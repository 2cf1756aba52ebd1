"""Estimated latency, the input of CP-Score's latency term: measured profile, token prior, static FLOPs."""

from __future__ import annotations

import pytest

from broker.models.model_record import ModelRecord
from broker.queueing.scoring import estimate_latency_ms, rows_to_fill

TOKEN_STATIC = {"sequence_axis": {"input": "input_ids", "axis": 1}, "flops_per_sample": 1e6}


def test_a_measured_profile_scales_its_batch_1_latency_by_rows() -> None:
    record = {"profile": {"points": [{"batch_size": 1, "latency_ms": 2.0}]},
              "static_profile": {"flops_per_sample": 1e9}}
    assert estimate_latency_ms(ModelRecord.of(record), rows=3, tokens=None) == 6.0


def test_measured_batch_sizes_are_interpolated_and_extended_per_row_of_the_largest() -> None:
    """A GPU-like curve: 64 rows cost twice one row, not 64 times."""
    points = [{"batch_size": 1, "latency_ms": 1.0}, {"batch_size": 16, "latency_ms": 1.3},
              {"batch_size": 64, "latency_ms": 2.0}]
    record = {"profile": {"points": points}, "static_profile": {"flops_per_sample": 1e9}}
    assert estimate_latency_ms(ModelRecord.of(record), rows=16, tokens=None) == pytest.approx(1.3)
    assert estimate_latency_ms(ModelRecord.of(record), rows=40, tokens=None) == pytest.approx(1.65)
    assert estimate_latency_ms(ModelRecord.of(record), rows=128, tokens=None) == pytest.approx(4.0)


def test_a_measured_token_model_scales_by_tokens_over_the_profiled_sequence_length() -> None:
    record = {"profile": {"points": [{"batch_size": 1, "latency_ms": 4.0}], "sequence_length": 128},
              "static_profile": TOKEN_STATIC}
    assert estimate_latency_ms(ModelRecord.of(record), rows=1, tokens=128) == pytest.approx(4.0)
    assert estimate_latency_ms(ModelRecord.of(record), rows=2, tokens=2 * 512) == pytest.approx(32.0)


def test_a_token_model_without_a_profile_uses_the_specification_prior() -> None:
    unprofiled = ModelRecord.of({"static_profile": TOKEN_STATIC})
    assert estimate_latency_ms(unprofiled, rows=1, tokens=100) == pytest.approx(240.0)


def test_other_models_without_a_profile_use_static_flops() -> None:
    record = {"static_profile": {"flops_per_sample": 5e7}}
    assert estimate_latency_ms(ModelRecord.of(record), rows=4, tokens=None) == pytest.approx(4.0)


def test_job_rows_fill_an_online_batch_only_while_they_are_nearly_free() -> None:
    flat = ModelRecord.of({"profile": {"points": [{"batch_size": 1, "latency_ms": 1.0},
                                                  {"batch_size": 64, "latency_ms": 1.4}]}})
    linear = ModelRecord.of({"static_profile": {"flops_per_sample": 5e7}})  # 1 ms a row
    assert rows_to_fill(flat, own_rows=3, available=128, max_rows=64, factor=1.5) == 61  # up to the batch limit
    assert rows_to_fill(flat, own_rows=3, available=10, max_rows=64, factor=1.5) == 10  # what the job has
    assert rows_to_fill(linear, own_rows=4, available=128, max_rows=64, factor=1.5) == 2  # 6 rows: 1.5x of 4
    assert rows_to_fill(linear, own_rows=4, available=128, max_rows=64, factor=1.0) == 0
    assert rows_to_fill(linear, own_rows=64, available=128, max_rows=64, factor=3.0) == 0  # the batch is full
